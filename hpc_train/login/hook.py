"""The batch shell's requeue hook, run after ``srun`` returns: issues exactly one
``scontrol requeue`` for a stop that asked for it (see :mod:`hpc_train.requeue`), or a failure
within its budget. No torch here."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from hpc_train import rundir
from hpc_train.config import JobSection
from hpc_train.errors import EXIT_STOPPED, EXIT_USAGE
from hpc_train.login import nodes
from hpc_train.requeue import (
    PENDING,
    _load,
    _save,
    budgets_of,
    request,
    restart_in_place,
)

UNFINISHED = EXIT_STOPPED   # the job's exit code for "stopped before the end and not requeued"
# The hook's exit code that tells the batch shell to run srun again in the allocation it holds
# (sysexits' EX_TEMPFAIL). A failure status equal to it is reported as 1.
AGAIN = 75


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


def hook(run_dir: Path, status: int, env: dict[str, str] | None = None,
         budgets: dict[str, int] | None = None, in_place: int | None = None,
         job: JobSection | None = None, tasks_per_node: int = 1) -> tuple[str, int]:
    """The batch shell's step after srun: issue the one requeue, or say why there is none.

    Returns the message and the exit code the batch script should end with: 0 for a finished
    or requeued run, :data:`UNFINISHED` for a stop without requeue, :data:`AGAIN` for a failure
    restarted in place (``in_place``: ``job.restarts_in_place``, read from the config when None),
    srun's status for a failure that is not requeued. After a lost node (``job.spare_nodes`` or
    ``job.min_nodes``, see :mod:`hpc_train.login.nodes`) a restart in place prints the next
    step's srun arguments on stdout. A finished run counts as finished even if
    a late signal hit a task during its exit (srun then reports the signal, but every result is
    on disk).
    """
    env = dict(os.environ if env is None else env)
    run_dir = Path(run_dir)
    from hpc_train import goodput
    goodput.exited(run_dir, goodput.job_start(env))   # every task of this job has exited (srun returned)
    pending = run_dir / PENDING
    if (run_dir / rundir.RESULT).exists():
        pending.unlink(missing_ok=True)
        return "run finished; no requeue", 0
    req, failed_first = _pending(run_dir, env, status)
    if req is not None:
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
        step = _last_step(run_dir)
        if job is None and (in_place is None or budgets is None):
            job = _config(run_dir).job      # read once
        in_place = job.restarts_in_place if in_place is None else in_place
        budgets = budgets_of(job) if budgets is None else budgets
        spent = ""
        # Not for a refusal (usage errors: the same input fails the same way) or a stop.
        if failed_first or status not in (EXIT_USAGE, UNFINISHED):
            where, note = _next_nodes(run_dir, job, env, tasks_per_node, step, target)
            if where is None and note:
                spent = f"{note}; "
            else:
                extra = {"nodes": where.nodes, "lost": where.lost, "world_size": len(where.nodes) * tasks_per_node,
                         "world_before": where.previous * tasks_per_node} if where else {}
                again, why = restart_in_place(run_dir, in_place, step, target, extra)
                if again:
                    if where is not None:
                        print(where.args(tasks_per_node))     # the batch shell's next srun arguments
                    return f"{failed_first}task failed (exit {status}); {note}{why}", AGAIN
                spent = f"{why}; "
        restart = int(env.get("SLURM_RESTART_COUNT") or 0)
        msg = failed_first + spent + request(run_dir, "failure", target, restart, budgets, step)
        status = 1 if status == AGAIN else status
        if pending.exists():
            pending.unlink()
            ok, detail = _scontrol_requeue(target)
            return (f"{msg}; requeued", 0) if ok else (f"{msg}; NOT requeued: {detail}", status)
        return msg, status
    return "no requeue requested", 0


def _pending(run_dir: Path, env: dict[str, str], status: int) -> tuple[dict | None, str]:
    """The requeue the run asked for (taken: the file is removed), or None, and a note when the
    request is withdrawn: a stop signal that was srun ending the ranks after one of them died
    (``srun --kill-on-bad-exit`` sends SIGTERM, which the others take for a preemption) is that
    rank's failure, restarted in place or counted against the failure budget instead."""
    pending = run_dir / PENDING
    if not pending.exists():
        return None, ""
    try:
        req = json.loads(pending.read_text())
        req["target"], req["cause"]
    except (ValueError, TypeError, KeyError, OSError):
        # Written atomically, so only outside hands damage it. It exists only when the run
        # asked for a requeue within its budget: requeue this task, the only safe target.
        req = {"target": _own_target(env), "cause": f"{PENDING} unreadable"}
    pending.unlink(missing_ok=True)
    culprits = _failed_ranks(run_dir) if status != 0 else []
    if not culprits:
        return req, ""
    rec = _load(run_dir)       # withdrawn: the cause's count and its event, as if never asked
    cause = req.get("cause")
    if isinstance(rec["counts"].get(cause), int) and rec["counts"][cause] > 0:
        rec["counts"][cause] -= 1
    for i in range(len(rec["events"]) - 1, -1, -1):
        if rec["events"][i].get("cause") == cause and rec["events"][i].get("requeued"):
            del rec["events"][i]
            break
    _save(run_dir, rec)
    return None, f"not a {cause}: rank {culprits[0]} failed and srun ended the other ranks (SIGTERM); "


