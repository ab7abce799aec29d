"""Before a save: no NaN or infinite weight is ever committed, and replicated buffers are equal."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from hpc_train.errors import NonFiniteError


@torch.no_grad()
def weights_finite(state: Mapping[str, Any], kinds: Mapping[str, str], multi: bool) -> bool:
    """Whether every module's weights in ``state`` are finite on every rank. One host sync per
    save (saves are rare), agreed over ranks so that sharded models decide together."""
    params = [p for k, kind in kinds.items() if kind == "module" for p in state[k].parameters()]
    if not params:
        return True
    # FSDP parameters are DTensors: check this rank's shard (the agreement below covers the rest).
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    bad = torch.stack([p.detach().isfinite().all() for p in local]).all().logical_not().float().reshape(1)
    if multi:
        dist.all_reduce(bad)
    return bad.item() == 0


def check_weights(state: Mapping[str, Any], kinds: Mapping[str, str], multi: bool, step: int, ckpt: Any) -> None:
    """Before a save of ``step``: raise :func:`diverged`'s error if a weight is not finite on some rank."""
    if not weights_finite(state, kinds, multi):
        diverged(step, "a weight about to be saved is NaN or infinite", ckpt)


def diverged(step: int, what: str, ckpt: Any = None) -> None:
    """Raise the one error of a run whose values or weights are not finite (``ckpt``: the run's
    Checkpointer, whose newest save the message names; None: checkpoints off)."""
    last = ckpt.last_step if ckpt is not None else -1
    raise NonFiniteError(
        f"training diverged at step {step}: {what}, not finite on some rank; nothing was saved for this step"
        + (f" (the newest checkpoint is step {last})" if last >= 0 else ""))


@torch.no_grad()
def sync_buffers(replicated: torch.nn.Module | None) -> None:
    """Give every rank rank 0's buffers (BatchNorm statistics) of ``replicated`` (None: nothing
    is replicated over ranks).

    DDP broadcasts rank 0's buffers at the start of every training forward, so rank 0's are
    the canonical ones; syncing makes the replicated tensors truly equal (DCP writes each
    one from whichever rank it picks). Training is unchanged by it (the exactness tests)."""
    if replicated is not None:
        for buf in replicated.buffers():
            dist.broadcast(buf, 0)
