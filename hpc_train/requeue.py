"""Requeue: once per stop, within a budget per cause, from the batch shell. No torch here.

Flow on a stop signal (preemption or the time limit's ``--signal``/SIGTERM):

1. every rank agrees at a step boundary, saves, and exits cleanly (trainer + checkpoint);
2. rank 0, before exiting, classifies the cause, checks that cause's budget, counts it in
   ``RUN_DIR/requeue.json`` and leaves ``RUN_DIR/requeue.pending`` naming the target;
3. after ``srun`` returns, the batch shell (ours or submitit's teardown) runs
   ``python -m hpc_train requeue-hook RUN_DIR STATUS``, which issues exactly one
   ``scontrol requeue`` (of ``ARRAYJOB_TASK`` for array tasks, never the whole array).

Requeuing from the batch shell, after every rank has exited, means no rank is killed mid-save
by its own requeue, and works where ``scontrol`` is missing inside a container (the shell runs
outside it). A task that dies (non-zero ``srun`` status) is a *failure*: the hook requeues it
within the failure budget and the next run resumes from the last complete checkpoint.

Budgets are counted per cause and per run (keyed on ``SLURM_RESTART_COUNT``), so preemptions
never use up the time-limit budget. A finished run (``result.json``) is never requeued.

A failure is first restarted **in place** (:func:`restart_in_place`): the batch shell runs
``srun`` again in the allocation it holds, and the ranks resume from the newest complete
checkpoint, with no trip through the queue. ``job.restarts_in_place`` bounds it over the run; a
restart that made no progress (no newer checkpoint than at the restart before) counts twice, so
a crash loop spends it quickly. Then failures fall back to the requeue and its failure budget.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from hpc_train import rundir

CAUSES = ("preemption", "timeout", "failure")
STATE = rundir.REQUEUE
PENDING = rundir.REQUEUE_PENDING


def _load(run_dir: Path) -> dict[str, Any]:
    from hpc_train.rundir import read_json, set_aside
    rec, problem = read_json(run_dir / STATE)
    if rec is not None:
        counts, events = rec.get("counts"), rec.get("events")
        if not (isinstance(counts, dict) and all(isinstance(v, int) for v in counts.values())
                and isinstance(events, list) and all(isinstance(e, dict) for e in events)):
            problem = "has no counts per cause and list of events"
    if problem is not None:     # kept aside; counting starts again (budgets may be used twice, never crash)
        import logging
        set_aside(run_dir / STATE, problem, logging.getLogger("hpc_train").warning)
        rec = None
    return rec or {"counts": {c: 0 for c in CAUSES}, "events": []}


def _save(run_dir: Path, rec: dict[str, Any]) -> None:
    from hpc_train.rundir import write_atomic
    write_atomic(run_dir / STATE, json.dumps(rec, indent=2))


def budget_for(cause: str, budgets: dict[str, int]) -> int:
    """-1 means unlimited."""
    return budgets.get(cause, 0)


def classify(signal_name: str, end_time: float | None, now: float, lead_s: int) -> str:
    """A stop signal near the job's end is the time limit; earlier, it is a preemption.

    slurmctld checks time limits every 30 s, so the signal may arrive up to ~30 s before the
    nominal lead: allow 60 s of slack.
    """
    if end_time is not None and end_time - now <= lead_s + 60:
        return "timeout"
    return "preemption"


def job_end_time(job_id: str | None) -> float | None:
    """The job's *nominal* end: start time + time limit, from ``squeue`` (one call, at a stop).

    Not squeue's end time: on preemption slurmctld moves that to now + GraceTime, which would
    make every preemption look like the time limit.
    """
    if not job_id or shutil.which("squeue") is None:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%S|%l"], capture_output=True, text=True,
                             timeout=20).stdout.strip().splitlines()[0]
        start, limit = out.split("|")
        if limit.upper() in ("UNLIMITED", "INFINITE", "NOT_SET"):
            return None
        from hpc_train.config import time_minutes
        return time.mktime(time.strptime(start, "%Y-%m-%dT%H:%M:%S")) + 60 * time_minutes(limit)
    except (subprocess.SubprocessError, ValueError, IndexError):
        return None


def request(run_dir: Path, cause: str, target: str, restart: int, budgets: dict[str, int], step: int) -> str:
    """Rank 0 at a stop: count the cause and leave the request for the batch shell. Returns a message."""
    run_dir = Path(run_dir)
    rec = _load(run_dir)
    budget = budget_for(cause, budgets)
    used = rec["counts"].get(cause, 0)
    key = f"{target}:{restart}"
    if any(e.get("key") == key for e in rec["events"]):
        return f"requeue for run {key} already requested"
    if budget >= 0 and used >= budget:
        rec["events"].append({"key": key, "cause": cause, "step": step, "time": time.time(), "requeued": False})
        rec["final"] = f"stopped by {cause} at step {step}; {cause} budget ({budget}) spent, not requeued"
        _save(run_dir, rec)
        return rec["final"]
    rec["counts"][cause] = used + 1
    rec["events"].append({"key": key, "cause": cause, "step": step, "time": time.time(), "requeued": True})
    _save(run_dir, rec)
    from hpc_train.rundir import write_atomic
    write_atomic(run_dir / PENDING, json.dumps({"target": target, "cause": cause, "step": step}))
    limit = "unlimited" if budget < 0 else str(budget)
    return f"stopped by {cause} at step {step}; requeue {used + 1} of {limit} requested for {target}"


def in_place_used(rec: dict[str, Any]) -> int:
    """The in-place budget spent so far: each restart's charge (1, or 2 without progress)."""
    events = rec.get("in_place")
    return sum(e["charge"] if isinstance(e.get("charge"), int) else 1
               for e in (events if isinstance(events, list) else []) if isinstance(e, dict))


