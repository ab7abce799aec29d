"""A Run's reporting, rank 0's alone: ``metrics.jsonl``, TensorBoard and the console line
(:class:`~hpc_train.node.monitor.Monitor`), and the goodput ledger
(:class:`~hpc_train.goodput.Ledger`). Both are built at first use and closed once; other ranks
get None and write nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_train.config import LogSection


class Reporter:
    def __init__(self, log: LogSection, run_dir: Path, is_main: bool) -> None:
        self.log, self.run_dir, self.is_main = log, Path(run_dir), is_main
        self._ledger = None
        self._monitor = None
        self._saved_step: int | None = None

    def ledger(self):
        """Rank 0's goodput ledger; None on other ranks (see :mod:`hpc_train.goodput`)."""
        if self._ledger is None and self.is_main:
            from hpc_train.goodput import Ledger
            self._ledger = Ledger(self.run_dir)
        return self._ledger

    def monitor(self, total_steps: int | None, start_step: int):
        if self._monitor is None:
            from hpc_train.node.monitor import Monitor
            log = self.log
            self._monitor = Monitor(self.run_dir, total_steps, start_step, enabled=self.is_main,
                                    tensorboard=log.tensorboard, progress=log.progress)
        return self._monitor

    def record(self, step: int, scalars: dict[str, Any], total_steps: int | None, start_step: int, *,
               epoch: int | None, console: bool) -> None:
        self.monitor(total_steps, start_step).record(step, scalars, epoch=epoch, console=console)
        if step == self._saved_step:   # logged after its step_end: see checkpointed
            self.flush()

    def checkpointed(self, step: int) -> None:
        """A save of ``step`` begins (either tier): the records up to it go to disk now, and the
        record of ``step`` itself as soon as it is logged. A restart resumes after ``step`` and
        never logs those steps again; records still buffered at a crash (the monitor flushes on
        a clock) would be missing for good, and the node-local tier's restarts resume seconds,
        not minutes, behind."""
        self._saved_step = step
        self.flush()

    def aside(self, step: int, scalars: dict[str, float], total_steps: int | None, start_step: int) -> None:
        self.monitor(total_steps, start_step).aside(step, scalars)

    def saved(self, ledger, step: int, blocked_s: float) -> None:
        """A save blocked the loop ``blocked_s``: the ledger's, and TensorBoard's training share."""
        ledger.saved(blocked_s)
        if self._monitor is not None and self.log.tensorboard:
            share = ledger.training_share()
            if share is not None:
                self._monitor.scalar("goodput/training", share, step)

    def flush(self) -> None:
        if self._monitor is not None:
            self._monitor.flush()

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None
