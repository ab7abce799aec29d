"""A process's Run, from start-up to exit, on every path.

``hpc_train.init()`` in a user's ``python train.py``, ``torchrun train.py`` or plain ``srun
python train.py`` and the worker of ``run``/``submit``/``sbatch`` build their Run the same way:
:mod:`hpc_train.node.session` (stop signals, environment, the run directory's lock, a finished
run refused, heartbeat) -> process group -> :class:`~hpc_train.run.Run`. :func:`end` is the one
teardown, on every path (outside hpc_train's launchers ``init()`` registers it for the
process's exit); :func:`exit_done` and :func:`exit_now` are the ways out of hpc_train's own
processes, and of a user's program after a stop.

Under hpc_train's launchers the worker builds the Run before the user's code starts, and
``init()`` returns that one.
"""

from __future__ import annotations

import atexit
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_train import config as config_mod
from hpc_train import rundir
from hpc_train.advice import Advice
from hpc_train.config import Config
from hpc_train.errors import UsageError
from hpc_train.node import session as session_mod
from hpc_train.node.policy import Entry, ExitPolicy, policy

if TYPE_CHECKING:
    import torch

    from hpc_train.run import Run

log = logging.getLogger("hpc_train")
_current: Run | None = None



def current() -> Run | None:
    """The process's Run, if one was built."""
    return _current


def start(session: session_mod.Session, device: torch.device) -> Run:
    """Make a Run the process's own (the worker does this before the user's code runs)."""
    global _current
    from hpc_train.run import Run
    _current = Run(session, device)
    return _current


def forget() -> None:
    """The worker, once its Run is closed: a later ``init()`` in the process starts anew."""
    global _current
    _current = None


def init(config: Config | str | os.PathLike | None = None, *, run_dir: str | os.PathLike | None = None,
         overrides: list[str] = ()) -> Run:
    """The process's Run (see :func:`hpc_train.init`)."""
    if _current is not None:
        return _current
    import torch.distributed as dist
    # Under hpc_train's launcher (a --script), which chose, checked and wrote the config.
    entry = Entry.SCRIPT if rundir.CONFIG_ENV in os.environ else Entry.PROGRAM
    # A program that set up its own process group (its own init_process_group) keeps it.
    chosen = policy(entry).group_found() if dist.is_initialized() else policy(entry)
    try:
        cfg, rd = _config(config, run_dir, list(overrides), chosen)
        s = session_mod.begin(cfg, rd, chosen)
    except UsageError as e:
        session_mod.refuse_or_exit(e)
    run = start(s, _group_and_verdict(s))
    atexit.register(_at_exit, run)
    _one_line_failures(run)
    return run


def _config(config: Config | str | os.PathLike | None, run_dir: str | os.PathLike | None,
            overrides: list[str], chosen: ExitPolicy) -> tuple[Config, Path]:
    """The config and the run directory ``init()`` was given, or the launcher's; a finished run
    leaves here (exit 0)."""
    cfg = config if isinstance(config, Config) else config_mod.load(
        str(config) if config else os.environ.get(rundir.CONFIG_ENV), overrides)
    if chosen.prelaunch:   # a user's own program: nobody named it in its config
        cfg = _name_own_program(cfg)
    script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] not in ("", "-c") else ""
    rd = Path(run_dir or os.environ.get(rundir.RUN_DIR_ENV) or cfg.run_dir or f"runs/{script or 'hpc_train'}")
    if os.environ.get(rundir.RESUME_ENV, "latest") != "none":
        _leave_if_finished(rd, cfg, chosen.advice)
    return cfg, rd


def _group_and_verdict(s: session_mod.Session) -> torch.device:
    """The process group, then rank 0's claim and pre-launch, its verdict on every rank: a
    refused run exits 2 on every rank together. Returns the rank's device."""
    import torch
    import torch.distributed as dist

    from hpc_train.node import group
    try:
        if s.policy.owns_group:
            device = group.init(s.env, s.cfg.dist)
        else:
            backend = dist.get_backend()
            device = (torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(backend)
                      else torch.device("cpu"))
        problem = _prepare(s)
        refused = _rank0_refuses(problem, s.env.world_size, device)
        if not refused:   # after the verdict: a refused start replaces nothing of the holder's
            session_mod.register(s)
    except BaseException:
        end(s, failed=True)   # no Run to close: the lock, and the stop signals' handlers given back
        raise
    if refused:
        if problem:
            print(problem, file=sys.stderr)
        end(s, failed=False)
        if s.policy.owns_group:
            group.shutdown(True)
        raise SystemExit(2)
    return device


def _leave_if_finished(rd: Path, cfg: Config, advice: Advice) -> None:
    """A finished run exits 0 on every rank before anything is written, its log included: nothing is left to run."""
    done = session_mod.finished_result(rd)   # the same record on every rank: all leave, with no collective
    if done is None:
        return
    from hpc_train.ckpt import compat
    compat.check_finished(rd, cfg, advice)   # other arguments: refused, not ignored
    from hpc_train.node import environment
    if environment.current().rank == 0:
        print(session_mod.finished_line(rd, done, f"{rundir.RESUME_ENV}=none"), file=sys.stderr)
    raise SystemExit(0)


