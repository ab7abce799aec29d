"""BENCHMARK ONLY (benchmarks/preemption.py): the built-in trainer with the per-step stop
agreement switched off, to measure what the agreement costs. Without it a stop reaches only the
signalled rank and the logged metrics are rank 0's own: never train with this.

Used as ``--set train.fn=benchmarks.no_agreement:train`` (with the repository on PYTHONPATH), so
the switch lives here and not in the training loop.
"""

from __future__ import annotations


def train(cfg, env, device):
    import torch

    from hpc_train.node import stops as preemption
    from hpc_train import lifecycle
    from hpc_train.trainer.loop import Trainer

    def collect(self, device):       # this rank's own values, no collective
        values = self._values(device, torch.float32 if self._staged is None else self._staged.dtype)
        self._staged = None
        return values.double().cpu()

    preemption.Agreement.attach = lambda self, ddp: None   # no comm hook: DDP's built-in all-reduce
    preemption.Agreement.collect = collect
    return Trainer(cfg, lifecycle.current()).fit()
