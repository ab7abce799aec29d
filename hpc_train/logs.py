"""Rank-prefixed logging and the run's metrics record (``metrics.jsonl``). Torch-free: ``status``
reads the metrics on the login side."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from hpc_train import rundir
from hpc_train.errors import UsageError
from hpc_train.rundir import read_text

log = logging.getLogger("hpc_train")


class _RankFileHandler(logging.FileHandler):
    """The rank's log file. When the disk fills up (or goes read-only) the file loses lines, but
    logging's default reaction, a traceback with the whole record on stderr for every line, would
    bury the one line that says what happened; the console handler still shows it."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        pass

    def _open(self):
        # Never through a symlink planted at the log's path (logging's own open() follows it).
        from hpc_train.rundir import open_append
        return open_append(Path(self.baseFilename))


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
        (run_dir / rundir.LOGS).mkdir(parents=True, exist_ok=True)
        try:
            fh = _RankFileHandler(rundir.rank_log(run_dir, rank))
        except UsageError as e:    # a symlink in the log's place: said on the console, which every rank has
            log.error("%s", e)
            raise
        fh.setFormatter(fmt)
        log.addHandler(fh)


def metric(line: str) -> dict[str, Any] | None:
    """One ``metrics.jsonl`` line as a record (an object with an integer ``step``), else None: a
    line cut short by a kill, or one damaged by other hands (``[]``, ``3``, ``{"step": "x"}``)."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if isinstance(rec, dict) and isinstance(rec.get("step"), int) and not isinstance(rec["step"], bool):
        return rec
    return None


def truncate_jsonl(path: Path, keep_through_step: int) -> None:
    """Drop records after ``keep_through_step`` (written after the checkpoint we resume from).
    Lines that are not records are set aside in ``NAME.damaged-<time>`` with one warning (a
    last line cut short by a kill is only dropped); a file that cannot be read at all is moved
    aside whole, and the run starts a new one."""
    from hpc_train.rundir import damaged_name, set_aside, write_atomic
    text, problem = read_text(path)
    if problem is not None:
        set_aside(path, problem, log.warning)
        return
    if text is None:
        return
    kept, damaged = [], []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        rec = metric(line)
        if rec is None:
            if line.strip() and not (i == len(lines) - 1 and not text.endswith("\n")):
                damaged.append(line)
            continue
        # An eval at the resume step ran after that checkpoint; the resumed run repeats it.
        if rec["step"] < keep_through_step or (rec["step"] == keep_through_step and "eval_acc" not in rec):
            kept.append(line)
    if damaged:
        aside = damaged_name(path)
        write_atomic(aside, "".join(line + "\n" for line in damaged))
        log.warning("%s: %d line(s) are not metrics records (an object with an integer step); moved to %s, "
                    "and the run goes on without them", path, len(damaged), aside.name)
    write_atomic(path, "".join(line + "\n" for line in kept))


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of ``metrics.jsonl`` (objects with an integer ``step``); anything else there
    is skipped. Never raises: see :func:`metrics_problem` for a file that cannot be read."""
    text, _ = read_text(Path(run_dir) / rundir.METRICS)
    return [rec for line in (text or "").splitlines() if (rec := metric(line)) is not None]


def metrics_problem(run_dir: Path) -> str | None:
    """What is wrong with ``metrics.jsonl``, if anything: it cannot be read (a directory in its
    place...), or lines of it are not records (a last line cut short by a kill aside)."""
    text, problem = read_text(Path(run_dir) / rundir.METRICS)
    if problem is not None or not text:
        return problem
    lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
    bad = sum(1 for line in lines if line.strip() and metric(line) is None)
    return f"has {bad} line(s) that are not records (an object with an integer step)" if bad else None