def _rank0_refuses(problem: str | None, world_size: int, device: torch.device) -> bool:
    """Rank 0's verdict, on every rank: one that left alone would hang its peers' first collective until the timeout."""
    import torch
    import torch.distributed as dist
    if world_size > 1 and dist.is_initialized():
        t = torch.tensor([float(problem is not None)], device=device)
        dist.broadcast(t, 0)
        return t.item() > 0
    return problem is not None


def _name_own_program(cfg: Config) -> Config:
    """A user's own program (``python main.py``, ``torchrun main.py``) names itself in its config,
    as ``run --script main.py`` does (``train.script``, ``train.args``): its run directory is then
    one run whichever way the file is started, and a finished run tells other arguments from its
    own. Interactive code (a notebook, ``python -c``) has no file of its own and names none."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if cfg.train.script or cfg.train.fn or not main_file or not Path(main_file).is_file():
        return cfg
    import dataclasses
    train = dataclasses.replace(cfg.train, script=str(Path(main_file).absolute()), args=list(sys.argv[1:]))
    return dataclasses.replace(cfg, train=train)   # a Config the caller passed in stays as it was


def _one_line_failures(run: Run) -> None:
    """An uncaught exception that ends a user's program is this rank's failure, recorded where a
    worker of hpc_train's launchers records its own: the rank's error file, its first line the
    cause and then the traceback, which ``status``, the launcher and the requeue hook read to
    name the culprit. A failure that is not a bug is said in one line instead of a traceback:

    * a :class:`~hpc_train.errors.RunFailure` (no checkpoint loads, training diverged, ...),
      whose message names the cause and the fix;
    * an error of a collective whose peer went away, naming the peer, not gloo's raw traceback:
      the rank that printed it is a victim, and the culprit is elsewhere.

    Any other exception (a bug in the user's code) keeps the traceback the program would print
    without hpc_train. A KeyboardInterrupt is no failure of the code: not recorded."""
    from hpc_train.errors import RunFailure, says_peer_lost
    from hpc_train.node import watchdog
    default = sys.excepthook

    def hook(kind, value, tb) -> None:
        one_line = True
        if isinstance(value, RunFailure):
            line = f"{type(value).__name__}: {value}"
        elif isinstance(value, RuntimeError) and says_peer_lost(str(value)):
            line = watchdog.lost_peer_line(str(value), run.run_dir, run.world_size, run.rank)
        elif isinstance(value, KeyboardInterrupt):
            default(kind, value, tb)
            return
        else:
            line, one_line = f"{kind.__name__}: {value}".splitlines()[0], False
        import traceback
        try:   # the traceback, for a bug report, where the worker keeps its own
            watchdog.write_error(run.run_dir, run.rank, f"{line}\n\n{''.join(traceback.format_exception(kind, value, tb))}")
        except OSError:
            pass
        if not one_line:
            default(kind, value, tb)
            return
        from hpc_train.records.ranks import node_name
        print(f"hpc_train: rank {run.rank} on {node_name()}: {line}", file=sys.stderr)
    sys.excepthook = hook


def _prepare(s: session_mod.Session) -> str | None:
    """Rank 0: the run directory's lock (unless a launcher of ours holds it) and, where the
    policy says ``prelaunch`` (outside hpc_train's launchers, which did the rest before starting
    any process), the pre-launch sequence (:func:`hpc_train.ckpt.prelaunch.prelaunch`: the config
    checked against the checkpoints', the resume plan, the config written); every rank
    registers once rank 0's verdict says the run goes on. After the group is up, so that a
    refusal reaches every rank at once: a rank left waiting in the rendezvous would hang until
    dist.init_timeout_s (a plain srun does not end it). Returns what refuses the run, or None.
    (A finished run was refused before: ``HPC_TRAIN_RESUME=none`` starts it over.)"""
    if not s.is_main:
        return None
    try:
        session_mod.claim(s)
        s.finished = None
        if s.policy.prelaunch:
            session_mod.prelaunch(s, os.environ.get(rundir.RESUME_ENV, "latest"))
    except UsageError as e:
        return f"hpc_train: {e}"
    return None


def how_to_resume(source: str) -> str:
    """How to resume this process's run, as the user started it."""
    if source == "torchrun":
        try:
            argv = [a.decode(errors="replace") for a in
                    Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0") if a]
            if len(argv) > 1 and Path(argv[0]).name.startswith("python") and argv[1].endswith("torchrun"):
                argv = argv[1:]   # the interpreter that a torchrun entry point runs under
            cmd = shlex.join(argv)
            if "torchrun" in cmd or "torch.distributed.run" in cmd:
                return cmd
        except OSError:
            pass
        return "the same torchrun command"
    if source == "slurm":
        return "the same srun command (or resubmit the job)"
    return shlex.join(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])


def end(s: session_mod.Session, run: Run | None = None, *, failed: bool, finished: bool = False,
        record_goodput: bool = False, error: BaseException | None = None) -> None:
    """The one teardown of a rank's life, on every path: the worker's trainer, code or supervised
    script, ``init()``'s exit, a refusal or a failure before any Run. As the entry point's policy
    says (:mod:`hpc_train.node.policy`), first what a late stop signal does: hpc_train's own
    process, its work done, keeps its handlers to its ``os._exit`` and takes no signal for a stop
    (``StopRequest.ignore_further``); a user's program that finished ignores SIGTERM and the
    job's signal while it exits (``StopRequest.leaving_finished``). Then the Run's close (saves
    waited for, reporters, loaders, the local tier, the process group this start-up made) and the
    run directory's release (lock, heartbeat, a stale stop record; a user's program gets its
    signal handlers back), or with no Run the session's alone (``finished``: this run just
    finished; ``record_goodput``: a supervised script's segment). Idempotent. ``failed``: the
    work raised, so peers may sit in a collective of it (no shutdown barrier), and nothing of a
    late signal changes. ``error``: what ended the work (a lost peer's first saves what this rank
    holds: :meth:`hpc_train.run.Run.save_at_failure`)."""
    if s.policy.own_process:
        if not failed:
            s.stop.ignore_further()
    elif run is not None and run.finished:
        s.stop.leaving_finished()   # a late SIGTERM must not make a finished run's exit 143
    if run is not None:
        run.close(failed=failed, error=error)
    else:
        s.close(finished=finished, record_goodput=record_goodput)


def release_group() -> None:
    """Before a normal exit of a worker's process: release the process group that the worker
    left for ``os._exit`` (the policy's ``leaving``; a no-op where torch was never imported)."""
    if "hpc_train.node.group" in sys.modules:
        sys.modules["hpc_train.node.group"].release()


def exit_done(code: int) -> None:
    """Leave after the work is done and every file is written: the process's exit handlers run
    (the user's included: a logger's atexit finish), then the interpreter's teardown is skipped.
    With torch, torch._dynamo (DDP imports it) and DCP loaded, that teardown alone takes about a
    second per process, and on a stop it sits between the committed checkpoint and the requeue.
    Returns instead (a normal, slower exit follows) while a non-daemon thread of the user's code
    still runs: a normal exit waits for it, and leaving now would cut it off."""
    import threading
    if any(t.is_alive() and not t.daemon and t is not threading.main_thread() for t in threading.enumerate()):
        release_group()   # the normal exit needs it released first
        return
    atexit._run_exitfuncs()   # what a normal exit runs first (logging.shutdown among them)
    exit_now(code)


def exit_now(code: int) -> None:
    """Leave at once, skipping interpreter teardown: after a failure, and after a stop in a user's
    program (``init()``'s exit, whose teardown is done).

    A rank whose peers sit in a collective can hang at exit inside the gloo group's destructor;
    it then never exits, so neither the local launcher nor ``srun --kill-on-bad-exit`` learns
    of the failure until the collective timeout. The error is already logged and written.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _at_exit(run: Run) -> None:
    """The exit of a process whose Run ``init()`` built: the one teardown, then, after a stop,
    a non-zero exit code, so a shell, torchrun and Slurm see that the run did not finish (a
    loop that ends with ``raise SystemExit`` or falls off the end would exit 0). A finished
    run's exit ignores SIGTERM and the job's signal (see ``StopRequest.leaving_finished``).

    Rank 0 says how to resume where the policy says ``resume_hint``: the user typed this
    process's command (``python train.py``, ``torchrun``, ``srun``). A script supervised by
    hpc_train's launchers did not: its own command line (``python -u train.py ...``) starts
    another run when followed, so only the launcher, which knows the command the user typed,
    says how to resume.

    Hazard: leaving through ``os._exit`` skips exit handlers registered before ``init()``;
    those registered after it (the user's, usually) have run already, and logging is flushed here."""
    failed = hasattr(sys, "last_value")   # set when an uncaught exception ends the interpreter
    try:
        end(run._session, run, failed=failed, error=getattr(sys, "last_value", None))
    finally:
        if run.stopped and not failed:
            if run.is_main and run._session.policy.resume_hint:
                print(f"hpc_train: stopped by {run.stop.name} at step {run.stop_step} "
                      f"({'checkpoint saved' if run.config.checkpoint.enabled else 'nothing saved: checkpoints are off'}); "
                      f"resume with: {how_to_resume(run.env.source)}", file=sys.stderr)
            exit_now(run.exit_code)
        elif run.finished and not failed and not run._session.policy.owns_group:
            # The program's own process group (a Trainer's, accelerate's) outlives the Run, and a
            # program that never destroys it leaves a live gloo group to the interpreter's
            # teardown, which can abort the finished process (SIGABRT, "terminate called without
            # an active exception"): a finished run looking crashed, and its launcher ending the
            # other ranks. Only exit handlers registered before init() run after this one.
            release_group()
