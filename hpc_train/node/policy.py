"""What differs between the ways into a rank's life: one table, keyed by entry point.

Every rank runs the same sequence (:mod:`hpc_train.node.session` and :mod:`hpc_train.lifecycle`:
stop signals -> environment -> claim -> group -> prepare -> register -> run -> end). What the entry points
do differently in it is here and nowhere else: who runs the pre-launch sequence, whether a stop
escalates, whether the program's signal handlers come back, whether the process group is
destroyed or left to the process's exit, who ends the process and with what. A reader of the
lifecycle looks up ``session.policy.<field>``; a test reads this table as it reads ``decide``'s.

The entry points:

* ``TRAINER``: ``python -m hpc_train worker`` (``run``, ``submit``, ``sbatch``) running the
  built-in trainer. hpc_train's own process, ended by :func:`hpc_train.lifecycle.exit_done`.
* ``CODE``: the same worker running ``train.fn`` or a submitted callable: the user's code may
  go on after ``finish()``, so the handlers come back there.
* ``SUPERVISOR``: the same worker for a ``--script``: no torch, no group, no ``Run``; it beats for
  the script, which may know nothing of hpc_train.
* ``PROGRAM``: ``hpc_train.init()`` in a user's own ``python train.py``, ``torchrun`` or
  ``srun``: the user's process. Rank 0 runs the pre-launch sequence; the exit after a stop is
  non-zero and says how to resume, in the variables the user speaks.
* ``SCRIPT``: ``hpc_train.init()`` in a ``--script`` under a supervisor, which holds the lock
  and prepared the run directory, and which says how to resume.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from hpc_train.advice import FLAGS, VARIABLES, Advice


class Entry(enum.Enum):
    TRAINER = "trainer"
    CODE = "code"
    SUPERVISOR = "supervisor"
    PROGRAM = "program"
    SCRIPT = "script"


@dataclass(frozen=True)
class ExitPolicy:
    """One entry point's answers. Each field is a question the lifecycle asks once."""

    # hpc_train's own process: it may set process-wide hooks (thread errors, stack dumps) and
    # watch the Slurm step; its handlers stay ours to the end (a late signal must not cut the teardown).
    own_process: bool
    # A stop the code does not act on within a grace period ends it (StopRun). Not for a
    # supervisor: its script gets the stop as a signal, and the supervisor waits for it.
    escalate: bool
    # How the user speaks to hpc_train: flags (--resume none, --run-dir) to run/submit/sbatch;
    # in their own program, variables (HPC_TRAIN_RESUME=none). A refusal's way out says it their way.
    advice: Advice
    # Rank 0 runs the pre-launch sequence (config against the checkpoints', resume plan, config
    # written): nobody prepared the run directory before this process started.
    prelaunch: bool
    # This path made the process group, so its teardown ends it.
    owns_group: bool
    # The process ends through hpc_train's os._exit (lifecycle.exit_done/exit_now): the group is
    # left for that exit to release instead of destroyed (see hpc_train.node.group.shutdown).
    leaving: bool
    # finish() gives the program's signal handlers back (code of the user's may follow it).
    restore_at_finish: bool
    # The end gives the handlers found at the start back (the process is the user's).
    handlers_back: bool
    # After a stop, rank 0 says how to resume: the user typed this process's command.
    resume_hint: bool
    # The process beats for its rank itself (in node memory, or on its record across nodes): no
    # group of its own to beat through (hpc_train.node.beats).
    beats_itself: bool

    def unprepared(self) -> ExitPolicy:
        """The same entry where no launcher of hpc_train's prepared the run directory (a plain
        sbatch script's job step, whose config travels in the script): rank 0 prepares it."""
        return dataclasses.replace(self, prelaunch=True)

    def group_found(self) -> ExitPolicy:
        """The same entry where the program set up its own process group before ``init()``:
        used as it is, and left to the program."""
        return dataclasses.replace(self, owns_group=False)


_WORKER = ExitPolicy(own_process=True, escalate=True, advice=FLAGS, prelaunch=False,
                     owns_group=True, leaving=True, restore_at_finish=True, handlers_back=False,
                     resume_hint=False, beats_itself=False)
_INIT = ExitPolicy(own_process=False, escalate=True, advice=VARIABLES, prelaunch=True,
                   owns_group=True, leaving=False, restore_at_finish=True, handlers_back=True,
                   resume_hint=True, beats_itself=False)

POLICIES: dict[Entry, ExitPolicy] = {
    # No code of the user's runs after the trainer's finish(): ours to the process's os._exit.
    Entry.TRAINER: dataclasses.replace(_WORKER, restore_at_finish=False),
    Entry.CODE: _WORKER,
    Entry.SUPERVISOR: dataclasses.replace(_WORKER, escalate=False, owns_group=False, beats_itself=True),
    Entry.PROGRAM: _INIT,
    Entry.SCRIPT: dataclasses.replace(_INIT, advice=FLAGS, prelaunch=False, resume_hint=False),
}


def policy(entry: Entry) -> ExitPolicy:
    return POLICIES[entry]
