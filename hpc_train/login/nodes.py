"""Which nodes of the allocation the next job step runs on, after a lost node. No torch here.

With ``job.spare_nodes`` or ``job.min_nodes`` set, the batch script is submitted with
``--no-kill`` (Slurm keeps the allocation when one of its nodes fails) and asks for
``job.nodes + job.spare_nodes`` nodes; every ``srun`` is given the nodes it runs on
(:func:`first_step_args`, then :func:`next_step` after a failed step, through the requeue hook).

The next step's nodes: the allocation's nodes that are still the job's (``squeue``) and that
Slurm says are up (``sinfo``), in the allocation's order. When no node was lost, those where a
failed rank ran come last (a crashed process moves to a spare if there is one; without one, its
healthy node is used again; the batch shell's node is never singled out: the hook runs there, and
its rank may have failed only for losing a peer). ``job.nodes`` of them
when there are enough (a spare replaces a lost node: same world size, same ranks), else all of
them down to ``job.min_nodes`` (the run goes on resharded), else none: the failure goes to the
requeue and its budget, as without either setting.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hpc_train import rundir
from hpc_train.config import JobSection

# sinfo's long state names (``%T``) of a node a step can use; a trailing flag such as "*" (not
# responding), "~" (powered off) or "#" (powering up) or any other state (down, drained,
# draining, fail, maint, ...) rules it out.
_USABLE = {"allocated", "mixed", "idle", "completing"}
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


@dataclass
class Step:
    nodes: list[str]          # the next step's nodes, in order (rank 0's first)
    lost: list[str]           # allocated nodes Slurm no longer lists as up
    previous: int             # the failed step's node count

    def args(self, tasks_per_node: int) -> str:
        n = len(self.nodes)
        return f"--nodes={n} --ntasks={n * tasks_per_node} --nodelist={','.join(self.nodes)}"


def _expand(nodelist: str) -> list[str]:
    import hostlist  # python-hostlist
    try:
        return [h for h in hostlist.expand_hostlist(nodelist) if _HOST.fullmatch(h)]
    except hostlist.BadHostlist:
        return []


def _ask(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def allocation(job_id: str) -> list[str]:
    """The job's nodes now (one ``squeue``): with ``--no-kill`` Slurm drops a failed node from
    the allocation, while the batch shell's SLURM_JOB_NODELIST still names it."""
    return _expand(_ask(["squeue", "-h", "-j", job_id, "-o", "%N"]).strip()) if job_id else []


def node_states(hosts: list[str]) -> dict[str, str]:
    """Slurm's state of each host (one ``sinfo`` call); a host sinfo does not list is absent."""
    states = {}
    for line in _ask(["sinfo", "-h", "-N", "-n", ",".join(hosts), "-o", "%N|%T"]).splitlines():
        name, _, state = line.strip().partition("|")
        if name:
            states[name] = state.strip().lower()
    return states


def failed_hosts(run_dir: Path, ranks: list[int]) -> set[str]:
    """The hosts where ``ranks`` ran in the last step, from their heartbeat records."""
    hosts = set()
    for r in ranks:
        rec, _ = rundir.read_json(Path(run_dir) / rundir.LOGS / rundir.HEARTBEAT_DIR / f"rank-{r}")
        if isinstance(rec, dict) and isinstance(rec.get("host"), str):
            hosts.add(rec["host"])
    return hosts


def next_step(job: JobSection, env: Mapping[str, str], implicated: set[str], previous: int,
              now: list[str] | None = None, states: Mapping[str, str] | None = None) -> tuple[Step | None, str]:
    """The nodes for the step after a failed one, or None and why there are too few.
    ``implicated``: hosts where the failed step's failed ranks ran; ``now`` and ``states``: the
    job's nodes now and Slurm's node states (:func:`allocation`, :func:`node_states` when None)."""
    hosts = _expand(env.get("SLURM_JOB_NODELIST", ""))
    if not hosts:
        return None, "the allocation's nodes are unknown (SLURM_JOB_NODELIST)"
    now = allocation(env.get("SLURM_JOB_ID", "")) if now is None else now
    states = node_states(hosts) if states is None else states
    up = [h for h in hosts if h in now and states.get(h, "") in _USABLE]
    lost = [h for h in hosts if h not in up]
    # A lost node is the culprit (its peers failed too, having lost it). The batch shell's own
    # node is up (this runs there), and its rank 0 may have failed only for losing a peer.
    implicated = set() if lost else implicated - {env.get("SLURMD_NODENAME", "")}
    order = [h for h in up if h not in implicated] + [h for h in up if h in implicated]
    floor = job.min_nodes or job.nodes
    if len(order) < floor:
        down = ", ".join(f"{h}: {states.get(h) or 'gone'}{'' if h in now else ' (left the job)'}" for h in lost)
        return None, (f"{len(order)} of the allocation's {len(hosts)} nodes are up ({down}), fewer than "
                      f"{'job.min_nodes' if job.min_nodes else 'job.nodes'}={floor}")
    return Step(order[:job.nodes], lost, previous), ""
