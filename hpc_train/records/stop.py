"""``stopped.json``: the last stop of the run, written by rank 0: the one stop record. No torch here.

What it says: the step saved at the stop (None: the code never acted on it, so hpc_train saved
nothing and the code resumes from what it saved itself), the signal and when it came, whether a
checkpoint was committed and when, and under Slurm rank 0's request to the batch shell's hook
(:class:`Request`: which job to requeue, which step asked, a straggler's node to swap) with the
line about it. The hook decides what follows from it (:mod:`hpc_train.login.gather` reads it
through :func:`hpc_train.records.requeue.read_pending`); a request of an earlier step is told
apart by the step it names, so nothing removes it. A finished run keeps none (:func:`remove`):
a finished run never looks stopped.

The signal is held in one form from the handler to the hook: Slurm's and ``job.signal``'s
(``USR2``, ``TERM``; ``straggler`` for rank 0's own stop to swap a slow node). A record of an
earlier version held Python's (``SIGUSR2``), read as the same signal.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hpc_train import rundir
from hpc_train.records import io
from hpc_train.records import fields
from hpc_train.records.fields import Bad

NAME = "stopped.json"
JOB_TARGET = re.compile(r"[0-9]{1,18}(_[0-9]{1,18})?")   # a job id, or ARRAYJOB_TASK


@dataclass(frozen=True)
class Request:
    """Rank 0's request to the batch shell's hook after a stop (Slurm only)."""

    target: str               # this job as scontrol names it (an array task: ARRAYJOB_TASK)
    job: str = ""             # the step that asked (see hpc_train.records.ranks.StepId)
    restart: int = 0
    attempt: int = 0
    swap: str | None = None   # a straggler stop: the slow rank's node, to swap for a spare
    swap_rank: int | None = None


@dataclass(frozen=True)
class StopRecord:
    steps: int | None                  # the step saved at the stop; None: nothing saved by hpc_train
    signal: str                        # USR2, TERM, INT, straggler (one form: see the module's docstring)
    received_at: float | None
    checkpoint: bool                   # a checkpoint was committed at the stop
    committed_at: float | None = None
    requeue: str | None = None         # rank 0's line about the requeue it asked for (Slurm)
    requeue_requested_at: float | None = None
    request: Request | None = None     # under Slurm: what the batch shell's hook decides on


def said(signal: str) -> str:
    """A record's signal as a line says it: SIGUSR2 for USR2; ``straggler`` as it is."""
    bare = signal.removeprefix("SIG")
    return f"SIG{bare}" if bare.isalnum() and bare.isupper() else signal


def path(run_dir: Path) -> Path:
    return Path(run_dir) / NAME


def read(run_dir: Path) -> tuple[StopRecord | None, str | None]:
    """(record, None); (None, None) when there is none; (None, what is wrong) when damaged."""
    raw, problem = io.read_json(path(run_dir))
    if raw is None:
        return None, problem
    try:
        return StopRecord(fields.opt_count(raw, "steps"),
                          fields.text(raw, "stop_signal", "a signal").removeprefix("SIG"),
                          fields.opt_time(raw, "stop_received_at"), fields.flag(raw, "checkpoint"),
                          fields.opt_time(raw, "checkpoint_committed_at"), fields.opt_text(raw, "requeue"),
                          fields.opt_time(raw, "requeue_requested_at"), _request(raw.get("request"))), None
    except Bad as e:
        return None, str(e)


def _request(raw: object) -> Request | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise Bad(f"request is {raw!r:.40}, not an object")
    return request_from(raw, "request.")


def request_from(raw: Mapping[str, object], where: str = "") -> Request:
    """A request's fields, checked (raises :class:`Bad` naming the first wrong one, ``where`` before
    its name): the stop record's ``request``, and an earlier version's ``requeue.pending``, which
    held the same fields at its top level."""
    target = fields.text(raw, "target")
    if not JOB_TARGET.fullmatch(target):
        raise Bad(f"{where}target is {target!r:.40}, not a Slurm job id")
    return Request(target, fields.text(raw, "job", ""), fields.count(raw, "restart", 0),
                   fields.count(raw, "attempt", 0), fields.opt_text(raw, "swap"), fields.opt_count(raw, "swap_rank"))


def write(run_dir: Path, rec: StopRecord) -> None:
    rundir.write_atomic(path(run_dir), json.dumps({
        "stopped": True, "steps": rec.steps, "stop_signal": rec.signal, "stop_received_at": rec.received_at,
        "checkpoint": rec.checkpoint, "checkpoint_committed_at": rec.committed_at, "requeue": rec.requeue,
        "requeue_requested_at": rec.requeue_requested_at,
        "request": None if rec.request is None else dataclasses.asdict(rec.request)}, indent=2))


def remove(run_dir: Path) -> None:
    rundir.remove_record(path(run_dir))


def written_at(run_dir: Path) -> float | None:
    """When ``stopped.json`` was last written (its mtime, damaged or not); None when there is none."""
    try:
        return path(run_dir).stat().st_mtime
    except OSError:
        return None


def written_since(run_dir: Path, since: float) -> tuple[StopRecord | None, bool]:
    """The stop record if it was written at or after ``since`` (this launch's), and whether one
    was written then at all (a damaged one counts as written, its content unknown)."""
    try:
        if path(run_dir).stat().st_mtime < since:
            return None, False
    except OSError:
        return None, False
    rec, _ = read(run_dir)
    return rec, True
