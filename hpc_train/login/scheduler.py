"""Talking to Slurm from the login node: checks before submitting, and batched queries.

Etiquette (submitit #1759: too many ``sacct`` calls "stuck the whole cluster"): live jobs are
asked about through ``squeue`` (served from slurmctld's memory), ``sacct`` only for jobs that
have left the queue, every query covers all the jobs of interest in one call, and polling
backs off. No torch here.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpc_train import slurm
from hpc_train.config import JobSection, time_minutes
from hpc_train.records import jobs
from hpc_train.errors import UsageError, closest

FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED", "REVOKED"}


def require_slurm() -> None:
    if not slurm.installed():
        raise UsageError("submit needs Slurm (no `sbatch` on PATH here). To train on this machine use "
                         "`python -m hpc_train run CONFIG --nproc N`; to try Slurm locally start a cluster "
                         "with `sudo slurm/devcluster.sh up` and put its shims on PATH "
                         "(`eval \"$(slurm/devcluster.sh env)\"`)")


def check_resources(job: JobSection) -> None:
    """Refuse what the cluster cannot run, before anything is submitted (one ``sinfo`` call)."""
    time_minutes(job.time)
    out = slurm.sinfo("-h", "-o", "%P|%D|%c|%G|%a")
    if out.out is None:
        raise UsageError(sinfo_failed(out))
    parts, default = _partitions(out.out)
    partition = job.partition or default
    if partition not in parts:
        raise UsageError(f"job.partition: unknown partition '{job.partition}'{closest(job.partition, parts)} "
                         f"(this cluster has: {', '.join(sorted(parts))})")
    p = parts[partition]
    if job.nodes > p["nodes"]:
        raise UsageError(f"job.nodes: {job.nodes} nodes requested but partition '{partition}' has {p['nodes']}")
    if job.nodes + job.spare_nodes > p["nodes"]:
        raise UsageError(f"job.spare_nodes: job.nodes + job.spare_nodes = {job.nodes} + {job.spare_nodes} nodes "
                         f"requested but partition '{partition}' has {p['nodes']}; valid: job.spare_nodes "
                         f"0..{p['nodes'] - job.nodes}")
    tasks = tasks_per_node(job)
    if job.gpus_per_node > p["gpus"]:
        raise UsageError(f"job.gpus_per_node: {job.gpus_per_node} requested but nodes in '{partition}' have "
                         f"{p['gpus']} GPUs")
    if p["cpus"] and tasks * job.cpus_per_task > p["cpus"]:
        raise UsageError(f"job.tasks_per_node x job.cpus_per_task = {tasks} x {job.cpus_per_task} CPUs, but "
                         f"nodes in '{partition}' have {p['cpus']}")



def _partitions(text: str) -> tuple[dict[str, dict[str, int]], str | None]:
    """``sinfo -h -o %P|%D|%c|%G|%a`` as partition -> nodes, CPUs and GPUs per node, and the
    default partition (sinfo marks it with a trailing "*"). A line not in that form (a wrapper's
    noise, another version's format) is left out, never a traceback; numbers are ASCII digits."""
    parts: dict[str, dict[str, int]] = {}
    default = None
    for line in text.splitlines():
        f = line.split("|")
        if len(f) != 5 or not re.fullmatch(r"[0-9]{1,9}", f[1].strip()):
            continue
        name, nodes, cpus, gres, _avail = f
        base = name.rstrip("*")
        if name.endswith("*"):
            default = base
        p = parts.setdefault(base, {"nodes": 0, "cpus": 0, "gpus": 0})
        p["nodes"] += int(nodes)
        c = re.match(r"[0-9]{1,9}", cpus.strip())          # "4" or "4+" (nodes of more than one size)
        p["cpus"] = max(p["cpus"], int(c.group()) if c else 0)
        g = re.search(r"gpu(?::[^:(,]+)?:([0-9]{1,9})", gres)
        p["gpus"] = max(p["gpus"], int(g.group(1)) if g else 0)
    return parts, default


# How Slurm's commands say that no controller can be reached: none is configured here (no
# slurm.conf, no DNS SRV record: "configless" lookup failed), or the one configured does not answer.
_NO_CONFIG = ("Could not establish a configuration source", "fetch_config", "resolve_ctls_from_dns_srv")
_NO_ANSWER = ("Unable to contact slurm controller", "Connection refused", "Connection timed out")


def sinfo_failed(reply: slurm.Reply) -> str:
    """One line for a failed sinfo: several lines of its errors (a DNS lookup, then the config
    fetch, then the fatal one) are one cause, and the user needs that cause and what to do."""
    said = reply.said
    if not said:     # not on PATH, no answer in time, or nothing said
        return f"{reply.why}; is this a Slurm login node, and is slurmctld up? nothing was submitted"
    last = next((line for line in reversed(said) if "fatal" in line), said[-1] if said else "no output")
    last = last if len(last) <= 200 else last[:200] + "..."
    if any(k in line for line in said for k in _NO_CONFIG):
        return (f"no Slurm controller can be reached from here ({last}: no slurm.conf, and no DNS record names "
                f"a controller); submit from a login node of the cluster, or set SLURM_CONF; nothing was submitted")
    if any(k in line for line in said for k in _NO_ANSWER):
        return f"the Slurm controller does not answer ({last}); is slurmctld up? nothing was submitted"
    return f"sinfo failed: {last}; nothing was submitted"


def max_array_size() -> int | None:
    """The cluster's MaxArraySize (one ``scontrol show config``): an array of N tasks needs
    N <= MaxArraySize (indices 0..N-1). None when it cannot be read."""
    out = slurm.scontrol("show", "config")
    m = re.search(r"^MaxArraySize\s*=\s*([0-9]{1,9})\s*$", out.out or "", re.M)
    return int(m.group(1)) if m else None

def tasks_per_node(job: JobSection) -> int:
    return job.tasks_per_node or max(1, job.gpus_per_node)


# -- the run directory's record of its jobs (hpc_train.records.jobs) -------------------------
def record_job(run_dir: Path, job_id: str, how: str, **extra: object) -> None:
    jobs.append(Path(run_dir), job_id, how, lambda m: print(f"hpc_train: warning: {m}", file=sys.stderr), **extra)


def job_ids(run_dir: Path) -> list[str]:
    """The run directory's jobs, oldest first; none when job.json is absent or damaged (see
    :func:`job_problem`)."""
    return [e.job_id for e in jobs.read(Path(run_dir))[0]]


def job_problem(run_dir: Path) -> str | None:
    """What is wrong with the run directory's job.json, if it exists and is damaged."""
    return jobs.read(Path(run_dir))[1]


# -- batched queries -----------------------------------------------------------------------
@dataclass
class JobState:
    job_id: str
    state: str
    nodes: str = ""
    elapsed: str = ""
    restarts: int = 0
    reason: str = ""
    exit_code: str = ""

    @property
    def final(self) -> bool:
        return self.state.split()[0] in FINAL_STATES


@dataclass
class Answer:
    """What one query (one ``squeue``, one ``sacct``) said about some jobs.

    A failed query is "unknown", never "ended" (submitit's ``InfoWatcher``). Without ``squeue``
    no job's liveness is known: sacct's last row may be the final state of a requeued job's
    earlier run whose next run slurmdbd has not recorded yet. Without ``sacct``, a job squeue
    no longer lists has ended, but its final state and its restarts are unknown.
    """
    states: dict[str, JobState] = field(default_factory=dict)   # every job a query listed
    squeue_failed: str | None = None    # "squeue failed: <its error>"
    sacct_failed: str | None = None

    @property
    def failed(self) -> str | None:
        """The queries that did not answer, in one line; None when both did."""
        return "; ".join(f for f in (self.squeue_failed, self.sacct_failed) if f) or None

    def live(self, job_id: str) -> bool | None:
        """True while the job is queued or running, False once it has left the queue, None when
        the scheduler did not say."""
        if self.squeue_failed:
            return None
        st = self.states.get(job_id)
        return st is not None and not st.final

    def final(self, job_id: str) -> JobState | None:
        """The job's final state, once the scheduler said it; None while live or unknown."""
        st = self.states.get(job_id)
        return st if self.live(job_id) is False and st is not None and st.final else None


def _squeue(answer: Answer, job_list: str, *flags: str) -> None:
    reply = slurm.squeue("-h", *flags, "-j", job_list, "-o", "%i|%T|%N|%M|%r", empty_ok=True)
    answer.squeue_failed = reply.why or None
    for line in (reply.out or "").splitlines():
        jid, state, nodes, elapsed, reason = (line.split("|") + [""] * 5)[:5]
        answer.states[jid] = JobState(jid, state, nodes, elapsed, reason=reason)


def _add_sacct(answer: Answer, job_list: str) -> None:
    """Restarts of the jobs squeue knows, and the final state of those it no longer lists.
    sacct --duplicates lists every run of a requeued job: the count is the restarts."""
    reply = slurm.sacct("-n", "-P", "-X", "--duplicates", "-j", job_list, "-o", "JobID,State,NodeList,Elapsed,ExitCode",
                        empty_ok=True)
    answer.sacct_failed = reply.why or None
    runs: dict[str, list[list[str]]] = {}
    for line in (reply.out or "").splitlines():
        f = line.split("|")
        if len(f) >= 5:
            runs.setdefault(f[0], []).append(f)
    out = answer.states
    for jid, rows in runs.items():
        # A job that lost a node under --no-kill keeps a RESIZING row: the same run, shrunk.
        rows = [r for r in rows if r[1] != "RESIZING"] or rows
        if jid in out:
            out[jid].restarts = len(rows) - 1
        else:
            last = rows[-1]
            out[jid] = JobState(jid, last[1], last[2], last[3], restarts=len(rows) - 1, exit_code=last[4])


def query(ids: list[str]) -> Answer:
    """States of many jobs in two scheduler calls, whether or not either answers: squeue, then
    sacct for the rest."""
    ids = [i for i in dict.fromkeys(ids) if i]
    answer = Answer()
    if ids:
        _squeue(answer, ",".join(ids))
        _add_sacct(answer, ",".join(ids))
    return answer


def query_tasks(ids: list[str]) -> Answer:
    """States of array tasks (``A_I``) and plain jobs, keyed by those ids, in exactly two calls
    whatever their number: ``squeue -r`` and ``sacct`` over the array (base) ids. Asking for
    ``A`` rather than 100 ``A_I`` keeps the RPC small; ``-r`` lists pending tasks one per line
    (sacct's "A_[4-99%2]" row for tasks not started yet matches no id asked for)."""
    bases = list(dict.fromkeys(i.split("_")[0] for i in ids if i))
    answer = Answer()
    if bases:
        _squeue(answer, ",".join(bases), "-r")
        _add_sacct(answer, ",".join(bases))
        answer.states = {i: answer.states[i] for i in ids if i in answer.states}
    return answer


def poll_delay(held_s: float, max_delay: float = 30.0) -> float:
    """Seconds until the next poll, once the states have held for ``held_s``: a tenth of that,
    between 1 s and ``max_delay``. A change is then seen within about a tenth of the state's age
    (a 10-s job's end within a second; doubling the interval could lag as long as the job had
    run), and a long job costs the controller one query per ``max_delay``."""
    return min(max_delay, max(1.0, held_s / 10))


def wait(ids: list[str], on_change=None, max_delay: float = 30.0) -> dict[str, JobState]:
    """Block until every job has a final state, and return them; polls follow :func:`poll_delay`
    from the last change. ``on_change`` gets the :class:`Answer` whenever a state changes or
    a query stops or starts answering. A job left unknown by a failed query is not final, nor is
    a PREEMPTED one (it is being requeued): polling goes on."""
    changed, last = time.monotonic(), None
    while True:
        answer = query(ids)
        snapshot = ({k: v.state for k, v in answer.states.items()}, answer.failed)
        if snapshot != last:
            changed = time.monotonic()
            if on_change:
                on_change(answer)
            last = snapshot
        done = {i: st for i in ids if (st := answer.final(i)) is not None and st.state.split()[0] != "PREEMPTED"}
        if ids and all(i in done for i in ids):
            return done
        time.sleep(poll_delay(time.monotonic() - changed, max_delay))
