"""``requeue.json``, and the stop request as the hook reads it: the run's requeues and in-place restarts. No torch.

``requeue.json`` is the history the budgets are counted from, across every incarnation of the
job: one :class:`Requeue` per stop or failure that asked to go back to the queue (``requeued``:
whether it went), one :class:`InPlace` per job step started again inside the allocation (after
a failure, or with a straggler's node swapped for a spare: ``swaps`` counts those), and
``final``, the line of a stop whose budget was spent. A run of the job that went back to the
queue without the hook (a script's own ``scontrol requeue``, such as Lightning's auto-requeue, or
an administrator's) is counted too, once the hook sees it in ``sacct`` (``by: outside``). Counts are never stored as the truth: a
cause's count is the number of its requeues that went through, so no hand-edited or damaged
count can buy budget, and no count can go negative. (The file still carries ``counts`` for a
reader's eyes.)

:class:`Pending` is rank 0's stop request for the batch shell, as the hook reads it from the
stop record (``stopped.json``; an earlier version wrote ``requeue.pending``, still read): the
signal it got, when, and the step it saved; the hook decides what it was (a preemption, the time
limit, srun ending the ranks after one died). It names the step it came from
(:class:`~hpc_train.records.ranks.StepId`), so a request a killed batch shell never handled, or
one a step before this one left, is not taken for this step's.

Only the batch shell's hook (:mod:`hpc_train.login.hook`) changes ``requeue.json``, and only
through :func:`write` with a state built by the transitions below; rank 0 writes the request.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

from hpc_train import rundir
from hpc_train.records import io
from hpc_train.records import fields
from hpc_train.records import stop as stop_rec
from hpc_train.records.ranks import StepId
from hpc_train.records.fields import Bad

NAME = "requeue.json"
PENDING = "requeue.pending"
CAUSES = ("preemption", "timeout", "failure")
RESTART_CAUSES = ("failure", "straggler")   # why a step was started again in the allocation
BY = ("hpc_train", "outside")
MAX_CHARGE = 2            # an in-place restart that made no progress counts twice
T = TypeVar("T")


@dataclass(frozen=True)
class Incarnation:
    """One run of the job: Slurm requeues it under the same id, and ``SLURM_RESTART_COUNT``
    tells the runs apart. ``target`` is what ``scontrol requeue`` names (the array task)."""

    target: str
    restart: int

    @property
    def key(self) -> str:
        return f"{self.target}:{self.restart}"


@dataclass(frozen=True)
class Requeue:
    """A stop or failure that asked for a requeue, and whether it went back to the queue."""

    key: str                  # the incarnation that asked (see Incarnation.key)
    cause: str
    step: int | None          # the step it had saved (None: unknown, a script's own)
    time: float
    requeued: bool
    error: str | None = None  # a failure's first error line (the rank that failed first)
    by: str = "hpc_train"     # who requeued it: the hook, or someone else ("outside", seen in sacct)


@dataclass(frozen=True)
class InPlace:
    """A job step started again inside the allocation: after a failed one, or after rank 0 stopped
    the step to swap a slow node for a spare (``cause`` straggler: no failure, so it charges
    nothing; at most one per ``dist.straggler_window_s``)."""

    job: str
    restart: int | None       # None: written before incarnations were told apart
    step: int | None          # the checkpoint it resumed from (None: unknown)
    time: float
    charge: int               # budget spent: 1, or 2 when no checkpoint was newer than the last restart's
    nodes: tuple[str, ...] | None = None    # the next step's nodes (after a lost node)
    lost: tuple[str, ...] = ()
    world_size: int | None = None
    world_before: int | None = None
    error: str | None = None                # the failed step's first error line
    cause: str = "failure"                  # one of RESTART_CAUSES
    swap: tuple[str, ...] = ()              # a straggler's (node swapped out, spare swapped in); (): none

    def of(self, inc: Incarnation) -> bool:
        return self.job == inc.target and self.restart == inc.restart


@dataclass(frozen=True)
class RequeueState:
    events: tuple[Requeue, ...] = ()
    in_place: tuple[InPlace, ...] = ()
    final: str | None = None
    requeued_at: tuple[float, ...] = ()
    problems: tuple[str, ...] = ()     # what the reader set aside (named once; moved aside at the next write)
    unreadable_restarts: int = 0       # in-place entries that could not be read: each costs 1
    _aside: dict[str, object] = field(default_factory=dict, compare=False, repr=False)

    def count(self, cause: str) -> int:
        return sum(1 for e in self.events if e.requeued and e.cause == cause)

    @property
    def counts(self) -> dict[str, int]:
        return {c: self.count(c) for c in CAUSES}

    def swaps(self) -> tuple[InPlace, ...]:
        """The steps restarted with a slow node swapped for a spare."""
        return tuple(e for e in self.in_place if e.swap)

    def failure_restarts(self) -> tuple[InPlace, ...]:
        return tuple(e for e in self.in_place if e.cause == "failure")

    def in_place_used(self) -> int:
        """The in-place budget spent over the run (an unreadable entry costs 1, never 0)."""
        return sum(e.charge for e in self.in_place) + self.unreadable_restarts

    def restarts_of(self, inc: Incarnation) -> tuple[InPlace, ...]:
        return tuple(e for e in self.in_place if e.of(inc))

    def unrecorded(self, inc: Incarnation) -> tuple[int, ...]:
        """The earlier runs of ``inc``'s job (restart counts) that went back to the queue with no
        requeue recorded: someone other than the hook requeued them."""
        done = {e.key for e in self.events if e.requeued}
        return tuple(r for r in range(inc.restart) if Incarnation(inc.target, r).key not in done)

    def asked(self, inc: Incarnation) -> Requeue | None:
        """This incarnation's requeue request, if it made one (at most one per incarnation)."""
        return next((e for e in self.events if e.key == inc.key), None)

    # -- transitions: the only ways the history changes ----------------------------------------
    def requeued(self, inc: Incarnation, cause: str, step: int | None, now: float,
                 error: str | None = None) -> RequeueState:
        """``scontrol requeue`` went through for ``inc``: counted now, never before."""
        return replace(self, events=(*self.events, Requeue(inc.key, cause, step, now, True, error)),
                       requeued_at=(*self.requeued_at, now), final=None)

    def seen_requeued(self, seen: tuple[Requeue, ...]) -> RequeueState:
        """Runs requeued outside the hook, as ``sacct`` showed them afterwards: counted once each."""
        fresh = tuple(e for e in seen if e.requeued and e.key not in {x.key for x in self.events if x.requeued})
        return replace(self, events=(*self.events, *fresh), requeued_at=(*self.requeued_at, *(e.time for e in fresh)))

    def not_requeued(self, inc: Incarnation, cause: str, step: int | None, now: float, final: str,
                     error: str | None = None) -> RequeueState:
        """A stop or failure that ends the job: recorded, with the line that says why."""
        return replace(self, events=(*self.events, Requeue(inc.key, cause, step, now, False, error)), final=final)

    def last_failure(self) -> tuple[int | None, str | None] | None:
        """(step, error line) of the newest failure restarted or requeued; None when none was."""
        tried = [(e.time, e.step, e.error) for e in self.failure_restarts()]
        tried += [(e.time, e.step, e.error) for e in self.events if e.cause == "failure" and e.requeued]
        return max(tried, key=lambda t: t[0])[1:] if tried else None

    def restarted(self, entry: InPlace) -> RequeueState:
        return replace(self, in_place=(*self.in_place, entry))


