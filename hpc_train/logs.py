"""Rank-prefixed logging and the run's metrics record (``metrics.jsonl``). Torch-free: ``status``
reads the metrics on the login side."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("hpc_train")


class _RankFileHandler(logging.FileHandler):
    """The rank's log file. When the disk fills up (or goes read-only) the file loses lines, but
    logging's default reaction, a traceback with the whole record on stderr for every line, would
    bury the one line that says what happened; the console handler still shows it."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        pass


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
        fh = _RankFileHandler(run_dir / "logs" / f"rank-{rank}.log")
        fh.setFormatter(fmt)
        log.addHandler(fh)


def truncate_jsonl(path: Path, keep_through_step: int) -> None:
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
