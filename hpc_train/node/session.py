"""One lifecycle for every way in: what a process does with its run directory, torch-free.

Every path ends here: the worker of ``run``/``submit``/``sbatch`` (config, ``--fn``, a callable,
``--script`` under its supervisor) and ``hpc_train.init()`` in a user's ``python train.py``,
``torchrun train.py`` or plain ``srun python train.py``. :func:`begin`, :func:`claim` and
:func:`register` run the same sequence on each (``init()`` claims after its process group is
up, so that every rank acts on rank 0's verdict together):

1. stop signals (first: a stop during start-up is kept, not fatal);
2. the environment (ranks from the launcher's variables) and rank-prefixed logging;
3. the run directory's lock, on rank 0 unless the local launcher holds it: a second process
   into a busy directory is refused at once, naming the holder;
4. a finished run (``result.json``) is never trained again: the caller gets the result back
   and does nothing;
5. once the run goes on (the group up, or ``init()``'s verdict), this rank's record and the
   heartbeat the watchdogs read.

:meth:`Session.close` undoes it in reverse, once, whatever happened: a finished run keeps no
stale ``stopped.json``, every finished or stopped run has its ``goodput.json``, the heartbeat
stops, the lock is released and, inside a user's program, the stop signals' handlers found at
step 1 are back. ``Run.close()`` (torch side) calls it after its own teardown.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_train import goodput, rundir
from hpc_train.config import Config
from hpc_train.errors import UsageError
from hpc_train.logs import setup_logging
from hpc_train.node import environment, watchdog
from hpc_train.node.environment import NodeEnv
from hpc_train.node.policy import ExitPolicy
from hpc_train.node.stops import StopRequest, stop_signals
from hpc_train.records import ranks
from hpc_train.records import result as result_record
from hpc_train.records import stop as stop_record

log = logging.getLogger("hpc_train")


@dataclass
class Session:
    """A process's hold on its run directory, from :func:`begin` to :meth:`close`."""

    cfg: Config
    run_dir: Path
    env: NodeEnv
    stop: StopRequest
    policy: ExitPolicy   # what this entry point does differently (hpc_train.node.policy)
    finished: dict[str, Any] | None = None   # result.json of a run that finished before this start
    beats: Any = None   # the heartbeat register() started, where the policy says beats_itself (hpc_train.node.beats)
    started: float = field(default_factory=time.time)
    _resources: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    _closed: bool = False

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    def close(self, finished: bool = False, record_goodput: bool = False) -> None:
        """The run directory's side of the one teardown; idempotent. ``finished``: this run
        just finished (rank 0 drops a ``stopped.json`` left by an earlier stop).
        ``record_goodput``: no Run kept this process's ledger (a supervised script), so the
        session records the segment itself, unless the script's own ``init()`` did."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.is_main and finished:
                stop_record.remove(self.run_dir)
            if self.is_main and record_goodput:
                goodput.record_segment(self.run_dir, self.started)
        finally:
            try:
                self._resources.close()
            finally:
                # Inside a user's program the handlers found at init() are back. A worker keeps
                # ours to its os._exit: a late signal must not end its teardown (StopRequest.ignore_further).
                if self.policy.handlers_back:
                    self.stop.restore()


def finished_result(run_dir: Path) -> dict[str, Any] | None:
    """The record of a finished run, or None. A damaged ``result.json`` still means finished
    (only a finished run writes it): its content is then unknown."""
    return result_record.read(Path(run_dir))[0]


def finished_line(run_dir: Path, result: dict[str, Any], how_to_restart: str) -> str:
    steps = result_record.steps(result)
    at = f" at step {steps}" if steps is not None else ""
    return (f"hpc_train: run {run_dir} finished{at} (a finished run: {result_record.NAME}); nothing to do. "
            f"{how_to_restart} starts over")


def begin(cfg: Config, run_dir: Path, policy: ExitPolicy) -> Session:
    """Steps 1-2 of the module docstring: stop signals, environment, logging, as the entry
    point's ``policy`` says (:mod:`hpc_train.node.policy`)."""
    rd = Path(run_dir)
    goodput.mark("worker")
    stop = StopRequest()
    stop.install(stop_signals(cfg.job.signal), policy.escalate, policy.restore_at_finish)
    env = environment.current()
    setup_logging(env.rank, rd, cfg.log.level)
    # torchrun's variables on every launch path (a torchrun-style script or fn reads them).
    os.environ.update(environment.torchrun_vars(env))
    os.environ[rundir.RUN_DIR_ENV] = str(rd.absolute())
    os.environ[rundir.CONFIG_ENV] = str((rd / rundir.CONFIG).absolute())
    if env.source == "torchrun" and os.environ.get("TORCHELASTIC_RUN_ID"):
        # torchrun killed with -9 forwards nothing, and its workers would train on, orphaned,
        # holding the run directory: they end with it, as the workers of hpc_train's launchers do.
        watchdog.die_with_launcher()
    if policy.own_process:
        _quiet_thread_os_errors()
        watchdog.enable_stack_dumps(rundir.rank_log(rd, env.rank))
    else:
        watchdog.stack_dumps_to_stderr()
    return Session(cfg, rd, env, stop, policy)


