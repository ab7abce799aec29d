"""The on-node path: every task of every launcher ends here.

``run`` (local processes), ``submit`` (submitit's srun tasks) and the rendered sbatch script
(``srun python -m hpc_train worker ...``) all call :func:`run_worker`: environment from the
variables the launcher set -> stop signals -> process group -> the process's ``Run`` -> the
target (the built-in trainer, ``train.fn``, a submitted callable) -> teardown. A script
(``train.script``) runs in a child process under :mod:`hpc_train.supervise` instead, which
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
from hpc_train.node import environment
from hpc_train.config import Config
from hpc_train.errors import RunFailure, ScriptFailed, UsageError, says_peer_lost
from hpc_train.logs import setup_logging

log = logging.getLogger("hpc_train")


def run_worker(cfg: Config | dict, run_dir: str | os.PathLike | None = None,
               target: Callable[..., Any] | None = None, args: tuple = (), kwargs: dict | None = None,
               leaving: bool = False) -> Any:
    """Run this process's share of the job: the built-in trainer, ``train.fn``, ``target(*args,
    **kwargs)`` or, under supervision, ``train.script``. Returns the trainer's result dict (the
    same on every rank) or the callable's return value. ``leaving``: the caller ends the process
    through :func:`exit_done` or :func:`exit_now`, so the process group is left for the exit to
    release (see :func:`hpc_train.node.group.shutdown`)."""
    if isinstance(cfg, dict):
        cfg = config_mod.from_dict(cfg)
    rd = Path(run_dir) if run_dir else cfg.resolved_run_dir()
    from hpc_train import goodput
    goodput.mark("worker")
    from hpc_train.node.stops import StopRequest, stop_signals
    # Stop signals first: one that arrives during start-up is then recorded, not fatal.
    stop = StopRequest()
    stop.install(stop_signals(cfg.job.signal), escalate=not (cfg.train.script and target is None))
    env = environment.current()
    setup_logging(env.rank, rd, cfg.log.level)
    # torchrun's variables on every launch path (a torchrun-style script or fn reads them).
    os.environ.update(environment.torchrun_vars(env))
    os.environ[rundir.RUN_DIR_ENV] = str(rd.absolute())
    os.environ[rundir.CONFIG_ENV] = str((rd / rundir.CONFIG).absolute())
    _quiet_thread_os_errors()
    from hpc_train.node import watchdog
    watchdog.enable_stack_dumps(rundir.rank_log(rd, env.rank))
    heartbeat = watchdog.Heartbeat(rd, env.rank).start()
    lock = None
    try:
        if env.rank == 0 and os.environ.get("HPC_TRAIN_LAUNCHER") != "local":
            # The local launcher holds the run directory's lock itself; a job's rank 0 holds it here.
            lock = rundir.RunDirLock(rd, f"Slurm job {env.job_id}" if env.job_id else "a training run").acquire()
            step = os.environ.get("SLURM_STEP_ID")
            if env.job_id and step is not None and env.world_size > 1:
                watchdog.watch_slurm_job(rd, env.world_size, cfg.dist.timeout_s, f"{env.job_id}.{step}")
        if cfg.train.script and target is None:
            from hpc_train.launch.supervise import supervise
            return supervise(cfg, env, rd, stop)
        goodput.pause_gc()   # until start-up is over: Run.restore, or just before the user's code
        return _run(cfg, env, rd, stop, target, args, kwargs or {}, leaving)
    except BaseException as e:
        if isinstance(e, ScriptFailed):    # its error file is written, naming rank and host
            raise
        line = _one_line(e)
        # A one-file summary the launcher shows when this rank dies (like torchelastic's error file):
        # the line, then the traceback for a bug report.
        try:
            (rd / "logs").mkdir(parents=True, exist_ok=True)
            rundir.write_atomic(rundir.rank_error(rd, env.rank), f"{line or f'{type(e).__name__}: {e}'}\n\n"
                                                                 f"{traceback.format_exc()}")
        except OSError:
            pass    # the disk that failed may be this one; the console line below still says it
        if line is not None:
            log.error("rank %d: %s", env.rank, line)
        elif not isinstance(e, (KeyboardInterrupt, UsageError)):
            log.error("rank %d failed:\n%s", env.rank, traceback.format_exc())
        raise
    finally:
        heartbeat.stop()
        if lock is not None:
            lock.release()


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


def _one_line(e: BaseException) -> str | None:
    """The one line that says it all, for failures that are not bugs; None for anything else."""
    if isinstance(e, OSError):      # a full or read-only disk: which file, and what to do
        from hpc_train.errors import os_error_line
        return f"{type(e).__name__}: {os_error_line(e)}"
    if isinstance(e, RunFailure):   # names the cause and the fix; anything else keeps its traceback
        return f"{type(e).__name__}: {e}"
    text = str(e)
    if _peer_lost(e):
        # A victim: another rank died or froze, and this one's collective failed. Not a bug here.
        first = next((ln.strip() for ln in text.splitlines() if says_peer_lost(ln)), text)
        return f"lost a peer ({first[:300]})"
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


def _run(cfg: Config, env: environment.NodeEnv, rd: Path, stop: Any, target, args: tuple, kwargs: dict,
         leaving: bool) -> Any:
    from hpc_train.node import group as distributed   # imports torch: only on the training path
    from hpc_train import goodput
    from hpc_train.ckpt import store as resume_mod
    from hpc_train import run as run_mod
    from hpc_train.node import watchdog
    from hpc_train.node.stops import StopRun, record_stop

    if resume_mod.is_finished(rd):
        # A finished run never trains again, whether requeued or resubmitted.
        log.info("%s holds a finished run (result.json); not training again", rd)
        return rundir.read_json(rd / rundir.RESULT)[0] or {}   # any bytes there: no traceback
    goodput.mark("torch")
    environment.log_placement(env)
    device = distributed.init(env, cfg.dist)
    goodput.mark("group")
    run = run_mod.start(cfg, env, rd, stop, device)
    trainer = None
    clean = False
    # Set when a stop ended the user's code at an arbitrary point: this rank may have left while a
    # peer sits in a collective of that code, so the group's sequence of collectives no longer
    # matches across ranks and the shutdown barrier must not run (it would pair with the peer's
    # collective: a mismatched reduction, or a hang until dist.timeout_s).
    interrupted = False
    out: Any = None
    try:
        try:
            if target is not None:
                goodput.resume_gc()   # the user's code runs with the collector as they expect
                out = target(*args, **kwargs)
            elif cfg.train.fn:
                from hpc_train.plugins import resolve
                fn = resolve(cfg.train.fn, "train.fn")
                goodput.resume_gc()
                out = _call_fn(fn, cfg, env, device)
            else:
                from hpc_train.trainer.loop import Trainer
                stop.listening = True   # the built-in loop acts on stops at its next step_end
                trainer = Trainer(cfg, run)
                out = trainer.fit()
        except StopRun:
            interrupted = True
            watchdog.say_left_for_stop(rd, env.rank)
            log.warning("stopped by %s before the code called run.step_end: nothing was saved by hpc_train",
                        stop.name)
        except Exception as e:
            # The same stop ended a peer first, while this rank's code waited in a collective
            # with it: the peer's exit is this stop's doing, not a failure. A peer that died
            # (then srun's SIGTERM to the rest) left no word of a stop: that stays a failure.
            if not (stop.requested and not run.stopped and _peer_lost(e)
                    and watchdog.peer_left_for_stop(rd, env.world_size, env.rank)):
                raise
            interrupted = True
            watchdog.say_left_for_stop(rd, env.rank)
            log.warning("stopped by %s before the code called run.step_end (a peer left for the same stop "
                        "while this rank waited in a collective): nothing was saved by hpc_train", stop.name)
        if stop.requested and not run.stopped and not run.finished:
            record_stop(cfg.job, env, rd, stop, step=None, checkpoint=False)
        elif not run.stopped and not run.finished:
            # The code returned without run.finish(): it is done all the same.
            run.finish(out if isinstance(out, dict) else {"result": out})
        clean = True
        # The work is done: a stop signal now (the time limit's, a late preemption) must not
        # kill this process during teardown, where Python has restored default handlers.
        stop.ignore_further()
        return out
    finally:
        goodput.resume_gc()   # a no-op once start-up ended; after an early return or a failure, not left off
        del trainer  # the DDP reducer must go before the group (see distributed.shutdown)
        try:
            run._close()
        except BaseException:   # noqa: BLE001 - after a failure, a pending save's error must not hide it
            if clean:
                raise
        run_mod._current = None
        distributed.shutdown(clean and not interrupted, destroy=not leaving)


def main(argv: list[str] | None = None) -> int:
    """``python -m hpc_train worker --config RUN_DIR/config.yaml``: one task's entry point."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m hpc_train worker")
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir")
    args = ap.parse_args(argv)
    cfg = config_mod.load(args.config)
    try:
        run_worker(cfg, args.run_dir or os.path.dirname(os.path.abspath(args.config)), leaving=True)
    except BaseException as e:  # noqa: BLE001 - the error is already in the rank's log and error file
        exit_now(130 if isinstance(e, KeyboardInterrupt) else 2 if isinstance(e, UsageError) else 1)
    exit_done(0)   # a stop is a clean exit too: the launcher or the batch shell decides what follows
    return 0