def path(run_dir: Path) -> Path:
    return Path(run_dir) / NAME


def _event(d: object) -> Requeue:
    if not isinstance(d, dict):
        raise Bad(f"is {d!r}, not an object")
    return Requeue(fields.text(d, "key"), fields.text(d, "cause", choices=CAUSES), fields.opt_count(d, "step"),
                   fields.time(d, "time"), fields.flag(d, "requeued"), fields.opt_text(d, "error"),
                   fields.text(d, "by", "hpc_train", choices=BY))


def _restart(d: object) -> InPlace:
    if not isinstance(d, dict):
        raise Bad(f"is {d!r}, not an object")
    nodes = fields.names(d, "nodes") if d.get("nodes") is not None else None
    cause = fields.text(d, "cause", "failure", choices=RESTART_CAUSES)
    swap = fields.names(d, "swap")
    if len(swap) not in (0, 2):
        raise Bad(f"swap is {list(swap)!r}, not [node swapped out, spare swapped in]")
    # A failure's restart costs 1 or 2; a straggler's nothing (no hand-edit buys budget with 0).
    return InPlace(fields.text(d, "job"), fields.opt_count(d, "restart"), fields.opt_count(d, "step"),
                   fields.time(d, "time"), fields.count(d, "charge", 1, lo=int(cause == "failure"), hi=MAX_CHARGE),
                   nodes, fields.names(d, "lost"), fields.opt_count(d, "world_size", lo=1),
                   fields.opt_count(d, "world_before", lo=1), fields.opt_text(d, "error"), cause, swap)


