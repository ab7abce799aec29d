"""``stopped.json``: the last stop of the run, written by rank 0. No torch here.

What it says: the step saved at the stop (None: the code never acted on it, so hpc_train saved
nothing and the code resumes from what it saved itself), the signal and when it came, whether a
checkpoint was committed and when, and under Slurm the line about the requeue that rank 0 asked
the batch shell for. A finished run keeps none (:func:`remove`): a finished run never looks
stopped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hpc_train import rundir
from hpc_train.records import io
from hpc_train.records import fields
from hpc_train.records.fields import Bad

NAME = "stopped.json"


@dataclass(frozen=True)
class StopRecord:
    steps: int | None                  # the step saved at the stop; None: nothing saved by hpc_train
    signal: str                        # e.g. USR2, TERM, INT
    received_at: float | None
    checkpoint: bool                   # a checkpoint was committed at the stop
    committed_at: float | None = None
    requeue: str | None = None         # rank 0's line about the requeue it asked for (Slurm)
    requeue_requested_at: float | None = None


def path(run_dir: Path) -> Path:
    return Path(run_dir) / NAME


def read(run_dir: Path) -> tuple[StopRecord | None, str | None]:
    """(record, None); (None, None) when there is none; (None, what is wrong) when damaged."""
    raw, problem = io.read_json(path(run_dir))
    if raw is None:
        return None, problem
    try:
        return StopRecord(fields.opt_count(raw, "steps"), fields.text(raw, "stop_signal", "a signal"),
                          fields.opt_number(raw, "stop_received_at"), fields.flag(raw, "checkpoint"),
                          fields.opt_number(raw, "checkpoint_committed_at"), fields.opt_text(raw, "requeue"),
                          fields.opt_number(raw, "requeue_requested_at")), None
    except Bad as e:
        return None, str(e)


def write(run_dir: Path, rec: StopRecord) -> None:
    rundir.write_atomic(path(run_dir), json.dumps({
        "stopped": True, "steps": rec.steps, "stop_signal": rec.signal, "stop_received_at": rec.received_at,
        "checkpoint": rec.checkpoint, "checkpoint_committed_at": rec.committed_at, "requeue": rec.requeue,
        "requeue_requested_at": rec.requeue_requested_at}, indent=2))


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
