"""What follows a job step, decided: a pure function from the gathered inputs to one decision.
No torch, no file, no process here: :mod:`hpc_train.login.gather` reads the inputs once,
:mod:`hpc_train.login.hook` acts. tests/login/test_decide.py holds the table and the invariants.

The decisions, in order:

* the run **finished** (``result.json``): nothing follows;
* the step was **refused** (exit 2: a usage error, a run directory another job holds): the same
  input fails the same way, and the run directory may be another job's, so nothing is
  restarted, requeued or charged;
* a **stop** (rank 0's request): the time limit's (its signal came within ``signal_lead`` + the
  controller's tick of the job's nominal end) or a preemption's, requeued within that cause's
  budget, else the job stops unfinished. A rank that died at the same moment does not turn it
  into a failure, with one exception: SIGTERM while a rank of the step failed is ``srun
  --kill-on-bad-exit`` ending the others after that rank died (the job's own signal is never
  srun's), so it is that rank's failure;
* a **straggler swap** (rank 0 stopped the step, with its checkpoint, because a rank was slow
  for ``dist.straggler_window_s``): restarted in place at the same world size with a spare in
  place of the slow rank's node, charging no budget; at most one swap per window; where no spare
  is up (or Slurm's view is unknown), restarted where it ran; near the time limit, the limit's stop;
* a **failure** (a rank exited non-zero, died, or never wrote its record): restarted **in place**
  while ``job.restarts_in_place`` lasts (a restart without a newer checkpoint than the last one's
  costs 2), with time to be stopped again (never in the last ``signal_lead`` seconds) and nodes
  to run on; else requeued within the failure budget; else the job **fails**, naming why.

Before any of these, an earlier run of the job that went back to the queue with no requeue
recorded (a script's own ``scontrol requeue``, as Lightning's auto-requeue does, or an
administrator's) is counted by what ``sacct`` says of it: the time limit's when it ran to within
``signal_lead`` + the tick of its limit, a failure's when its node failed, else a preemption's.

An in-place restart resumes from the run's own newest checkpoint once the job saved one (never
from ``--resume PATH`` again: that would move this job's work aside and train it again).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from hpc_train.errors import EXIT_STOPPED, EXIT_USAGE, says_peer_lost
from hpc_train.login.nodes import PastRun
from hpc_train.records.ranks import RankRecord
from hpc_train.records.requeue import Incarnation, InPlace, Pending, Requeue, RequeueState

AGAIN = 75              # the hook's exit code that runs srun again in the allocation (EX_TEMPFAIL)
# What the batch shell reads back from the hook for a step started again (exit AGAIN): one line
# per field, in this order, each read with ``read -r`` into ``hpc_train_next_<field>`` and never
# evaluated as shell text (login/batch.py): the next step's HPC_TRAIN_RESUME, and srun's node
# arguments ("" keeps the step's nodes).
NEXT_FIELDS = ("resume", "nodes", "local")
TICK_S = 60             # slurmctld checks time limits every 30 s: a signal may come up to a tick early
USABLE = {"allocated", "mixed", "idle", "completing"}   # sinfo states a step can use

SWAP_CAUSE = "straggler"
Action = Literal["finished", "refused", "requeue", "in_place", "stop", "fail", "none"]


@dataclass(frozen=True)
class Budgets:
    preemption: int      # -1: unlimited
    timeout: int
    failure: int
    in_place: int

    def of(self, cause: str) -> int:
        return {"preemption": self.preemption, "timeout": self.timeout, "failure": self.failure}[cause]


@dataclass(frozen=True)
class Nodes:
    """The job's node settings and Slurm's view, for a job that outlives a lost node
    (``job.spare_nodes`` or ``job.min_nodes``). ``now`` and ``states``: None when squeue or
    sinfo did not answer, or answered nothing: unknown, never "every node gone"."""

    want: int                              # job.nodes
    floor: int                             # job.min_nodes, else job.nodes
    allocated: tuple[str, ...]             # the allocation, in order (SLURM_JOB_NODELIST)
    batch_node: str                        # where the hook runs (SLURMD_NODENAME)
    now: tuple[str, ...] | None            # the job's nodes now (squeue)
    states: Mapping[str, str] | None       # Slurm's state of each (sinfo)
    unknown_why: str = ""


@dataclass(frozen=True)
class Inputs:
    status: int                            # srun's exit code
    finished: bool
    inc: Incarnation
    pending: Pending | None                # this step's stop request
    pending_note: str                      # a damaged or stale request, said once
    ranks: Mapping[int, RankRecord | None]  # every rank of the step (None: no record of this step)
    ranks_per_node: int                    # ranks on a node of the step
    srun_tasks_per_node: int               # srun's tasks on a node (1 under torchrun, which starts the ranks)
    budgets: Budgets
    history: RequeueState
    job_signal: str
    signal_lead: int
    now: float
    nominal_end: float | None              # the job's start + time limit (None: unknown or unlimited)
    newest_step: int | None                # the newest complete checkpoint (None: none)
    own_checkpoint: bool                   # it was saved by this job
    resume: str                            # the job's HPC_TRAIN_RESUME
    first_step_nodes: int                  # the first step's node count (job.nodes, or the allocation's)
    nodes: Nodes | None                    # None: srun's defaults, no node choice
    errors: Mapping[int, str] = field(default_factory=dict)   # first error line of ranks that wrote one, oldest first
    past_runs: tuple[PastRun, ...] | None = ()   # the job's runs (sacct), asked when some went unrecorded
    past_why: str = ""                     # why sacct's answer is unknown (past_runs None)
    window_s: float = 300.0                # dist.straggler_window_s: at most one swap per window
    local_step: int | None = None          # the node-local tier's newest the hook's node sees: progress too
    held_by: str | None = None             # another run holding the run directory as the hook runs


@dataclass(frozen=True)
class Decision:
    action: Action
    message: str
    exit_code: int
    cause: str | None = None
    step: int | None = None
    restart: InPlace | None = None         # the in-place entry to record
    final: str | None = None               # the line that ends the job unrequeued
    next_nodes: str | None = None          # srun's node arguments for the next step (None: unchanged)
    next_resume: str | None = None         # HPC_TRAIN_RESUME for the next step
    next_local: int | None = None          # the node-local tier's step the next step restores (the hook's choice)
    error: str | None = None               # the failure's first error line, kept in the record
    seen: tuple[Requeue, ...] = ()         # earlier runs requeued outside the hook, to count now


def next_step(d: Decision) -> tuple[str, ...] | None:
    """The :data:`NEXT_FIELDS` of a step started again, or None when one cannot travel as a line
    (a line break in an explicit resume path: the shell would read it as two fields)."""
    fields = (d.next_resume or "latest", d.next_nodes or "", "" if d.next_local is None else str(d.next_local))
    return None if any(c in f for f in fields for c in "\n\r\0") else fields


def _step(step: int | None) -> str:
    return "an unknown step" if step is None else f"step {step}"


def failed_ranks(i: Inputs) -> list[int]:
    """Ranks of the step that did not say their work ended: killed, crashed, or never started."""
    if i.status == 0:
        return []
    return sorted(r for r, rec in i.ranks.items() if rec is None or not rec.said_its_end)


def culprit_error(i: Inputs, failed: list[int]) -> tuple[int, str] | tuple[None, None]:
    """(rank, error line) of the failure: the failed rank that said why first (``errors`` is in
    the order the error files were written, not by rank number), preferring one that is not only
    reporting a lost peer (a victim of another rank's death)."""
    out = set(failed)
    said = [(r, e) for r, e in i.errors.items() if r in out and e]
    first = next(((r, e) for r, e in said if not says_peer_lost(e)), said[0] if said else (None, None))
    return first


def stop_cause(i: Inputs, failed: list[int]) -> str:
    """The cause of this step's stop request: timeout, preemption, or failure (srun's SIGTERM)."""
    p = i.pending
    assert p is not None
    at = p.received_at if p.received_at is not None else i.now
    if i.nominal_end is not None and i.nominal_end - at <= i.signal_lead + TICK_S:
        return "timeout"
    if failed and (p.signal != i.job_signal or p.signal == "TERM"):
        return "failure"     # srun's SIGTERM after a rank died (the job's own signal is never srun's)
    return "preemption"


def _limit(budget: int) -> str:
    return "unlimited" if budget < 0 else str(budget)


def past_cause(run: PastRun, signal_lead: int) -> str:
    """Why a run went back to the queue without the hook: its node failed, it ran to its time
    limit (within the lead and a tick, as the hook's own rule for a stop), or else it was stopped
    early (a preemption, or an administrator's requeue)."""
    if run.state == "NODE_FAIL":
        return "failure"
    if run.limit_s is not None and run.elapsed_s is not None and run.limit_s - run.elapsed_s <= signal_lead + TICK_S:
        return "timeout"
    return "preemption"


def outside_requeues(i: Inputs) -> tuple[tuple[Requeue, ...], str]:
    """The earlier runs requeued with no record of the hook's, as requeues to count, and a note.
    A run sacct does not list, or lists still running, is left for a later hook call."""
    missing = i.history.unrecorded(i.inc)
    if not missing:
        return (), ""
    runs = {} if i.past_runs is None else {r.restart: r for r in i.past_runs}
    seen = []
    for r in missing:
        run = runs.get(r)
        if run is None or run.state in ("RUNNING", "PENDING", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED"):
            continue
        seen.append(Requeue(Incarnation(i.inc.target, r).key, past_cause(run, i.signal_lead), None,
                            run.end if run.end is not None else i.now, True, by="outside"))
    said = "; ".join(f"run {e.key.rsplit(':', 1)[1]} was requeued outside hpc_train (by the script, such as "
                     f"Lightning's auto-requeue, or by hand): counted as a {e.cause}" for e in seen)
    left = len(missing) - len(seen)
    if left:
        why = f"sacct did not answer: {i.past_why}" if i.past_runs is None else "sacct does not list them yet"
        said += f"{'; ' if said else ''}{left} earlier run(s) requeued outside hpc_train not counted yet ({why})"
    return tuple(seen), said + "; "


def refused(i: Inputs) -> bool:
    """The step was refused: it exited 2, or it failed while another run holds the run directory
    and none of its ranks began (its rank 0, refused by the lock, wrote nothing there, and srun
    passed on its worst task's code: a peer it ended)."""
    return i.status == EXIT_USAGE or (i.status != 0 and i.held_by is not None
                                      and all(r is None for r in i.ranks.values()))


def decide(i: Inputs) -> Decision:
    if refused(i) and not i.finished:
        return _decide(i)     # a refusal writes nothing: the run directory may be another job's
    seen, note = outside_requeues(i)
    if not note:
        return _decide(i)
    i = replace(i, history=i.history.seen_requeued(seen), pending_note=note + i.pending_note)
    d = _decide(i)
    return replace(d, seen=seen, message=d.message if d.message.startswith(note) else note + d.message)


def _decide(i: Inputs) -> Decision:
    if i.finished:
        return Decision("finished", "run finished; no requeue", 0)
    if i.status == EXIT_USAGE:
        return Decision("refused", "the step was refused (exit 2: see its error above); a refusal is not "
                        "restarted, requeued or charged", EXIT_USAGE)
    if refused(i):
        return Decision("refused", f"the step was refused: the run directory is in use by {i.held_by} and "
                        f"none of this step's ranks began (srun's exit {i.status}: a rank it ended after "
                        f"rank 0's refusal); a refusal is not restarted, requeued or charged", EXIT_USAGE)
    failed = failed_ranks(i)
    if i.pending is not None:
        if i.pending.swap is not None and not failed:
            return _swap(i, i.pending)
        cause = stop_cause(i, failed)
        if cause != "failure":
            return _stop(i, cause, i.pending.step)
        note = (f"not a stop: rank {failed[0]} failed and srun ended the other ranks "
                f"(SIG{i.pending.signal}); ")
    elif i.status != 0:
        rank, error = culprit_error(i, failed)
        # No rank said why and a node is gone: the node is the culprit (named with the restart,
        # or below), not the first rank without an end record (rank 0 only lost its peers).
        note = (f"rank {rank} failed: {error}; " if rank is not None
                else "" if failed and _lost_hosts(i) else f"rank {failed[0]} failed; " if failed else "")
    else:
        return Decision("none", f"{i.pending_note}no requeue requested", 0)
    return _failure(i, i.pending_note + note, failed)


def _stop(i: Inputs, cause: str, step: int | None) -> Decision:
    done = i.history.asked(i.inc)
    if done is not None and done.requeued:
        return Decision("none", f"{i.pending_note}requeue of {i.inc.target} already done", 0)
    budget, used = i.budgets.of(cause), i.history.count(cause)
    if 0 <= budget <= used:
        final = f"stopped by {cause} at {_step(step)}; {cause} budget ({budget}) spent, not requeued"
        return Decision("stop", f"{i.pending_note}NOT requeued: {final}", EXIT_STOPPED, cause, step, final=final)
    return Decision("requeue", f"{i.pending_note}{cause} at {_step(step)}: requeue {used + 1} of {_limit(budget)}",
                    0, cause, step)


def local_choice(i: Inputs) -> int | None:
    """The node-local tier's step an in-place restart loads, when the tier serves it (its step
    at least as new as the shared tier's, as the restore decides): told to the next step."""
    if i.local_step is None or (i.newest_step is not None and i.local_step < i.newest_step):
        return None
    return i.local_step


def progress(i: Inputs) -> int | None:
    """The newest step saved on either tier: what a failure's 'no progress' is judged by."""
    return max((s for s in (i.newest_step, i.local_step) if s is not None), default=None)


def _failure(i: Inputs, note: str, failed: list[int]) -> Decision:
    step = progress(i)
    _, error = culprit_error(i, failed)
    if error is not None and i.history.last_failure() == (step, error):
        # The same error at the same step, with no checkpoint since: it will fail the same way.
        final = (f"the same error again at {_step(step)}, with no progress since the last attempt: {error}; "
                 f"not restarted or requeued again")
        return Decision("fail", f"{note}{final}", 1 if i.status in (0, AGAIN) else i.status, "failure", step,
                        final=final, error=error)
    why = _in_place_refusal(i)
    where: tuple[str | None, tuple[str, ...], tuple[str, ...] | None, str] = (None, (), None, "")
    if not why and i.nodes is not None:
        where = _next_nodes(i, failed)
        if where[0] is None:
            why = where[3]
    if not why:
        tried = i.history.failure_restarts()
        charge = 2 if tried and tried[-1].step == step else 1
        used = i.history.in_place_used()
        if used + charge > i.budgets.in_place:
            why = (f"in-place restarts spent ({used} of {i.budgets.in_place} used; a restart without a newer "
                   f"checkpoint counts twice)")
        else:
            args, lost, chosen, node_note = where
            before = _step_nodes(i)
            n_before = len(before) if before else i.first_step_nodes
            n_after = len(chosen) if chosen is not None else n_before
            rpn = i.ranks_per_node
            entry = InPlace(i.inc.target, i.inc.restart, step, i.now, charge, chosen, lost,
                            n_after * rpn, n_before * rpn, error)
            resume = "latest" if i.own_checkpoint or i.resume in ("latest", "none") else i.resume
            size = f"world size {n_before * rpn} -> {n_after * rpn}: " if n_after != n_before else ""
            return Decision("in_place", f"{note}{size}{node_note}restarting in place from {_step(step)} "
                            f"(in-place budget: {used + charge} of {i.budgets.in_place} used"
                            f"{'; no progress since the last restart, counted twice' if charge == 2 else ''})",
                            AGAIN, "failure", step, restart=entry, next_nodes=args, next_resume=resume,
                            next_local=local_choice(i))
    lost_now = _lost_hosts(i)
    if lost_now and not note.strip() and why != where[3]:
        note = f"{', '.join(lost_now)} lost; "   # else said by the refusal, which lists the nodes down
    note = f"{note}{why}; "
    done = i.history.asked(i.inc)
    if done is not None and done.requeued:
        return Decision("none", f"{note}requeue of {i.inc.target} already done", 0)
    budget, used = i.budgets.failure, i.history.count("failure")
    code = 1 if i.status in (0, AGAIN) else i.status
    step = i.newest_step     # a requeue lands on nodes that hold nothing: the shared tier's step
    if 0 <= budget <= used:
        # The record's last word names the culprit's error (status shows it); the line has it in its note.
        spent = f"failure budget ({budget}) spent, not requeued"
        final = f"failed at {_step(step)}{f': {error}' if error else ''}; {spent}"
        return Decision("fail", f"{note}failure at {_step(step)}; {spent}", code, "failure", step, final=final,
                        error=error)
    return Decision("requeue", f"{note}failure at {_step(step)}: requeue {used + 1} of {_limit(budget)}", 0,
                    "failure", step, error=error)


def _in_place_refusal(i: Inputs) -> str:
    if i.budgets.in_place <= 0:
        return "not restarted in place (job.restarts_in_place=0)"
    if i.nominal_end is not None and i.nominal_end - i.now <= i.signal_lead + TICK_S:
        return (f"not restarted in place: the time limit is {max(0, i.nominal_end - i.now):.0f} s away, within "
                f"job.signal_lead ({i.signal_lead} s) of it, where a new step would never get its stop signal")
    return ""


def _step_nodes(i: Inputs) -> tuple[str, ...] | None:
    """The failed step's nodes: this incarnation's last restart's, else unknown (the first step's)."""
    placed = [e for e in i.history.restarts_of(i.inc) if e.nodes is not None]
    return placed[-1].nodes if placed else None


def _args(nodes: tuple[str, ...], rpn_srun: int) -> str:
    return f"--nodes={len(nodes)} --ntasks={len(nodes) * rpn_srun} --nodelist={','.join(nodes)}"


def _up_hosts(i: Inputs) -> list[str]:
    """The allocation's nodes that Slurm lists in the job and as usable; a trailing flag on a
    state ("idle*": not responding, "idle~": powered off) rules the node out."""
    n = i.nodes
    if n is None or n.now is None or n.states is None:
        return []
    return [h for h in n.allocated if h in n.now and n.states.get(h, "") in USABLE]


def _lost_hosts(i: Inputs) -> tuple[str, ...]:
    """The allocation's nodes lost in this step (not those lost in an earlier one); none while
    Slurm's view is unknown."""
    n = i.nodes
    if n is None or n.now is None or n.states is None:
        return ()
    up = _up_hosts(i)
    known_lost = {h for e in i.history.restarts_of(i.inc) for h in e.lost}
    return tuple(h for h in n.allocated if h not in up and h not in known_lost)


def _next_nodes(i: Inputs, failed: list[int]) -> tuple[str | None, tuple[str, ...], tuple[str, ...] | None, str]:
    """(srun's node arguments, nodes newly lost, the nodes chosen, a note) for the next step; the
    arguments are None, with why in the note, when too few nodes are left."""
    n = i.nodes
    assert n is not None
    before = _step_nodes(i)
    tasks = i.srun_tasks_per_node
    if n.now is None or n.states is None:
        args = _args(before, tasks) if before else f"--nodes={n.want} --ntasks={n.want * tasks}"
        return (args, (), before,
                f"Slurm's view of the nodes is unknown ({n.unknown_why}): the next step runs where this one ran; ")
    up = _up_hosts(i)
    lost = _lost_hosts(i)
    step_nodes = before or tuple(n.allocated[:i.first_step_nodes])
    implicated = set()
    if not lost:   # a lost node is the culprit; else the nodes where a failed rank ran
        for r in failed:
            rec = i.ranks.get(r)
            node = rec.node if rec is not None else (step_nodes[r // i.ranks_per_node]
                                                      if r // i.ranks_per_node < len(step_nodes) else None)
            if node:
                implicated.add(node)
        implicated.discard(n.batch_node)   # its rank 0 may have failed only for losing a peer
    order = [h for h in up if h not in implicated] + [h for h in up if h in implicated]
    if len(order) < n.floor:
        down = ", ".join(f"{h}: {n.states.get(h) or 'gone'}{'' if h in n.now else ' (left the job)'}"
                         for h in n.allocated if h not in up)
        return (None, lost, None, f"not restarted in place: {len(order)} of the allocation's {len(n.allocated)} "
                f"nodes are up ({down}), fewer than {'job.min_nodes' if n.floor != n.want else 'job.nodes'}={n.floor}")
    chosen = tuple(order[:n.want])
    note = f"{', '.join(lost)} lost at {_step(i.newest_step)}; " if lost else ""
    return _args(chosen, tasks), lost, chosen, f"{note}next step on {','.join(chosen)}; "


def _swap(i: Inputs, p: Pending) -> Decision:
    """Rank 0 stopped the step, its checkpoint committed, to swap ``p.swap`` (a slow rank's node)
    for a spare: the next step runs with the spare in its place, at the same world size, and
    resumes from that checkpoint. No failure, so no budget is charged; a swap within
    ``window_s`` of the last one is refused (a job whose every node is slow must not churn)."""
    step, who = p.step, f"rank {'?' if p.swap_rank is None else p.swap_rank} on {p.swap}"
    if i.nominal_end is not None and i.nominal_end - i.now <= i.signal_lead + TICK_S:
        return _stop(i, "timeout", step)   # a new step would never get its stop signal: the limit's stop
    before = _step_nodes(i) or (tuple(i.nodes.allocated[:i.first_step_nodes]) if i.nodes is not None else None)
    last = max((e.time for e in i.history.swaps()), default=None)
    chosen, spare, why = None, "", ""
    if last is not None and i.now - last < i.window_s:
        why = (f"the last swap was {i.now - last:.0f} s ago, within dist.straggler_window_s ({i.window_s:g} s): "
               f"at most one per window")
    else:
        chosen, spare, why = _swap_nodes(i, p.swap or "", before)
    n = len(before) if before else i.first_step_nodes
    entry = InPlace(i.inc.target, i.inc.restart, step, i.now, 0, chosen or before, (), n * i.ranks_per_node,
                    n * i.ranks_per_node, None, SWAP_CAUSE, (p.swap or "", spare) if chosen else ())
    resume = "latest" if i.own_checkpoint or i.resume in ("latest", "none") else i.resume
    if chosen is None:
        return Decision("in_place", f"{i.pending_note}straggler: {who} was slow, not swapped: {why}; restarting in "
                        f"place where it ran, from {_step(step)}", AGAIN, SWAP_CAUSE, step, restart=entry,
                        next_resume=resume, next_local=local_choice(i))
    return Decision("in_place", f"{i.pending_note}straggler: {who} was slow for dist.straggler_window_s "
                    f"({i.window_s:g} s): {p.swap} swapped for {spare}; next step on {','.join(chosen)}; "
                    f"restarting in place from {_step(step)} (swap {len(i.history.swaps()) + 1}; no budget charged)",
                    AGAIN, SWAP_CAUSE, step, restart=entry, next_nodes=_args(chosen, i.srun_tasks_per_node),
                    next_resume=resume, next_local=local_choice(i))


def _swap_nodes(i: Inputs, slow: str, before: tuple[str, ...] | None) -> tuple[tuple[str, ...] | None, str, str]:
    """(the next step's nodes, the spare, why not) for swapping ``slow`` out; the nodes are None
    when no usable spare is in the allocation or Slurm's view is unknown."""
    n = i.nodes
    if n is None or before is None:
        return None, "", "the job has no spare node (job.spare_nodes=0)"
    if n.now is None or n.states is None:
        return None, "", f"Slurm's view of the nodes is unknown ({n.unknown_why})"
    if slow not in before:
        return None, "", f"{slow or 'its node'} is not a node of the step ({','.join(before)})"
    up = [h for h in n.allocated if h in n.now and n.states.get(h, "") in USABLE]
    down = [h for h in before if h != slow and h not in up]
    if down:   # the step would fail there: a failure's restart (with its node choice) follows
        return None, "", f"{', '.join(down)} of the step is not usable now ({n.states.get(down[0]) or 'gone'})"
    out = {e.swap[0] for e in i.history.swaps()}
    spares = sorted((h for h in up if h not in before), key=lambda h: h in out)   # one swapped out before: last
    if not spares:
        return None, "", f"no spare node of the allocation ({','.join(n.allocated)}) is up"
    keep = set(before) - {slow} | {spares[0]}
    return tuple(h for h in n.allocated if h in keep), spares[0], ""
