"""Rank-prefixed logging and the run's metrics record (``metrics.jsonl``). Torch-free: ``status``
reads the metrics on the login side."""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from hpc_train import rundir
from hpc_train.errors import UsageError

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


# hpc_train's own log line, as the formatter below writes it: "[rank R] HH:MM:SS LEVEL message".
_OWN_LINE = re.compile(rb"\[rank [0-9]+\] [0-9]{2}:[0-9]{2}:[0-9]{2} (?:DEBUG|INFO|WARNING|ERROR|CRITICAL) ")


def own_line(line: bytes) -> bool:
    """Whether a line of a process's output is hpc_train's own log line (which its file handler
    already wrote to the rank's log), not a line the user's code printed, whatever it starts with."""
    return _OWN_LINE.match(line) is not None


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
    except (ValueError, RecursionError):
        return None
    if isinstance(rec, dict) and isinstance(rec.get("step"), int) and not isinstance(rec["step"], bool):
        return rec
    return None


# A metrics record is a few hundred bytes. A longer "line" is damage, and is read in pieces of
# this size so that a file with no newline in it is never held whole.
_LINE_MAX = 1 << 20


def _lines(f: BinaryIO) -> Iterator[tuple[bytes, bool, dict[str, Any] | None, bool]]:
    """Each line of an open ``metrics.jsonl``, read in pieces of at most :data:`_LINE_MAX`:
    (the bytes, whether they end the line, the record they hold or None, whether they continue
    an overlong line). A piece of an overlong line is never a record."""
    overlong = False
    while raw := f.readline(_LINE_MAX):
        ended = raw.endswith(b"\n")
        rec = None if overlong or not ended and len(raw) == _LINE_MAX else metric(raw.decode("utf-8", "replace"))
        yield raw, ended, rec, overlong
        overlong = not ended


def records(path: Path, tail_bytes: int | None = None) -> Iterator[dict[str, Any]]:
    """The records of a ``metrics.jsonl``, oldest first, by the one rule of :func:`metric`: a
    line that is not a record (cut short by a kill, damaged by other hands, longer than any
    record) is skipped. Read in pieces, whatever the file's size; ``tail_bytes``: only its last
    so many bytes (the first line there, likely cut, is skipped). Nothing when the file is
    missing or cannot be read."""
    import os

    from hpc_train.rundir import open_read
    f, _ = open_read(path)
    if f is None:
        return
    with f:
        try:
            size = os.fstat(f.fileno()).st_size
            if tail_bytes is not None and size > tail_bytes:
                f.seek(size - tail_bytes)
                f.readline(_LINE_MAX)
            yield from (rec for _, _, rec, _ in _lines(f) if rec is not None)
        except OSError:
            return


def truncate_jsonl(path: Path, keep_through_step: int) -> None:
    """Drop records after ``keep_through_step`` (written after the checkpoint we resume from).
    The file is read and rewritten line by line, whatever its size. Lines that are not records
    are set aside in ``NAME.damaged-<time>`` with one warning (a last line cut short by a kill
    is only dropped); a file that cannot be read at all, or a link in its place, is moved aside
    whole, and the run starts a new one."""
    from contextlib import ExitStack

    from hpc_train.rundir import atomic_writer, damaged_name, open_read, set_aside
    f, problem = open_read(path)
    if problem is not None:
        set_aside(path, problem, log.warning)
        return
    if f is None:
        return
    aside, damaged = None, 0
    with f, ExitStack() as stack:
        out = stack.enter_context(atomic_writer(path))
        for raw, ended, rec, overlong in _lines(f):
            if rec is None:
                # Not a record; only a last line without its newline (cut by a kill) is no damage.
                if overlong or raw.strip() and (ended or len(raw) == _LINE_MAX):
                    if aside is None:
                        aside = damaged_name(path)
                        aside_f = stack.enter_context(atomic_writer(aside))
                    aside_f.write(raw)
                    damaged += not overlong
                continue
            # An eval at the resume step ran after that checkpoint; the resumed run repeats it.
            if rec["step"] < keep_through_step or (rec["step"] == keep_through_step and "eval_acc" not in rec):
                out.write(raw if ended else raw + b"\n")
    if damaged and aside is not None:     # a damaged line always has its place aside
        log.warning("%s: %d line(s) are not metrics records (an object with an integer step); moved to %s, "
                    "and the run goes on without them", path, damaged, aside.name)


@dataclass
class MetricsTail:
    """What ``status`` shows of ``metrics.jsonl``, read from its end."""
    last_step: dict[str, Any] | None = None   # the newest record with a loss
    last_eval: dict[str, Any] | None = None   # the newest with an eval_acc
    last_spread: dict[str, Any] | None = None   # the newest ranks' step-time spread (stragglers)
    problem: str | None = None                # the file cannot be read, or lines of it are not records


# status reads backwards from the end, a block at a time, until it has the newest step and eval;
# it goes no further than this for an eval (what it once read whole), so memory stays one block.
_BLOCK = 1 << 20
_TAIL_SCAN = 64 << 20


def metrics_tail(run_dir: Path) -> MetricsTail:
    """The newest step and eval of ``metrics.jsonl``, read from its end in blocks; anything read
    that is not a record is counted in ``problem`` (a last line cut short by a kill aside)."""
    import os

    from hpc_train.rundir import open_read
    tail = MetricsTail()
    f, tail.problem = open_read(Path(run_dir) / rundir.METRICS)
    if f is None:
        return tail
    bad, seen, carry, skipping = 0, 0, b"", False
    try:
        with f:
            size = pos = os.fstat(f.fileno()).st_size
            while pos > 0 and not (tail.last_step and (tail.last_eval or size - pos >= _TAIL_SCAN)):
                n = min(_BLOCK, pos)
                pos -= n
                f.seek(pos)
                lines = (f.read(n) + carry).split(b"\n")
                if skipping:    # this block ends inside an overlong line, counted already
                    if len(lines) == 1:
                        continue
                    lines.pop()
                    skipping = False
                carry = lines.pop(0) if pos > 0 else b""   # it may begin in the block before
                if len(carry) > _LINE_MAX:
                    bad, carry, skipping = bad + 1, b"", True
                for raw in reversed(lines):
                    # The first seen is what follows the last newline: nothing, or a line cut by a kill.
                    seen += 1
                    rec = metric(raw.decode("utf-8", "replace")) if raw.strip() else None
                    if rec is None:
                        bad += bool(raw.strip()) and seen > 1
                        continue
                    if tail.last_step is None and "loss" in rec:
                        tail.last_step = rec
                    if tail.last_eval is None and "eval_acc" in rec:
                        tail.last_eval = rec
                    if tail.last_spread is None and "straggler_max_s" in rec:
                        tail.last_spread = rec
    except OSError as e:
        tail.problem = f"cannot be read ({e.strerror or type(e).__name__})"
        return tail
    if bad:
        where = f" in the last {max(1, (size - pos) >> 20)} MiB read" if pos else ""
        tail.problem = f"has {bad} line(s) that are not records (an object with an integer step){where}"
    return tail
