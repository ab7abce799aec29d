"""What a run reports: per-rank logs, console progress, TensorBoard, ``metrics.jsonl``.

Every rank logs to ``RUN_DIR/logs/rank-R.log`` with ``[rank R]`` in the prefix. Rank 0 also
logs to the console, draws the progress (a bar on a terminal, plain lines in a batch log,
where a bar's carriage returns would make a mess), and writes TensorBoard scalars and
``metrics.jsonl``. After a resume, records past the resumed step are dropped from both, so
curves continue without doubled segments.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("hpc_train")


def setup_logging(rank: int, run_dir: Path | None, level: str = "INFO") -> None:
    fmt = logging.Formatter(f"[rank {rank}] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    log.handlers.clear()
    log.setLevel(level)
    log.propagate = False
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(fmt)
    console.setLevel(level if rank == 0 else "WARNING")
    log.addHandler(console)
    if run_dir is not None:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(run_dir / "logs" / f"rank-{rank}.log")
        fh.setFormatter(fmt)
        log.addHandler(fh)


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
        if not enabled:
            return
        self.metrics_path = run_dir / "metrics.jsonl"
        _truncate_jsonl(self.metrics_path, start_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            # purge_step drops events at or after the resume step: no doubled segments.
            self._tb = SummaryWriter(str(run_dir / "tb"), purge_step=start_step + 1 if start_step else None)
            self.tb_dir = run_dir / "tb"
        mode = progress if progress != "auto" else ("bar" if sys.stderr.isatty() else "lines")
        if mode == "bar":
            from tqdm import tqdm
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
        self.mode = mode
        self._f = self.metrics_path.open("a")

    def step(self, step: int, epoch: int, scalars: dict[str, float], log_line: bool) -> None:
        if not self.enabled:
            return
        rec = {"step": step, "epoch": epoch, "time": time.time(), **scalars}
        self._f.write(json.dumps(rec) + "\n")
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(f"train/{k}" if k in ("loss", "acc") else k, v, step)
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix(loss=f"{scalars['loss']:.4f}", sps=f"{scalars.get('samples_per_s', 0):.0f}")
        elif log_line and self.mode == "lines":
            done = step - self.start_step
            eta = (time.perf_counter() - self.t0) / max(done, 1) * (self.total - step)
            log.info("step %d/%d epoch %d loss %.4f acc %.3f lr %.2e %.0f samples/s ETA %s", step, self.total,
                     epoch, scalars["loss"], scalars["acc"], scalars["lr"], scalars.get("samples_per_s", 0),
                     _fmt_eta(eta))

    def eval(self, step: int, epoch: int, loss: float, acc: float) -> None:
        if not self.enabled:
            return
        self._f.write(json.dumps({"step": step, "epoch": epoch, "time": time.time(),
                                  "eval_loss": loss, "eval_acc": acc}) + "\n")
        self._f.flush()
        if self._tb is not None:
            self._tb.add_scalar("eval/loss", loss, step)
            self._tb.add_scalar("eval/acc", acc, step)
        msg = f"epoch {epoch} eval: loss {loss:.4f} accuracy {acc:.4f}"
        if self._bar is not None:
            self._bar.write(msg)
        log.info(msg)

    def flush(self) -> None:
        if self.enabled:
            self._f.flush()
            if self._tb is not None:
                self._tb.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        self._f.close()


def _truncate_jsonl(path: Path, keep_through_step: int) -> None:
    """Drop records after ``keep_through_step`` (written after the checkpoint we resume from)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
            # An eval at the resume step ran after that checkpoint; the resumed run repeats it.
            if rec.get("step", 0) < keep_through_step or (rec.get("step") == keep_through_step
                                                           and "eval_acc" not in rec):
                kept.append(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
