"""Requeue, rank 0's side: once per stop, from the batch shell. No torch here.

Flow on a stop signal (preemption, or the time limit's ``--signal``/SIGTERM):

1. every rank agrees at a step boundary, saves, and exits cleanly (trainer + checkpoint);
2. rank 0, before exiting, leaves its request for the batch shell in the stop record: the
   signal, when it came, the step it saved, the step that asks (:func:`request_for_stop`,
   ``stopped.json``). It counts nothing;
3. after ``srun`` returns, the batch shell runs the requeue hook
   (:mod:`hpc_train.login.hook`), which decides (a time-limit stop or a preemption, within that
   cause's budget; a failure, restarted in place first) and issues at most one
   ``scontrol requeue``, of ``ARRAYJOB_TASK`` for array tasks, never the whole array. The
   requeue is counted in ``requeue.json`` once scontrol has done it.

Budgets are counted per cause over every incarnation of the job, so preemptions never use up
the time-limit budget. A finished run (``result.json``) is never requeued.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from hpc_train.records import requeue as record
from hpc_train.records.ranks import StepId
from hpc_train.records.stop import Request


def budgets_of(j) -> dict[str, int]:
    """The requeue budgets per cause, from the config's job section."""
    return {"preemption": j.requeue_preemption, "timeout": j.requeue_timeout, "failure": j.requeue_failure}


def requested(run_dir: Path) -> bool:
    """Rank 0 of this step asked the batch shell for a requeue (the stop record's request names
    this step)."""
    pending, _ = record.read_pending(Path(run_dir))
    return pending is not None and pending.is_of(StepId.from_env())


def request_for_stop(env, step: int | None, stop) -> tuple[str, Request]:
    """Rank 0, after a stop's checkpoint (or a stopped script): the request for the batch shell's
    hook, which decides, and the line for the stop record and the log. The stop record holds
    both (:func:`hpc_train.node.stops.record_stop`)."""
    received = getattr(stop, "received_at", None) or time.time()
    here = StepId.from_env()
    target = env.requeue_target or ""
    swap = getattr(stop, "swap", None)    # (rank, node) of a straggler stop: the hook swaps the node
    request = Request(target, here.job, here.restart, here.attempt, swap and swap[1], swap and swap[0])
    at = "an unknown step" if step is None else f"step {step}"
    # No cause here: srun's SIGTERM after a peer died looks the same from this rank as the
    # scheduler's stop. The hook, which sees every rank's record, says what it was.
    why = f"to swap {swap[1]} (rank {swap[0]}'s node, a straggler) for a spare" if swap else f"by {stop.name}"
    msg = f"stopped {why} at {at}; asked the batch shell's requeue hook to decide what follows for {target}"
    logging.getLogger("hpc_train").warning("%s (%.1fs after the signal)", msg, time.time() - received)
    return msg, request
