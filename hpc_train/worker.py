"""The on-node path: every task of every launcher ends here.

``run`` (local processes), ``submit`` (submitit's srun tasks) and the rendered sbatch script
(``srun python -m hpc_train worker ...``) all call :func:`run_worker`: environment from the
variables the launcher set -> process group -> trainer (or the user's function) -> teardown.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from hpc_train import config as config_mod
from hpc_train import environment
from hpc_train.config import Config
from hpc_train.errors import UsageError
from hpc_train.monitor import setup_logging

log = logging.getLogger("hpc_train")


def write_json_atomic(path: Path, obj: Any) -> None:
    config_mod.write_atomic(path, json.dumps(obj, indent=2, default=str))


def run_worker(cfg: Config | dict, run_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Run this process's share of the job; returns the run's result (same on every rank)."""
    if isinstance(cfg, dict):
        cfg = config_mod.from_dict(cfg)
    rd = Path(run_dir) if run_dir else cfg.resolved_run_dir()
    env = environment.current()
    setup_logging(env.rank, rd, cfg.log.level)
    try:
        return _run(cfg, env, rd)
    except BaseException as e:
        # A one-file summary the launcher shows when this rank dies (like torchelastic's error file).
        (rd / "logs").mkdir(parents=True, exist_ok=True)
        (rd / "logs" / f"rank-{env.rank}.error").write_text(
            f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}")
        if not isinstance(e, (KeyboardInterrupt, UsageError)):
            log.error("rank %d failed:\n%s", env.rank, traceback.format_exc())
        raise


def _address() -> str:
    """This host's address as the other nodes would reach it (for the log; never fatal)."""
    import socket
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "address unknown"


def _run(cfg: Config, env: environment.NodeEnv, rd: Path) -> dict[str, Any]:
    from hpc_train import distributed   # imports torch: only on the training path
    from hpc_train.preemption import StopRequest, stop_signals

    from hpc_train import resume as resume_mod
    if resume_mod.is_finished(rd):
        # A finished run never trains again, whether requeued or resubmitted.
        log.info("%s holds a finished run (result.json); not training again", rd)
        return json.loads((rd / "result.json").read_text())
    stop = StopRequest()
    stop.install(stop_signals(cfg.job.signal))
    log.info("on-node environment: source=%s rank %d/%d local %d/%d node %d/%d host %s (%s) pid %d job %s "
             "restart %d", env.source, env.rank, env.world_size, env.local_rank, env.local_world_size,
             env.node_rank, env.num_nodes, os.uname().nodename, _address(), os.getpid(), env.job_id,
             env.restart_count)
    device = distributed.init(env, cfg.dist)
    trainer = None
    clean = False
    try:
        if cfg.train.fn:
            from hpc_train.plugins import resolve
            result = resolve(cfg.train.fn, "train.fn")(cfg, env, device) or {}
            if not isinstance(result, dict):
                result = {"result": result}
        else:
            from hpc_train.trainer import Trainer
            trainer = Trainer(cfg, env, device, rd, stop)
            _resume(trainer, cfg, env, rd)
            result = trainer.fit()
        result.update(world_size=env.world_size)
        if env.is_main:
            if result.get("stopped"):
                # Timeline of the stop, for `status` and benchmarks/preemption.py.
                result["stop_received_at"] = stop.received_at
                result["checkpoint_committed_at"] = time.time()   # the stop's save is blocking
                if env.job_id and not cfg.train.fn:
                    result["requeue"] = _request_requeue(cfg, env, rd, result, stop)
                    result["requeue_requested_at"] = time.time()
                write_json_atomic(rd / "stopped.json", result)
                saved = cfg.checkpoint.enabled and not cfg.train.fn
                log.info("%s by %s at step %d", "checkpoint saved" if saved else "stopped",
                         result.get("stop_signal"), result.get("steps", -1))
            else:
                write_json_atomic(rd / "result.json", result)
                if "test_accuracy" in result:
                    log.info("done: %d steps, %d epochs, test accuracy %.4f, final train loss %.4f, %.1fs",
                             result["steps"], result["epochs"], result["test_accuracy"], result["train_loss"],
                             result["wall_seconds"])
                (rd / "stopped.json").unlink(missing_ok=True)
                log.info("TensorBoard logs: tensorboard --logdir %s", rd / "tb")
        clean = True
        # The work is done: a stop signal now (the time limit's, a late preemption) must not
        # kill this process during teardown, where Python has restored default handlers.
        stop.ignore_further()
        return result
    finally:
        del trainer  # the DDP reducer must go before the group (see distributed.shutdown)
        distributed.shutdown(clean)


