"""The job as Slurm sees it from the batch shell, and the first step's nodes. No torch here.

With ``job.spare_nodes`` or ``job.min_nodes`` set, the batch script is submitted with
``--no-kill`` (Slurm keeps the allocation when one of its nodes fails) and asks for
``job.nodes + job.spare_nodes`` nodes; every ``srun`` is given the nodes it runs on: the first
step ``job.nodes`` of them (:func:`first_step_args`), each later one the nodes the requeue hook
chose (:mod:`hpc_train.login.decide`) from what :func:`job_view` and :func:`node_states` say.

A query that fails, times out or answers nothing is *unknown* (None, with why), never an empty
answer: an empty list of nodes would read as "every node gone".
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

from hpc_train import nodelist as nodelist_mod
from hpc_train import rundir, slurm
from hpc_train.config import JobSection, time_minutes
from hpc_train.errors import UsageError

_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")   # what goes unquoted on the srun line


def guards_nodes(job: JobSection) -> bool:
    """Whether the job survives a lost node (``--no-kill``, nodes given to each step)."""
    return job.spare_nodes > 0 or 0 < job.min_nodes < job.nodes


def allocated_nodes(job: JobSection) -> int:
    return job.nodes + job.spare_nodes


def first_step_args(job: JobSection, tasks_per_node: int) -> str:
    """srun's node and task counts for the first step: ``job.nodes`` of the allocation's
    ``job.nodes + job.spare_nodes`` (empty without spares or ``min_nodes``: srun's defaults)."""
    if not guards_nodes(job):
        return ""
    return f"--nodes={job.nodes} --ntasks={job.nodes * tasks_per_node}"


def expand(nodelist: str) -> list[str]:
    """Slurm's compressed host list as names (none when it does not parse); names that could
    not go unquoted on an srun line are dropped (Slurm never writes them)."""
    try:
        return [h for h in nodelist_mod.expand(nodelist) if _HOST.fullmatch(h)]
    except UsageError:
        return []


@dataclass(frozen=True)
class JobView:
    """One ``squeue`` of the job: its nominal end (start + time limit: on preemption squeue's own
    end time moves to now + GraceTime, which would make every preemption look like the time
    limit), and its nodes now (with ``--no-kill`` Slurm drops a failed node from the job while
    the batch shell's SLURM_JOB_NODELIST still names it). None: unknown (``why``) or unlimited."""

    nominal_end: float | None
    nodes: tuple[str, ...] | None
    why: str = ""


def job_view(job_id: str) -> JobView:
    if not job_id:
        return JobView(None, None, "no job id (SLURM_JOB_ID)")
    reply = slurm.squeue("-h", "-j", job_id, "-o", "%S|%l|%N")
    lines = (reply.out or "").strip().splitlines()
    if not lines:     # unknown, or not listed: either way nothing known of it
        return JobView(None, None, reply.why or "squeue does not list the job")
    start, limit, nodelist = (lines[0].split("|") + ["", "", ""])[:3]
    end = None
    if limit.upper() not in ("UNLIMITED", "INFINITE", "NOT_SET", ""):
        try:
            end = time.mktime(time.strptime(start, "%Y-%m-%dT%H:%M:%S")) + 60 * time_minutes(limit)
        except (ValueError, OverflowError, UsageError):   # squeue printed no time we can read: unknown
            end = None
    nodes = tuple(expand(nodelist.strip())) or None
    return JobView(end, nodes, "" if nodes else "squeue named no node of the job")


def node_states(hosts: Sequence[str]) -> tuple[dict[str, str] | None, str]:
    """Slurm's state of each host (one ``sinfo``), or None and why it is unknown."""
    reply = slurm.sinfo("-h", "-N", "-n", ",".join(hosts), "-o", "%N|%T")
    if reply.out is None:
        return None, reply.why
    out = reply.out
    states = {}
    for line in out.splitlines():
        name, _, state = line.strip().partition("|")
        if name:
            states[name] = state.strip().lower()
    return states, ""


@dataclass(frozen=True)
class PastRun:
    """One run of the job as ``sacct --duplicates`` lists it (the n-th row is restart n)."""

    restart: int
    state: str                   # e.g. REQUEUED, PREEMPTED, NODE_FAIL, RUNNING
    elapsed_s: int | None        # None: not a number
    limit_s: int | None          # None: unlimited, or not a number
    end: float | None            # None: not ended, or not a time


def parse_runs(text: str, restart: int | None = None) -> tuple[PastRun, ...]:
    """``sacct -n -P -X --duplicates -o State,ElapsedRaw,TimelimitRaw,End`` as runs; whatever
    bytes it printed (a field that is not a number is None). A job that lost a node under
    ``--no-kill`` has a RESIZING row for the same run: left out.

    ``restart`` (this run's SLURM_RESTART_COUNT): ``--duplicates`` also lists older jobs that had
    the same id (Slurm reuses ids after a controller reset or a wrap), first; this job's runs are
    the last ``restart + 1`` rows when the current run is listed (still live), else the last
    ``restart`` (the accounting has not caught up with it). None: every row is this job's."""
    rows = [(line.split("|") + [""] * 4)[:4] for line in text.splitlines() if line.strip()]
    rows = [r for r in rows if r[0].strip() != "RESIZING"]
    if restart is not None:
        listed = bool(rows) and rows[-1][0].strip().split(" ")[0] in _LIVE
        keep = restart + 1 if listed else restart
        rows = rows[max(0, len(rows) - keep):] if keep > 0 else []

    def num(s: str) -> int | None:
        return rundir.decimal(s.strip(), 12)

    def when(s: str) -> float | None:
        try:
            return time.mktime(time.strptime(s.strip(), "%Y-%m-%dT%H:%M:%S"))
        except (ValueError, OverflowError):
            return None
    return tuple(PastRun(i, state.strip().split(" ")[0], num(elapsed), None if (m := num(limit)) is None else 60 * m,
                         when(end))
                 for i, (state, elapsed, limit, end) in enumerate(rows))


# The states of a run still under way (the batch shell's hook runs inside the current one).
_LIVE = ("RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "CONFIGURING")


def past_runs(target: str, restart: int | None = None) -> tuple[tuple[PastRun, ...] | None, str]:
    """Every run of the job (an array task: ``A_I``), or None and why it is unknown (one ``sacct``);
    ``restart``: see :func:`parse_runs`."""
    if not target:
        return None, "no job id (SLURM_JOB_ID)"
    reply = slurm.sacct("-n", "-P", "-X", "--duplicates", "-j", target, "-o", "State,ElapsedRaw,TimelimitRaw,End")
    return (None, reply.why) if reply.out is None else (parse_runs(reply.out, restart), "")
