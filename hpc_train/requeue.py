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
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CAUSES = ("preemption", "timeout", "failure")
STATE = "requeue.json"
PENDING = "requeue.pending"


def _load(run_dir: Path) -> dict[str, Any]:
    path = run_dir / STATE
    if path.exists():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            pass
    return {"counts": {c: 0 for c in CAUSES}, "events": []}


def _save(run_dir: Path, rec: dict[str, Any]) -> None:
    from hpc_train.config import write_atomic
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
        from hpc_train.scheduler import time_minutes
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
    (run_dir / PENDING).write_text(json.dumps({"target": target, "cause": cause, "step": step}))
    limit = "unlimited" if budget < 0 else str(budget)
    return f"stopped by {cause} at step {step}; requeue {used + 1} of {limit} requested for {target}"


def requested(run_dir: Path) -> bool:
    return (Path(run_dir) / PENDING).exists()


def _scontrol_requeue(target: str) -> tuple[bool, str]:
    if shutil.which("scontrol") is None:
        return False, "scontrol is not on PATH in the batch shell either"
    if not target:
        return False, "no job id (SLURM_JOB_ID is not set)"
    try:
        out = subprocess.run(["scontrol", "requeue", target], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return False, "scontrol did not answer in 60 s"
    lines = [ln for ln in (out.stderr or out.stdout).splitlines() if ln.strip()]
    return out.returncode == 0, lines[-1].strip() if lines else ""   # its last line is the cause


UNFINISHED = 3   # the job's exit code for "stopped before the end and not requeued"


def hook(run_dir: Path, status: int, env: dict[str, str] | None = None,
         budgets: dict[str, int] | None = None) -> tuple[str, int]:
    """The batch shell's step after srun: issue the one requeue, or say why there is none.

    Returns the message and the exit code the batch script should end with: 0 for a finished
    or requeued run, :data:`UNFINISHED` for a stop without requeue, srun's status for a failure
    that is not requeued. A finished run counts as finished even if a late signal hit a task
    during its exit (srun then reports the signal, but every result is on disk).
    """
    env = dict(os.environ if env is None else env)
    run_dir = Path(run_dir)
    from hpc_train import goodput
    goodput.exited(run_dir, goodput.job_start(env))   # every task of this job has exited (srun returned)
    pending = run_dir / PENDING
    if (run_dir / "result.json").exists():
        pending.unlink(missing_ok=True)
        return "run finished; no requeue", 0
    if pending.exists():
        try:
            req = json.loads(pending.read_text())
            req["target"], req["cause"]
        except (ValueError, TypeError, KeyError, OSError):
            # Written atomically, so only outside hands damage it. It exists only when the run
            # asked for a requeue within its budget: requeue this task, the only safe target.
            req = {"target": _own_target(env), "cause": f"{PENDING} unreadable"}
        pending.unlink(missing_ok=True)
        ok, detail = _scontrol_requeue(req["target"])
        if not ok:
            return f"NOT requeued: scontrol requeue {req['target']} failed: {detail}", UNFINISHED
        rec = _load(run_dir)
        rec.setdefault("requeued_at", []).append(time.time())
        _save(run_dir, rec)
        return f"requeued {req['target']} ({req['cause']})", 0
    final = _load(run_dir).get("final")
    if status == 0 and final:
        return f"NOT requeued: {final}", UNFINISHED
    if status != 0:
        target = _own_target(env)
        restart = int(env.get("SLURM_RESTART_COUNT") or 0)
        if budgets is None:
            budgets = _budgets_from_config(run_dir)
        msg = request(run_dir, "failure", target, restart, budgets, _last_step(run_dir))
        if pending.exists():
            pending.unlink()
            ok, detail = _scontrol_requeue(target)
            return (f"{msg}; requeued", 0) if ok else (f"{msg}; NOT requeued: {detail}", status)
        return msg, status
    return "no requeue requested", 0


def _own_target(env: dict[str, str]) -> str:
    """This job, as scontrol requeue must name it: an array task by ARRAYJOB_TASK, never the
    whole array."""
    array = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    return f"{array[0]}_{array[1]}" if all(array) else env.get("SLURM_JOB_ID", "")


def _budgets_from_config(run_dir: Path) -> dict[str, int]:
    from hpc_train import config
    cfg = config.load(run_dir / "config.yaml")
    return budgets_of(cfg)


def budgets_of(cfg) -> dict[str, int]:
    j = cfg.job
    return {"preemption": j.requeue_preemption, "timeout": j.requeue_timeout, "failure": j.requeue_failure}


def _last_step(run_dir: Path) -> int:
    from hpc_train.resume import newest_complete
    info = newest_complete(run_dir)
    return info.step if info else 0


def cmd_requeue_hook(args: argparse.Namespace) -> int:
    """``python -m hpc_train requeue-hook RUN_DIR STATUS`` (run by the batch script)."""
    msg, code = hook(Path(args.run_dir), args.status)
    print(f"hpc_train requeue-hook: {msg}", file=sys.stderr)
    return code


def after_srun_lines(python: str, run_dir_expr: str = '"$RUN_DIR"') -> list[str]:
    """Shell lines for a batch script, right after srun; ``status`` must hold srun's exit code.
    The hook's exit code becomes the job's (see :func:`hook`)."""
    return [f'{python} -m hpc_train requeue-hook {run_dir_expr} "$status"', "status=$?"]


def request_for_stop(cfg, env, run_dir: Path, step: int, stop) -> str:
    """Rank 0, after a stop's checkpoint (or a stopped script): classify the cause and leave the
    request for the batch shell. Idempotent per run (see :func:`request`)."""
    import logging
    received = getattr(stop, "received_at", None) or time.time()
    name = getattr(stop, "name", "") or ""
    cause = classify(name, job_end_time(env.job_id), received, cfg.job.signal_lead)
    msg = request(Path(run_dir), cause, env.requeue_target or "", env.restart_count, budgets_of(cfg), step)
    logging.getLogger("hpc_train").warning("%s (signal %s, %.1fs after it)", msg, name, time.time() - received)
    return msg
