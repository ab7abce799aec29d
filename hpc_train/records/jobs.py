"""``job.json``: the Slurm jobs submitted for the run, oldest first. No torch here.

Written by whatever submits (``submit``, a sweep's array, ``--resubmit-failed``), read by
``status``, ``logs``, ``cancel``, the refusal of a second job into a busy run directory, and the
goodput ledger (the first submit is where the run's wall time starts).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hpc_train import rundir
from hpc_train.records import io
from hpc_train.records import fields
from hpc_train.errors import show
from hpc_train.records.fields import Bad

NAME = "job.json"


@dataclass(frozen=True)
class JobEntry:
    job_id: str
    submitted: float | None
    via: str
    extra: dict[str, object]


def path(run_dir: Path) -> Path:
    return Path(run_dir) / NAME


def _entry(d: object) -> JobEntry:
    if not isinstance(d, dict):
        raise Bad(f"value is {show(d, 40)}, not an object")
    rest = {k: v for k, v in d.items() if k not in ("job_id", "submitted", "via")}
    return JobEntry(fields.text(d, "job_id"), fields.opt_time(d, "submitted"), fields.text(d, "via", ""), rest)


def read(run_dir: Path) -> tuple[list[JobEntry], str | None]:
    """The jobs, oldest first: ([...], None); ([], None) when there is no record; ([], what is
    wrong) when it is damaged."""
    raw, problem = io.read_json(path(run_dir))
    if raw is None:
        return [], problem
    jobs = raw.get("jobs")
    if not isinstance(jobs, list):
        return [], "has no list of jobs with a job_id each"
    try:
        return [_entry(j) for j in jobs], None
    except Bad as e:
        return [], f"has a job entry whose {e}"


def append(run_dir: Path, job_id: str, via: str, warn: Callable[[str], None], **extra: object) -> None:
    """Record a submitted job. A damaged record is kept aside (the job is submitted by now) and
    a new one started."""
    entries, problem = read(run_dir)
    if problem is not None:
        rundir.set_aside(path(run_dir), problem, warn)
    rows = [{"job_id": e.job_id, "submitted": e.submitted, "via": e.via, **e.extra} for e in entries]
    rows.append({"job_id": job_id, "submitted": time.time(), "via": via, **extra})
    rundir.write_atomic(path(run_dir), json.dumps({"jobs": rows}, indent=2))


def first_submit(run_dir: Path) -> float | None:
    entries, _ = read(run_dir)
    return entries[0].submitted if entries else None
