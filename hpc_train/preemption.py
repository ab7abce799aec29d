"""Stop requests: signal handlers that only record, and an agreement at each step boundary.

The handler never saves, logs through locks, or raises (Lightning wrote its checkpoint inside
the handler and sometimes never finished; its exception reached only some DDP ranks and the
job deadlocked). It sets a flag. At each step boundary the trainer folds the flag into one
small all-reduce it already makes for its metrics, so every rank learns that *some* rank was
asked to stop, in the same step, and all of them save and exit together.

Signals: SIGTERM (what a preemption without a user signal and the time limit send, and what
``run`` forwards on Ctrl-C), SIGINT, and the job's ``--signal`` (default USR2: NCCL may catch
USR1). submitit installs its own USR2/TERM handlers in its worker (rank-0-only checkpoint,
then exit); :func:`install` replaces them, so submitit's cannot cut in before ours.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

log = logging.getLogger("hpc_train")


class StopRequest:
    """Records which signal asked this process to stop, and when."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.received_at: float | None = None
        self.count = 0
        self._installed: list[int] = []

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "none"

    def _handler(self, signum: int, frame: object) -> None:
        # Async-signal context: assign and return. No I/O, no locks, no raising.
        self.count += 1
        if self.signum is None:
            self.signum, self.received_at = signum, time.time()

    def install(self, signals: list[str]) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("not on the main thread; stop signals are not handled")
            return
        for name in dict.fromkeys(signals):
            sig = getattr(signal, f"SIG{name}")
            signal.signal(sig, self._handler)
            self._installed.append(sig)

    def ignore_further(self) -> None:
        """After the last step: ignore the job's stop signals for good (SIG_IGN survives
        interpreter teardown, a Python handler does not). SIGTERM and SIGINT are left as they
        are, so the scheduler and the user can still end the process."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self._installed:
            if sig not in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Ask for a stop from code (tests, a user's callback): same path as a signal."""
        self._handler(signum, None)


def stop_signals(job_signal: str) -> list[str]:
    return ["TERM", "INT", job_signal]


class Agreement:
    """What all ranks must agree on after each step, summed over ranks in one collective:
    ``[stop requested, timed checkpoint due, loss sum, correct, count]``.

    Under DDP it rides on the gradient all-reduce: a comm hook appends these five values to
    bucket 0, so stopping together costs no extra collective and no extra synchronisation.
    The values are staged just before the backward of the step's last micro-batch and read
    after it, when DDP has finished every bucket. Without DDP it is one small all-reduce.
    The hook averages gradients exactly as DDP's built-in one does (divide, then sum), so the
    weights are bitwise those of plain DDP.
    """

    def __init__(self, ddp_module=None, multi: bool = False, enabled: bool = True) -> None:
        self.multi, self.enabled = multi, enabled
        self._staged = None
        self._result = None
        self._hooked = ddp_module is not None and multi and enabled
        if self._hooked:
            ddp_module.register_comm_hook(self, _agreement_hook)

    def stage(self, values) -> None:
        self._staged, self._result = values, None

    def collect(self):
        """The summed values (a CPU tensor); call after the step's last backward."""
        import torch.distributed as dist
        staged, result = self._staged, self._result
        self._staged = self._result = None
        if not (self.multi and self.enabled):
            return staged.cpu()
        if self._hooked and result is not None:
            return result.cpu()
        out = staged.clone()
        dist.all_reduce(out)
        return out.cpu()


def _agreement_hook(state: Agreement, bucket):
    import torch
    import torch.distributed as dist
    grads = bucket.buffer()
    grads.div_(dist.get_world_size())             # what DDP's built-in hook does first
    if bucket.index() != 0 or state._staged is None:
        return dist.all_reduce(grads, async_op=True).get_future().then(lambda f: f.value()[0])
    n = grads.numel()
    buf = torch.cat([grads.flatten(), state._staged.to(grads.dtype)])

    def split(fut):
        out = fut.value()[0]
        state._result = out[n:].clone()
        return out[:n]
    return dist.all_reduce(buf, async_op=True).get_future().then(split)