def restart_in_place(run_dir: Path, limit: int, step: int, job: str,
                     extra: dict[str, Any] | None = None) -> tuple[bool, str]:
    """After a failed step: whether the batch shell starts ``srun`` again in this allocation
    (counted in ``requeue.json``'s ``in_place`` list), and the message saying so or why not.
    ``step``: the newest complete checkpoint's step (0: none); ``extra``: kept in the record
    (the next step's nodes and world size, after a lost node)."""
    rec = _load(Path(run_dir))
    events = rec.setdefault("in_place", [])
    if not isinstance(events, list):
        events = rec["in_place"] = []
    before = [e.get("step") for e in events if isinstance(e, dict)]
    charge = 2 if before and before[-1] == step else 1     # no newer checkpoint: a crash loop
    used = in_place_used(rec)
    if used + charge > limit:
        return False, (f"in-place restarts spent ({used} of {limit} used; a restart without a newer "
                       f"checkpoint counts twice)")
    events.append({"job": job, "step": step, "time": time.time(), "charge": charge, **(extra or {})})
    _save(Path(run_dir), rec)
    return True, (f"restarting in place from step {step} (in-place budget: {used + charge} of {limit} used"
                  f"{'; no progress since the last restart, counted twice' if charge == 2 else ''})")


def requested(run_dir: Path) -> bool:
    return (Path(run_dir) / PENDING).exists()


def budgets_of(j) -> dict[str, int]:
    """The requeue budgets per cause, from the config's job section."""
    return {"preemption": j.requeue_preemption, "timeout": j.requeue_timeout, "failure": j.requeue_failure}


def request_for_stop(job, env, run_dir: Path, step: int, stop) -> str:
    """Rank 0, after a stop's checkpoint (or a stopped script): classify the cause and leave the
    request for the batch shell. Idempotent per run (see :func:`request`)."""
    import logging
    received = getattr(stop, "received_at", None) or time.time()
    name = getattr(stop, "name", "") or ""
    cause = classify(name, job_end_time(env.job_id), received, job.signal_lead)
    msg = request(Path(run_dir), cause, env.requeue_target or "", env.restart_count, budgets_of(job), step)
    logging.getLogger("hpc_train").warning("%s (signal %s, %.1fs after it)", msg, name, time.time() - received)
    return msg