def _entries(raw: dict[str, object], key: str, parse: Callable[[object], T], problems: list[str],
             aside: dict[str, object]) -> list[T]:
    """The entries of the list ``raw[key]`` that ``parse`` takes; what it refuses (or a ``key``
    that is no list) is named in ``problems`` and kept in ``aside[key]``."""
    value = raw.get(key, [])
    if not isinstance(value, list):
        problems.append(f"{NAME}: {key} is {value!r}, not a list")
        aside[key] = value
        return []
    good: list[T] = []
    bad: list[object] = []
    for i, entry in enumerate(value):
        try:
            good.append(parse(entry))
        except Bad as e:
            problems.append(f"{NAME}: {key}[{i}] {e}")
            bad.append(entry)
    if bad:
        aside[key] = bad
    return good


def read(run_dir: Path) -> RequeueState:
    """The history, validated. A damaged file or entry is left out and named in ``problems``
    (and moved aside by the next :func:`write`); reading never fails and never changes a file."""
    raw, problem = io.read_json(path(run_dir))
    if raw is None:
        return RequeueState(problems=(f"{NAME} {problem}",) if problem else (), _aside={"file": problem} if problem else {})
    problems: list[str] = []
    aside: dict[str, object] = {}
    events = _entries(raw, "events", _event, problems, aside)
    in_place = _entries(raw, "in_place", _restart, problems, aside)
    bad_restarts = aside.get("in_place")
    unreadable = len(bad_restarts) if isinstance(bad_restarts, list) else int("in_place" in aside)
    counts = raw.get("counts", {})
    if not isinstance(counts, dict) or any(not isinstance(v, int) or isinstance(v, bool) or v < 0
                                           for v in counts.values()):
        problems.append(f"{NAME}: counts {counts!r} are not counts; each cause's count is taken from its events")
        aside["counts"] = counts
    final = raw.get("final")
    if final is not None and not isinstance(final, str):
        problems.append(f"{NAME}: final is {final!r}, not a line")
        aside["final"], final = final, None
    at = raw.get("requeued_at", [])
    times = [t for t in at if fields.is_time(t)] if isinstance(at, list) else []
    return RequeueState(tuple(events), tuple(in_place), final, tuple(float(t) for t in times),
                        tuple(problems), unreadable, aside)


def _entry(e: Requeue | InPlace) -> dict[str, object]:
    d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in e.__dict__.items()}
    return {k: v for k, v in d.items() if v is not None or k in ("step", "restart")}


