"""The on-node path: every task of every launcher ends here.

``run`` (local processes), ``submit`` (submitit's srun tasks) and the rendered sbatch script
(``srun python -m hpc_train worker ...``) all call :func:`run_worker`: environment from the
variables the launcher set -> stop signals -> process group -> the process's ``Run`` -> the
target (the built-in trainer, ``train.fn``, a submitted callable) -> teardown. A script
(``train.script``) runs in a child process under :mod:`hpc_train.launch.supervise` instead, which
needs neither torch nor a process group of its own.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_train import config as config_mod
from hpc_train import rundir
from hpc_train import goodput, lifecycle, threads
from hpc_train.launch import standby
from hpc_train.node import environment, session, watchdog
from hpc_train.node.policy import Entry, policy
from hpc_train.config import Config
from hpc_train.errors import RunDirBusy, RunFailure, ScriptFailed, UsageError, says_peer_lost

log = logging.getLogger("hpc_train")


def run_worker(cfg: Config | dict, run_dir: str | os.PathLike | None = None,
               target: Callable[..., Any] | None = None, args: tuple = (), kwargs: dict | None = None,
               prepared: bool = True) -> Any:
    """Run this process's share of the job: the built-in trainer, ``train.fn``, ``target(*args,
    **kwargs)`` or, under supervision, ``train.script``. Returns the trainer's result dict (the
    same on every rank) or the callable's return value. The caller ends the process through
    :func:`hpc_train.lifecycle.exit_done` or ``exit_now`` (the policy's ``leaving``: the process group is left
    for that exit to release, see :func:`hpc_train.node.group.shutdown`). ``prepared``: a
    launcher prepared the run directory; else (a plain sbatch script's job step, whose config
    travels in the script) rank 0 runs the pre-launch sequence before anything trains."""
    cfg = config_mod.from_dict(cfg) if isinstance(cfg, dict) else cfg
    # Started ahead of its step (job.standby): imports, then waits for the go.
    waited = standby.await_go(cfg) if standby.active() else None
    entry = _entry(cfg, target)
    chosen = policy(entry) if prepared else policy(entry).unprepared()
    s = session.begin(cfg, Path(run_dir) if run_dir else cfg.resolved_run_dir(), chosen)
    if waited is not None:
        log.info("rank %d: this step's process was a standby, started %.1f s before it (job.standby)",
                 s.env.rank, waited)
    failed = True
    try:
        out = _live(s, entry, target, args, kwargs or {})
        failed = False
        return out
    except BaseException as e:
        _report(e, s)
        raise
    finally:
        lifecycle.end(s, failed=failed)   # the session alone: a no-op where the Run's end closed it


def _entry(cfg: Config, target: Callable[..., Any] | None) -> Entry:
    if target is None and cfg.train.script:
        return Entry.SUPERVISOR
    return Entry.CODE if target is not None or cfg.train.fn else Entry.TRAINER


def _live(s: session.Session, entry: Entry, target, args: tuple, kwargs: dict) -> Any:
    """Claim -> prepare -> (group ->) register -> run, on the session ``s`` (:mod:`hpc_train.node.session`)."""
    cfg, env, rd = s.cfg, s.env, s.run_dir
    session.claim(s)
    if s.finished is not None:
        # A finished run never trains again, whether requeued or resubmitted.
        log.info("%s holds a finished run (result.json); not training again", rd)
        return s.finished
    # Before anything of the run imports torch (a script child reads it at its own import).
    n = threads.apply(os.environ, cfg.dist.threads_per_rank)
    if n is not None and env.rank == 0:
        log.info("%s", threads.line(n))
    if s.policy.prelaunch and env.rank == 0:
        from hpc_train.trainer.signature import expected
        session.prelaunch(s, os.environ.get(rundir.RESUME_ENV, "latest"),
                          expected(cfg) if entry is Entry.TRAINER else None)
    if entry is Entry.SUPERVISOR:
        from hpc_train.launch.supervise import supervise
        session.register(s)   # no group to wait for: a refused rank 0 never got here
        out = supervise(cfg.train, cfg.job, cfg.dist.timeout_s, env, rd, s.stop, s.beats)
        lifecycle.end(s, failed=False, finished=not out.get("stopped"), record_goodput=True)
        return out
    goodput.pause_gc()   # until start-up is over: Run.restore, or just before the user's code
    out = _run(s, target, args, kwargs)
    watchdog.say_ended(rd, env.rank, "returned")   # an exit 0 without it is an early leave (the launcher)
    return out


def _report(e: BaseException, s: session.Session) -> None:
    """A failure of this rank: its one line on the console, and the rank's error file (the line,
    then the traceback for a bug report) that the launcher shows when this rank dies, like
    torchelastic's error file. A supervised script's failure wrote its own."""
    rd, env = s.run_dir, s.env
    if isinstance(e, ScriptFailed):    # its error file is written, naming rank and host
        return
    if isinstance(e, RunDirBusy):      # the directory is the holder's: its error file is not ours
        log.error("refused: %s", e)
        return
    line = _one_line(e, rd, env)
    try:
        (rd / rundir.LOGS).mkdir(parents=True, exist_ok=True)
        watchdog.write_error(rd, env.rank, f"{line or f'{type(e).__name__}: {e}'}\n\n{traceback.format_exc()}")
    except OSError:
        pass    # the disk that failed may be this one; the console line below still says it
    if line is not None:
        log.error("rank %d: %s", env.rank, line)
    elif isinstance(e, UsageError):    # refused (a busy run directory, a changed model): one line
        log.error("refused: %s", e)
    elif not isinstance(e, KeyboardInterrupt):
        log.error("rank %d failed:\n%s", env.rank, traceback.format_exc())


def _one_line(e: BaseException, rd: Path, env: environment.NodeEnv) -> str | None:
    """The one line that says it all, for failures that are not bugs; None for anything else."""
    if isinstance(e, OSError):      # a full or read-only disk: which file, and what to do
        from hpc_train.errors import os_error_line
        return f"{type(e).__name__}: {os_error_line(e)}"
    if isinstance(e, RunFailure):   # names the cause and the fix; anything else keeps its traceback
        return f"{type(e).__name__}: {e}"
    if isinstance(e, MemoryError):
        from hpc_train.node.watchdog import memory_limits
        limits = memory_limits()
        return f"MemoryError: out of memory{f' (the memory limit in force is {limits})' if limits else ''}"
    if _peer_lost(e):
        # A victim: another rank died or froze, and this one's collective failed. Not a bug here.
        return watchdog.lost_peer_line(str(e), rd, env.world_size, env.rank)
    return None


def _peer_lost(e: BaseException) -> bool:
    """A collective failed because a peer went away (gloo's and the store's wording)."""
    return isinstance(e, RuntimeError) and says_peer_lost(str(e))


def _call_fn(fn: Callable[..., Any], cfg: Config, env: environment.NodeEnv, device: Any) -> Any:
    """``train.fn``: ``fn()`` when it takes no arguments (it calls ``hpc_train.init()``), else the
    original ``fn(cfg, env, device)``."""
    import inspect
    try:
        params = inspect.signature(fn).parameters.values()
        required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        required = [None]
    return fn() if not required else fn(cfg, env, device)


def _run(s: session.Session, target, args: tuple, kwargs: dict) -> Any:
    from hpc_train import lifecycle
    from hpc_train.node import group   # imports torch: only on the training path
    from hpc_train.node.stops import record_stop

    cfg, env, rd, stop = s.cfg, s.env, s.run_dir, s.stop
    goodput.mark("torch")
    environment.log_placement(env)
    device = group.init(env, cfg.dist)
    goodput.mark("group")
    session.register(s)   # the group is up: rank 0 was not refused
    run = lifecycle.start(s, device)
    clean = interrupted = False
    error: BaseException | None = None
    try:
        out, interrupted = _run_code(s, run, device, target, args, kwargs)
        if stop.requested and not run.stopped and not run.finished:
            record_stop(env, rd, stop, step=None, checkpoint=False)
        elif not run.stopped and not run.finished:
            # The code returned without run.finish(): it is done all the same.
            run.finish(out if isinstance(out, dict) else {"result": out})
        clean = True
        return out
    except BaseException as e:
        error = e
        raise
    finally:
        goodput.resume_gc()   # a no-op once start-up ended; after an early return or a failure, not left off
        try:
            # The work done, a stop signal now (the time limit's, a late preemption) must not
            # kill this process during teardown, where finish() gave the default handlers back.
            lifecycle.end(s, run, failed=not clean or interrupted, error=error)
        finally:
            lifecycle.forget()


def _run_code(s: session.Session, run: Any, device: Any, target, args: tuple, kwargs: dict) -> tuple[Any, bool]:
    """The user's code (a callable, ``train.fn``) or the built-in trainer: (what it returned,
    whether a stop ended it at an arbitrary point). Interrupted, this rank may have left while a
    peer sits in a collective of that code, so the group's sequence of collectives no longer
    matches across ranks and the shutdown barrier must not run (it would pair with the peer's
    collective: a mismatched reduction, or a hang until dist.timeout_s)."""
    from hpc_train.node.stops import StopRun
    cfg, env, rd, stop = s.cfg, s.env, s.run_dir, s.stop
    trainer = None
    try:
        if target is not None:
            goodput.resume_gc()   # the user's code runs with the collector as they expect
            return target(*args, **kwargs), False
        if cfg.train.fn:
            from hpc_train.plugins import resolve
            fn = resolve(cfg.train.fn, "train.fn")
            goodput.resume_gc()
            return _call_fn(fn, cfg, env, device), False
        from hpc_train.trainer.loop import Trainer
        stop.listening = True   # the built-in loop acts on stops at its next step_end
        trainer = Trainer(cfg, run)
        return trainer.fit(), False
    except SystemExit as e:
        # The code ended itself: after a stop with run.exit_code (the README's loop), or with
        # 0 when done. Either is this run's normal end; any other code is a failure.
        if not (run.stopped or e.code in (0, None)):
            raise
        return None, False
    except StopRun:
        watchdog.say_left_for_stop(rd, env.rank)
        log.warning("stopped by %s before the code called run.step_end: nothing was saved by hpc_train", stop.name)
        return None, True
    except Exception as e:
        # The same stop ended a peer first, while this rank's code waited in a collective
        # with it: the peer's exit is this stop's doing, not a failure. A peer that died
        # (then srun's SIGTERM to the rest) left no word of a stop: that stays a failure.
        if not (stop.requested and not run.stopped and _peer_lost(e)
                and watchdog.peer_left_for_stop(rd, env.world_size, env.rank)):
            raise
        watchdog.say_left_for_stop(rd, env.rank)
        log.warning("stopped by %s before the code called run.step_end (a peer left for the same stop "
                    "while this rank waited in a collective): nothing was saved by hpc_train", stop.name)
        return None, True
    finally:
        del trainer  # the DDP reducer must go before the group (see hpc_train.node.group.shutdown)


def main(argv: list[str] | None = None) -> int:
    """``python -m hpc_train worker --config RUN_DIR/config.yaml``: one task's entry point."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m hpc_train worker", allow_abbrev=False)   # as the CLI's
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir")
    args = ap.parse_args(argv)
    cfg = config_mod.load(args.config)
    rd = Path(args.run_dir or os.path.dirname(os.path.abspath(args.config)))
    # A config from outside the run directory (a plain sbatch script's own copy) is not the
    # run's yet: rank 0 checks it against the checkpoints' and writes it.
    outside = Path(args.config).absolute() != (rd / rundir.CONFIG).absolute()
    try:
        run_worker(cfg, rd, prepared=not outside)
    except BaseException as e:  # noqa: BLE001 - the error is already in the rank's log and error file
        lifecycle.exit_now(130 if isinstance(e, KeyboardInterrupt) else 2 if isinstance(e, UsageError) else 1)
    lifecycle.exit_done(0)   # a stop is a clean exit too: the launcher or the batch shell decides what follows
    return 0


if __name__ == "__main__":
    sys.exit(main())