def _request_requeue(cfg: Config, env: environment.NodeEnv, rd: Path, result: dict, stop) -> str:
    """Rank 0, after the stop's checkpoint: classify the cause and ask the batch shell to requeue."""
    from hpc_train import requeue
    end = requeue.job_end_time(env.job_id)
    cause = requeue.classify(result.get("stop_signal") or "", end, stop.received_at or time.time(),
                             cfg.job.signal_lead)
    msg = requeue.request(rd, cause, env.requeue_target or "", env.restart_count, requeue.budgets_of(cfg),
                          int(result.get("steps", 0)))
    log.warning("%s (signal %s, %.1fs after it)", msg, result.get("stop_signal"),
                time.time() - (stop.received_at or time.time()))
    return msg


def run_callable(fn, args: tuple, kwargs: dict, run_dir: str | os.PathLike) -> Any:
    """A user's callable on every task, with the process group set up and torn down around it."""
    from hpc_train import distributed
    from hpc_train.config import DistSection

    env = environment.current()
    rd = Path(run_dir)
    setup_logging(env.rank, rd)
    distributed.init(env, DistSection())
    clean = False
    try:
        out = fn(*args, **kwargs)
        clean = True
        return out
    finally:
        distributed.shutdown(clean)


def _resume(trainer, cfg: Config, env: environment.NodeEnv, rd: Path) -> None:
    """Attach the checkpointer and load what :func:`hpc_train.resume.plan` picks.

    Every rank decides on its own from the same files, then the choice is checked to be the
    same everywhere (a rank that saw another directory state would otherwise load other weights).
    """
    import torch
    import torch.distributed as dist

    from hpc_train import checkpoint, resume
    spec = os.environ.get("HPC_TRAIN_RESUME", "latest")
    plan = resume.plan(rd, "latest" if spec == "none" else spec, cfg, warn=log.warning)
    step = plan.source.step if plan.source else -1
    if dist.is_initialized() and env.world_size > 1:
        t = torch.tensor([step, -step], dtype=torch.float64, device=trainer.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if int(t[0]) != step or int(-t[1]) != step:
            raise checkpoint.CheckpointError(f"ranks disagree on the checkpoint to resume (rank {env.rank}: "
                                             f"step {step}); is {rd} on a filesystem every node sees?")
    error: Exception | None = None
    if plan.source is not None:
        try:
            checkpoint.load(trainer, plan.source.path, env.world_size)
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            error = e
        if dist.is_initialized() and env.world_size > 1:
            # A rank that fails alone (e.g. its own rank-R.pt is bad) would sit in the shutdown barrier
            # while the others wait in their next collective: a hang until dist.timeout_s. Fail together.
            failed = torch.tensor([float(error is not None)], device=trainer.device)
            dist.all_reduce(failed)
            if error is None and failed.item() > 0:
                error = checkpoint.CheckpointError(f"another rank could not load {plan.source.path}; "
                                                   f"see {rd / 'logs'}")
        if error is not None:
            raise error
    if cfg.checkpoint.enabled:
        trainer.checkpointer = checkpoint.Checkpointer(cfg, rd, env.rank, env.world_size)


def main(argv: list[str] | None = None) -> int:
    """``python -m hpc_train worker --config RUN_DIR/config.yaml``: one task's entry point."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m hpc_train worker")
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir")
    args = ap.parse_args(argv)
    cfg = config_mod.load(args.config)
    try:
        run_worker(cfg, args.run_dir or os.path.dirname(os.path.abspath(args.config)))
    except BaseException as e:  # noqa: BLE001 - the error is already in the rank's log and error file
        exit_now(130 if isinstance(e, KeyboardInterrupt) else 2 if isinstance(e, UsageError) else 1)
    return 0   # a stop is a clean exit too: the launcher or the batch shell decides what follows


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