def write(run_dir: Path, state: RequeueState, warn: Callable[[str], None] | None = None) -> None:
    """The one writer of ``requeue.json``. What the reader found damaged is first moved aside
    (``requeue.json.damaged-<time>``, with the reader's problems), named in one line."""
    if state._aside:
        aside = rundir.damaged_name(path(run_dir))
        rundir.write_atomic(aside, json.dumps({"problems": list(state.problems), "entries": state._aside},
                                              indent=2, default=repr))
        (warn or logging.getLogger("hpc_train").warning)(
            f"{path(run_dir)}: {'; '.join(state.problems)}; moved to {aside.name}, and the run goes on without it")
    rec = {"counts": state.counts, "swaps": len(state.swaps()), "events": [_entry(e) for e in state.events],
           "in_place": [_entry(e) for e in state.in_place], "requeued_at": list(state.requeued_at)}
    if state.final:
        rec["final"] = state.final
    rundir.write_atomic(path(run_dir), json.dumps(rec, indent=2))


# -- the stop request ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Pending:
    """Rank 0's request after a stop, as the batch shell's hook reads it: the stop record's
    (``stopped.json``, :class:`hpc_train.records.stop.Request`) or, in a run directory of an
    earlier version, ``requeue.pending``'s. The hook decides what follows."""

    target: str               # this job as scontrol names it
    step: int | None          # the checkpoint's step (None: the code saved nothing of hpc_train's)
    signal: str               # the signal's name as job.signal names it, e.g. USR2, TERM
    received_at: float | None
    job: str = ""             # the step that asked (see hpc_train.records.ranks.StepId)
    restart: int = 0
    attempt: int = 0
    swap: str | None = None   # a straggler stop: the slow rank's node, to swap for a spare
    swap_rank: int | None = None
    source: str = stop_rec.NAME   # the record it was read from (PENDING: an earlier version's)

    @classmethod
    def of(cls, r: stop_rec.Request, step: int | None, signal: str, received_at: float | None,
           source: str = stop_rec.NAME) -> Pending:
        return cls(r.target, step, signal, received_at, r.job, r.restart, r.attempt, r.swap, r.swap_rank, source)

    def is_of(self, step: StepId) -> bool:
        """Whether step ``step`` left this request: the same job and incarnation, and the same
        attempt where both know theirs (a batch script that does not count its steps runs one)."""
        return (self.job, self.restart) == (step.job, step.restart) and not 0 < self.attempt != step.attempt > 0


def pending_path(run_dir: Path) -> Path:
    """``requeue.pending``: where an earlier version kept the request (read, and removed once acted on)."""
    return Path(run_dir) / PENDING


def read_pending(run_dir: Path, since: float = 0.0) -> tuple[Pending | None, str | None]:
    """(request, None); (None, None) when there is none; (None, what is wrong, naming the file)
    when damaged: the stop record's request, else an earlier version's ``requeue.pending``.
    Which step it is of is the reader's question (its ``job``, ``restart`` and ``attempt``). A
    damaged stop record, which outlives its step, counts only when written at or after ``since``
    (the batch shell's start): an older one is no request of this job's."""
    rec, problem = stop_rec.read(run_dir)
    legacy = pending_path(run_dir)
    if (rec is None or rec.request is None) and (legacy.exists() or legacy.is_symlink()):
        return _read_legacy(legacy)
    if problem is not None:
        written = stop_rec.written_at(run_dir)
        return (None, None) if written is not None and written < since else (None, f"{stop_rec.NAME} {problem}")
    if rec is None or rec.request is None:
        return None, None
    return Pending.of(rec.request, rec.steps, rec.signal, rec.received_at), None


def _read_legacy(path: Path) -> tuple[Pending | None, str | None]:
    raw, problem = io.read_json(path)
    if raw is None:
        return None, problem and f"{PENDING} {problem}"
    try:
        # A request left by a step before the writer stored job.signal's form (SIGUSR2) means
        # the same signal.
        return Pending.of(stop_rec.request_from(raw), fields.opt_count(raw, "step"),
                          fields.text(raw, "signal", "").removeprefix("SIG"), fields.opt_time(raw, "received_at"),
                          PENDING), None
    except Bad as e:
        return None, f"{PENDING} {e}"


def remove_legacy_pending(run_dir: Path) -> None:
    """An earlier version's ``requeue.pending``, once acted on: never taken for a later step's.
    (The stop record's request stays: it names its step.)"""
    rundir.remove_record(pending_path(run_dir))