def claim(session: Session) -> None:
    """Steps 3-4: the lock (rank 0 takes it, unless a launcher of ours holds it) and a finished
    run (``session.finished``; nothing else is done then). Raises :class:`UsageError` for a busy
    run directory, naming the holder, having written nothing there: every file in it is the
    holder's."""
    s, env, res = session, session.env, session._resources
    try:
        if env.rank == 0 and not launcher_holds_lock():
            what = (f"Slurm job {env.job_id}" if env.job_id else
                    "a torchrun job" if env.source == "torchrun" else f"a training run ({env.source})")
            res.callback(rundir.RunDirLock(s.run_dir, what).acquire().release)
            os.environ[rundir.LOCK_HELD_ENV] = str(os.getpid())   # a supervised script's init() must not take it
        s.finished = finished_result(s.run_dir)
    except BaseException:
        res.close()
        raise


def register(session: Session) -> None:
    """Step 5: this rank's record (which replaces an earlier step's and removes that rank's
    error file) and, where the policy says ``beats_itself`` (a ``--script``'s supervisor), its
    heartbeat (``session.beats``: in node memory, or on that record across nodes; a Run beats
    through the store once its group is up: :mod:`hpc_train.node.beats`). Only once the run
    goes on, so that a start refused by a busy directory replaces nothing of the holder's: after
    the process group is up (rank 0, refused, never joins it) or ``init()``'s verdict; a
    supervisor, with no group, right after its claim."""
    s, env, res = session, session.env, session._resources
    try:
        ranks.begin(s.run_dir, env.rank, env.world_size)
        if s.policy.beats_itself:
            from hpc_train.node import beats
            s.beats = beats.for_script(env, s.run_dir, s.cfg.checkpoint.local_dir)
            res.callback(s.beats.stop)
            watch_slurm(s, s.beats)
    except BaseException:
        res.close()
        raise


def watch_slurm(s: Session, reader) -> None:
    """Rank 0 of a job step of hpc_train's own worker, more than one rank: the watchdog that ends
    the step when a peer stops beating on ``reader`` (:func:`watchdog.watch_slurm_job`)."""
    env, step = s.env, os.environ.get("SLURM_STEP_ID")
    if s.policy.own_process and env.rank == 0 and env.job_id and step is not None and env.world_size > 1:
        watchdog.watch_slurm_job(s.run_dir, env.world_size, s.cfg.dist.timeout_s, f"{env.job_id}.{step}", reader)


def prelaunch(s: Session, resume: str, signature: dict[str, Any] | None = None) -> None:
    """Rank 0, its lock held, where no launcher of hpc_train's prepared the run directory (a
    user's own program, a plain sbatch script's job step): the pre-launch sequence
    (:mod:`hpc_train.ckpt.prelaunch`). Raises :class:`UsageError` for a refused config."""
    from hpc_train.ckpt.prelaunch import prelaunch as sequence
    sequence(s.run_dir, s.cfg, resume, warn=log.warning, signature=signature, verify=False,
             requeued=s.env.restart_count > 0, advice=s.policy.advice)


def launcher_holds_lock() -> bool:
    """Workers of the local launcher (it holds the run directory's lock for all of them), and a
    script whose supervising worker holds it."""
    return os.environ.get(rundir.LAUNCHER_ENV) == "local" or rundir.LOCK_HELD_ENV in os.environ


def _quiet_thread_os_errors() -> None:
    """DCP's writer threads die of a full disk with a traceback each; the save's own error
    (raised in the training thread) already says it in one line. Worker processes are
    hpc_train's own, so the hook is ours to set; anything but an OSError keeps its traceback."""
    import threading
    default = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        name = getattr(args.thread, "name", "") or ""
        if isinstance(args.exc_value, OSError) or "_write_files_from_queue" in name:   # DCP's writers
            log.debug("thread %s: %s", name, args.exc_value)
            return
        default(args)
    threading.excepthook = hook


def refuse_or_exit(e: UsageError) -> None:
    """Inside a user's program (``init()``): a usage error is one line and exit 2, not a
    traceback through the user's code."""
    import sys
    print(f"hpc_train: {e}", file=sys.stderr)
    raise SystemExit(2)
