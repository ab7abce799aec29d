"""What a run reports: per-rank logs, console progress, TensorBoard, ``metrics.jsonl``.

Every rank logs to ``RUN_DIR/logs/rank-R.log`` with ``[rank R]`` in the prefix. Rank 0 also
logs to the console, draws the progress (a bar on a terminal, plain lines in a batch log,
where a bar's carriage returns would make a mess), and writes TensorBoard scalars and
``metrics.jsonl``. After a resume, records past the resumed step are dropped from both, so
curves continue without doubled segments.

Both files are opened once and written through buffers, flushed on a clock by a thread of
the monitor's (every :data:`FLUSH_S`), at once for the first step and an evaluation, and at a
stop and at close: in steady state they cost a shared file system's metadata server nothing
(issue 32), and a crash loses at most the last :data:`FLUSH_S` of records.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hpc_train import rundir
from hpc_train.errors import UsageError, show
from hpc_train.logs import truncate_jsonl

log = logging.getLogger("hpc_train")

# metrics.jsonl and the TensorBoard events are flushed this often, by a thread, so that `status` on
# a running run shows a last step at most about this old, and a crash (kill -9, the watchdog's
# os._exit) loses at most this much; a write of each record would cost a syscall per scalar.
FLUSH_S = 5.0

# Held by the flush thread while it flushes, and by a fork (data-loader workers fork the training
# process): a child is never made while that thread is inside a write holding a buffer's lock.
_flush_lock = threading.Lock()
os.register_at_fork(before=_flush_lock.acquire, after_in_parent=_flush_lock.release,
                    after_in_child=_flush_lock.release)


def _fmt_eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60}:{rem % 60:02d}"


class Monitor:
    """Rank 0's reporter. Other ranks get one whose methods do nothing."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, *, enabled: bool,
                 tensorboard: bool, progress: str) -> None:
        self.enabled = enabled
        self.total = total_steps
        self.start_step = start_step
        self.t0 = time.perf_counter()
        self._bar = None
        self._tb = None
        self._closing = threading.Event()
        if not enabled:
            return
        self.metrics_path = run_dir / rundir.METRICS
        truncate_jsonl(self.metrics_path, start_step)
        if tensorboard:
            from hpc_train.node.tb_events import EventFile
            # purge_step drops events at or after the resume step: no doubled segments.
            self._tb = EventFile(run_dir / rundir.TB, purge_step=start_step + 1 if start_step else None)
        mode = progress if progress != "auto" else ("bar" if sys.stderr.isatty() else "lines")
        if mode == "bar":
            from tqdm import tqdm
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
        self.mode = mode
        from hpc_train.rundir import open_append
        self._f = open_append(self.metrics_path)   # never through a symlink planted there
        self._first = True               # the first step is on disk at once
        self._flusher = threading.Thread(target=self._flush_on_clock, name="hpc_train-metrics", daemon=True)
        self._flusher.start()

    def _flush_on_clock(self) -> None:
        while not self._closing.wait(FLUSH_S):
            self.flush()

    def record(self, step: int, scalars: dict[str, float], *, epoch: int | None = None,
               console: bool = False) -> None:
        """One step's scalars: ``eval_*`` keys are evaluation results, the rest training."""
        if not self.enabled:
            return
        scalars = {k: _number("run.log", k, v) for k, v in scalars.items()}
        now = time.time()
        rec = {"step": step, **({"epoch": epoch} if epoch is not None else {}), "time": now, **scalars}
        with _flush_lock:
            self._f.write(json.dumps(rec) + "\n")
            if self._tb is not None:
                for k, v in scalars.items():
                    self._tb.scalar(_tb_tag(k), v, step, now)
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in scalars.items() if k != "lr"})
        elif console and self.mode == "lines":
            done = step - self.start_step
            where = f"step {step}/{self.total}" if self.total else f"step {step}"
            if epoch is not None:
                where += f" epoch {epoch}"
            eta = f" ETA {_fmt_eta((time.perf_counter() - self.t0) / max(done, 1) * (self.total - step))}" \
                if self.total else ""
            log.info("%s %s%s", where, " ".join(f"{k} {_fmt(k, v)}" for k, v in scalars.items()), eta)
        if self._first or any(k.startswith("eval_") for k in scalars):
            self._first = False
            self.flush()

    def aside(self, step: int, scalars: dict[str, float]) -> None:
        """A row of hpc_train's own (the ranks' step-time spread): ``metrics.jsonl`` and
        TensorBoard, never the console line or the progress bar."""
        if not self.enabled:
            return
        now = time.time()
        with _flush_lock:
            self._f.write(json.dumps({"step": step, "time": now, **scalars}) + "\n")
            if self._tb is not None:
                for k, v in scalars.items():
                    self._tb.scalar(k.replace("_", "/", 1), v, step, now)

    def scalar(self, tag: str, value: float, step: int) -> None:
        """One TensorBoard scalar outside the step's metrics (the goodput, at each save)."""
        if self._tb is not None:
            with _flush_lock:
                self._tb.scalar(tag, value, step)

    def flush(self) -> None:
        """Both files to the kernel (no fsync: a crash of the process loses nothing flushed)."""
        if not self.enabled:
            return
        with _flush_lock:
            if self._f.closed:
                return
            self._f.flush()
            if self._tb is not None:
                self._tb.flush()

    def close(self) -> None:
        if not self.enabled or self._closing.is_set():
            return
        self._closing.set()
        self._flusher.join()
        if self._bar is not None:
            self._bar.close()
        with _flush_lock:
            if self._tb is not None:
                self._tb.close()
            self._f.close()


def _tb_tag(key: str) -> str:
    if key.startswith("eval_"):
        return f"eval/{key[5:]}"
    return f"train/{key}" if key in ("loss", "acc") else key


def _fmt(key: str, v: float) -> str:
    if key == "lr":
        return f"{v:.2e}"
    if key.endswith("per_s"):
        return f"{v:.0f}"
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def _number(where: str, key: str, value: Any) -> float | int:
    """A value for the metrics record: a number, or a one-element tensor (or NumPy scalar) as one."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    size = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", None)
    if size == 1 and callable(getattr(value, "item", None)):
        value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
    raise UsageError(f"{where}: {key}={show(value, 60)} is not a number; log numbers or one-element tensors "
                     f"(e.g. {key}=loss.item())")