def _failed_ranks(run_dir: Path) -> list[int]:
    """Ranks of the last job step that neither said their work ended nor left for a stop (see
    ``hpc_train.node.watchdog``): killed or crashed. Their heartbeat records name the step (the
    launch) they belong to; rank 0's is the step that asked for the requeue."""
    records = {}
    for path in (run_dir / rundir.LOGS / rundir.HEARTBEAT_DIR).glob("rank-*"):
        rec, _ = rundir.read_json(path)
        if isinstance(rec, dict) and path.name[5:].isdigit():
            records[int(path.name[5:])] = rec
    launch = records.get(0, {}).get("launch")
    if not launch:
        return []
    return sorted(r for r, h in records.items()
                  if h.get("launch") == launch and "ended" not in h and h.get("left") != "stop")


def _next_nodes(run_dir: Path, job: JobSection | None, env: dict[str, str], tasks_per_node: int,
                step: int, target: str) -> tuple[nodes.Step | None, str]:
    """Where the next step runs when the job survives a lost node (None and "" when it does
    not: srun's defaults), or None and why there are too few nodes to go on in place. The
    failed step's node count: this job's last in-place restart's (a requeued job starts again
    on job.nodes), else job.nodes."""
    if job is None or not nodes.guards_nodes(job):
        return None, ""
    rec = _load(run_dir)
    placed = [e for e in rec.get("in_place", []) if isinstance(e, dict) and isinstance(e.get("nodes"), list)
              and e.get("job") == target]
    previous = len(placed[-1]["nodes"]) if placed else job.nodes
    implicated = nodes.failed_hosts(run_dir, _failed_ranks(run_dir))
    where, why = nodes.next_step(job, env, implicated, previous)
    if where is None:
        return None, f"not restarted in place: {why}"
    note = ""
    if where.lost:
        note = f"{', '.join(where.lost)} lost at step {step}; "
    if len(where.nodes) != previous:
        note = (f"world size {previous * tasks_per_node} -> {len(where.nodes) * tasks_per_node}: {note}")
    return where, note + f"next step on {','.join(where.nodes)}; "


def _own_target(env: dict[str, str]) -> str:
    """This job, as scontrol requeue must name it: an array task by ARRAYJOB_TASK, never the
    whole array."""
    array = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    return f"{array[0]}_{array[1]}" if all(array) else env.get("SLURM_JOB_ID", "")


def _config(run_dir: Path):
    from hpc_train import config
    return config.load(run_dir / rundir.CONFIG)


def _last_step(run_dir: Path) -> int:
    from hpc_train.ckpt.store import newest_complete
    info = newest_complete(run_dir)
    return info.step if info else 0


def cmd_requeue_hook(args: argparse.Namespace) -> int:
    """``python -m hpc_train requeue-hook RUN_DIR STATUS`` (run by the batch script)."""
    msg, code = hook(Path(args.run_dir), args.status, tasks_per_node=args.tasks_per_node)
    print(f"hpc_train requeue-hook: {msg}", file=sys.stderr)
    return code


# The batch script runs srun in a loop: a failed step restarted in place (the hook exits with
# AGAIN) starts a new job step in the same allocation. The line before srun:
LOOP_START = "while :; do"


def before_loop_lines(job: JobSection, tasks_per_node: int) -> list[str]:
    """Shell lines before :data:`LOOP_START`: ``step_nodes``, the first srun's node and task
    counts (empty unless the job survives a lost node, see :mod:`hpc_train.login.nodes`)."""
    return [f"step_nodes={shlex.quote(nodes.first_step_args(job, tasks_per_node))}"]


def after_srun_lines(python: str, tasks_per_node: int, run_dir_expr: str = '"$RUN_DIR"') -> list[str]:
    """Shell lines for a batch script, right after srun (inside the loop that
    :data:`LOOP_START` opens); ``status`` must hold srun's exit code. They end the loop unless
    the hook says to run srun again; the hook's exit code becomes the job's (see :func:`hook`),
    and what it prints, the next srun's nodes (``$step_nodes``, unquoted on the srun line:
    hostnames and counts only)."""
    # "|| hooked=$?": the sbatch script runs under set -e, which would end it at a non-zero hook.
    call = f'{python} -m hpc_train requeue-hook {run_dir_expr} "$status" --tasks-per-node {tasks_per_node}'
    return ["hooked=0", f"step_nodes=$({call}) || hooked=$?", 'status="$hooked"', f'if [ "$status" -ne {AGAIN} ]; then break; fi', "done"]
