"""The batch shell's requeue hook, run after every ``srun``: gather, decide, act. No torch here.

:mod:`hpc_train.login.gather` reads the inputs once, :func:`hpc_train.login.decide.decide`
picks one decision, and :func:`act` carries it out: ``scontrol requeue`` (counted in
``requeue.json`` first: the requeue ends this batch step, and this hook with it, as soon as the
controller acts on it; taken back when ``scontrol`` fails), a job step restarted in place (the batch shell runs
``srun`` again: exit code :data:`~hpc_train.login.decide.AGAIN`, and the next step's
:data:`~hpc_train.login.decide.NEXT_FIELDS` on stdout, one per line, read back as data, never
evaluated), or the job's end with one line saying why.

Requeuing from the batch shell, after every rank has exited, means no rank is killed mid-save
by its own requeue, and works where ``scontrol`` is missing inside a container (the shell runs
outside it).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from hpc_train import slurm
from hpc_train.login.decide import AGAIN, Decision, decide, next_step
from hpc_train.login.gather import gather
from hpc_train.records import requeue as requeue_rec
from hpc_train.records.requeue import RequeueState

__all__ = ["AGAIN", "act", "hook"]


def scontrol_requeue(target: str) -> tuple[bool, str]:
    """``scontrol requeue TARGET``: (it went through, what scontrol said or why it did not)."""
    if not target:
        return False, "no job id (SLURM_JOB_ID is not set)"
    reply = slurm.scontrol("requeue", target)
    return reply.known, reply.last if reply.known else reply.why


def act(run_dir: Path, d: Decision, history: RequeueState, target: str, restart: int, now: float,
        requeue=scontrol_requeue) -> tuple[str, int, list[str]]:
    """Carry out ``d``: (the hook's line, the batch script's exit code, the fields for the next
    step). Only this writes ``requeue.json`` (through its owner), and a refusal writes nothing."""
    if d.action == "refused":
        return d.message, d.exit_code, []
    inc = requeue_rec.Incarnation(target, restart)
    history = history.seen_requeued(d.seen)     # runs requeued outside the hook, counted once

    def warn(message: str) -> None:
        print(f"hpc_train requeue-hook: warning: {message}", file=sys.stderr)
    from hpc_train import goodput
    goodput.exited(run_dir, goodput.job_start(os.environ))   # every task of this step has exited
    if d.action != "in_place":
        requeue_rec.remove_legacy_pending(run_dir)   # an earlier version's request, acted on
    if d.action == "requeue":
        # Written before the requeue: written after it, the controller's end of this batch step
        # (SIGTERM to every process of it) raced the write and sometimes won, and the requeue
        # went uncounted (a failure budget never spent).
        requeue_rec.write(run_dir, history.requeued(inc, d.cause or "failure", d.step, now, d.error), warn)
        ok, detail = requeue(target)
        if not ok:
            requeue_rec.write(run_dir, history, warn)   # taken back: nothing charged
            return (f"{d.message}; NOT requeued: scontrol requeue {target} failed: {detail} (nothing charged)",
                    _unrequeued_exit(d), [])
        return f"{d.message}; requeued {target}", 0, []
    if d.action in ("stop", "fail"):
        requeue_rec.write(run_dir, history.not_requeued(inc, d.cause or "failure", d.step, now, d.final or "",
                                                        d.error), warn)
        return d.message, d.exit_code, []
    if d.action == "in_place":
        assert d.restart is not None
        fields = next_step(d)
        if fields is None:
            return (f"{d.message}; NOT restarted: the resume path {d.next_resume!r} holds a line break, which the "
                    f"batch shell cannot read back; resubmit with a plain path", 1, [])
        requeue_rec.write(run_dir, history.restarted(d.restart), warn)
        return d.message, d.exit_code, list(fields)
    if d.seen or (history.problems and d.action != "finished"):
        requeue_rec.write(run_dir, history, warn)    # what was damaged goes aside, named once
    return d.message, d.exit_code, []


def _unrequeued_exit(d: Decision) -> int:
    """A requeue that did not go through: a stop ends unfinished, a failure with its status."""
    from hpc_train.errors import EXIT_STOPPED
    return EXIT_STOPPED if d.cause in ("preemption", "timeout") else 1


def hook(run_dir: Path, status: int, env: Mapping[str, str] | None = None, srun_tasks_per_node: int = 1,
         ranks_per_node: int | None = None, config: Path | None = None) -> tuple[str, int, list[str]]:
    """Gather, decide, act (see the module docstring)."""
    env = dict(os.environ if env is None else env)
    inputs, history = gather(Path(run_dir), status, env, srun_tasks_per_node, ranks_per_node or srun_tasks_per_node,
                             config)
    return act(Path(run_dir), decide(inputs), history, inputs.inc.target, inputs.inc.restart, inputs.now)


def cmd_requeue_hook(args: argparse.Namespace) -> int:
    """``python -m hpc_train requeue-hook RUN_DIR STATUS`` (run by the batch script)."""
    msg, code, lines = hook(Path(args.run_dir), args.status, srun_tasks_per_node=args.tasks_per_node,
                            ranks_per_node=args.ranks_per_node, config=args.config)
    print(f"hpc_train requeue-hook: {msg}", file=sys.stderr)
    for line in lines:
        print(line)
    return code