def release_group() -> None:
    """Before a normal exit of a process whose worker ran with ``leaving=True``: release the
    process group it left for ``os._exit`` (a no-op where torch was never imported)."""
    if "hpc_train.node.group" in sys.modules:
        sys.modules["hpc_train.node.group"].release()


def exit_done(code: int) -> None:
    """Leave after the work is done and every file is written: the process's exit handlers run
    (the user's included: a logger's atexit finish), then the interpreter's teardown is skipped.
    With torch, torch._dynamo (DDP imports it) and DCP loaded, that teardown alone takes 1.2-1.3 s
    per process here, and on a stop it sits between the committed checkpoint and the requeue.
    Returns instead (a normal, slower exit follows) while a non-daemon thread of the user's code
    still runs: a normal exit waits for it, and leaving now would cut it off."""
    import atexit
    import threading
    if any(t.is_alive() and not t.daemon and t is not threading.main_thread() for t in threading.enumerate()):
        release_group()   # the normal exit needs it released first
        return
    atexit._run_exitfuncs()   # what a normal exit runs first (logging.shutdown among them)
    exit_now(code)


def exit_now(code: int) -> None:
    """Leave at once after a failure, skipping interpreter teardown.

    A rank whose peers sit in a collective can hang at exit inside the gloo group's destructor;
    it then never exits, so neither the local launcher nor ``srun --kill-on-bad-exit`` learns
    of the failure until the collective timeout. The error is already logged and written.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
