"""The public ``Run``: what a user's own loop, a script, a callable and the built-in trainer hold.

::

    run = hpc_train.init()
    state = {"model": model, "optim": optimizer, "step": 0}
    run.restore(state)                       # newest complete checkpoint of run.run_dir, in place
    while state["step"] < total:
        ...                                  # the user's forward, backward, optimizer step
        state["step"] += 1
        run.log(state["step"], loss=loss.item())
        if run.step_end(state):              # every rank agrees; saves when due; True on a stop
            break
    run.finish({"loss": loss.item()})        # result.json; never after a stop

``init()`` works under every launcher (``hpc_train run/submit/sbatch``, torchrun, a plain
``srun``) and outside any (one process, defaults). Under hpc_train's own launchers the worker
builds the Run before the user's code starts, and ``init()`` returns that one.

A stop (Ctrl-C on ``run``, SIGTERM, the job's ``--signal``) is only recorded by the handler.
``step_end`` folds it into one collective per step, which under DDP rides on the gradient
all-reduce (:meth:`Run.watch`), so every rank stops at the same step, saves, and returns True.
Code that never calls ``step_end`` is ended by the stop instead (see
:class:`hpc_train.node.stops.StopRun`), and the run is not marked finished.
"""

from __future__ import annotations

import logging
import contextlib
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpc_train import config as config_mod
from hpc_train import rundir
from hpc_train.node import environment
from hpc_train.ckpt import state as state_mod
from hpc_train.config import Config
from hpc_train.node.environment import NodeEnv
from hpc_train.node.stops import Agreement, StopRequest, record_stop, stop_signals

from hpc_train.errors import NonFiniteError

log = logging.getLogger("hpc_train")
_current: Run | None = None


class Run:
    """One process's handle on the job. Build it with :func:`hpc_train.init`."""

    def __init__(self, cfg: Config, env: NodeEnv, run_dir: Path, device: torch.device, stop: StopRequest) -> None:
        self.config: Config = cfg
        self.env: NodeEnv = env
        self.run_dir: Path = Path(run_dir)
        self.device: torch.device = device
        self.stop = stop
        self.rank, self.local_rank, self.world_size = env.rank, env.local_rank, env.world_size
        self.local_world_size, self.node_rank = env.local_world_size, env.node_rank
        self.is_main: bool = env.rank == 0
        self._multi = dist.is_initialized() and env.world_size > 1
        self._agreement = Agreement(self._multi, self._flags)
        self._wrapped = None     # strategies.Wrapped, once wrap() ran
        self._replicated: nn.Module | None = None
        self._scaler: torch.amp.GradScaler | None = None
        self._ckpt = None
        self._monitor = None
        self._start_step = 0
        self._resumed_from: int | None = None   # see Checkpointer.resumed_from; None: no restore
        self._last_state: Mapping[str, Any] | None = None
        self._kinds_cache: tuple[tuple[str, ...], dict[str, str]] | None = None
        self.checkpoint_record: dict[str, Any] = {"config_hash": cfg.digest()}   # extra commit.json fields
        self.step_sums: list[float] = []      # the values staged with sum_with_step, summed over ranks
        self.total_steps: int | None = cfg.train.max_steps or None   # for progress and ETA; a loop may set it
        self.stopped = False
        self.finished = False
        self.stop_step: int | None = None
        self._ledger_obj = None   # rank 0's goodput ledger (see hpc_train.goodput), built at first use

    # -- what the loop asks ----------------------------------------------------------------
    @property
    def stop_requested(self) -> bool:
        """This process was asked to stop (the agreed decision is what step_end returns)."""
        return self.stop.requested

    def request_stop(self) -> None:
        """Ask every rank to stop at the next step boundary, as a stop signal would."""
        self.stop.request()

    def watch(self, ddp: nn.Module) -> nn.Module:
        """Let the per-step agreement ride on this DDP module's gradient all-reduce."""
        from torch.nn.parallel import DistributedDataParallel as DDP
        if isinstance(ddp, DDP):
            self._agreement.attach(ddp)
            self._replicated = ddp.module
        return ddp

    def wrap(self, model: nn.Module, stages: Sequence[nn.Module] | None = None) -> nn.Module:
        """Move ``model`` to this rank's device and wrap it as ``dist.strategy`` says (see
        :mod:`hpc_train.strategies`; DDP by default, when there is more than one rank). Under
        ``split``, ``stages`` are the model's parts in the order they apply (default: the
        model's ``stages()``). Every strategy keeps the per-step stop agreement."""
        from hpc_train.node import strategies
        model = model.to(self.device)
        self._wrapped = strategies.wrap(model, self.config.dist.strategy, self.device, multi=self._multi,
                                        local_rank=self.local_rank, local_world_size=self.local_world_size,
                                        agreement=self._agreement, stages=stages)
        # Its buffers are replicas (every strategy but none): rank 0's are synced before saves.
        self._replicated = model if self.config.dist.strategy != "none" else None
        return self._wrapped.net

    def no_sync(self) -> contextlib.AbstractContextManager:
        """A context for the micro-batches of a gradient-accumulation cycle but the last: the
        wrapped model skips the gradient averaging (DDP's ``no_sync`` for every strategy)."""
        return self._wrapped.no_sync() if self._wrapped is not None else contextlib.nullcontext()

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's autocast context for ``train.precision`` (a no-op for fp32)."""
        from hpc_train.node import precision
        return precision.autocast(self.config.train.precision, self.device)

    @property
    def scaler(self) -> torch.amp.GradScaler:
        """The run's GradScaler: enabled for ``train.precision=fp16`` (put it in ``state`` so its
        scale is checkpointed), a pass-through otherwise."""
        if self._scaler is None:
            from hpc_train.node import precision
            self._scaler = precision.scaler(self.config.train.precision, self.device)
        return self._scaler

    def loader(self, dataset: Any, batch_size: int, shuffle: bool = True, *, drop_last: bool = True,
               num_workers: int = 0, seed: int | None = None, **kwargs: Any):
        """This rank's shard of ``dataset``, resumable mid-epoch; each ``iter()`` is one epoch.
        Put it in ``state`` and a restore continues with exactly the unseen batches."""
        from hpc_train.node.loader import ShardedLoader
        return ShardedLoader(dataset, batch_size, rank=self.rank, world_size=self.world_size,
                             seed=self.config.seed if seed is None else seed, shuffle=shuffle, drop_last=drop_last,
                             num_workers=num_workers, **kwargs)

    def sum_with_step(self, values: torch.Tensor) -> None:
        """Values (a 1-D tensor) to sum over ranks with this step's agreement, at no extra
        collective under a watched DDP module: stage them before the step's last backward, and
        read ``run.step_sums`` after ``step_end``."""
        self._agreement.stage(values.detach().flatten())

    # -- checkpoints ------------------------------------------------------------------------
    def _kinds(self, state: Mapping[str, Any]) -> dict[str, str]:
        keys = tuple(state)
        if self._kinds_cache is None or self._kinds_cache[0] != keys:
            self._kinds_cache = (keys, state_mod.kinds(state))
        elif isinstance(state["step"], bool) or not isinstance(state["step"], int):
            state_mod.kinds(state)   # raises the clear error
        return self._kinds_cache[1]

    def _checkpointer(self):
        if self._ckpt is None and self.config.checkpoint.enabled:
            from hpc_train.ckpt.checkpointer import Checkpointer
            self._ckpt = Checkpointer(self.config.checkpoint, self.run_dir, self.rank, self.world_size,
                                      self.checkpoint_record, timeout_s=self.config.dist.timeout_s)
            self._ckpt.resumed_from = self._resumed_from
        return self._ckpt

    def restore(self, state: dict[str, Any]) -> int:
        """Load the checkpoint chosen for this run into ``state`` in place (plain values are
        replaced in the dict); returns the restored step, 0 on a fresh run.

        Rank 0 chooses (sizes and checksums: it reads the candidate whole) and the other ranks
        take its choice, checking only that the directory is complete by sizes: every rank
        re-reading every file would multiply the I/O by the world size. If the chosen checkpoint
        fails to load on any rank, every rank moves on together to the next older one that
        rank 0 verifies, until one loads or none is left."""
        from hpc_train import goodput
        from hpc_train.ckpt import checkpointer as checkpoint
        from hpc_train.ckpt import store as resume
        kinds = self._kinds(state)
        self.stop.listening = True   # code that restores will call step_end: a stop waits for it
        t_load = time.time()
        goodput.mark("restore")
        spec = os.environ.get("HPC_TRAIN_RESUME", "latest")
        source: resume.CkptInfo | None = None
        plan_error: Exception | None = None
        if self.is_main:
            try:
                source = resume.plan(self.run_dir, "latest" if spec == "none" else spec, None, warn=log.warning,
                                     requeued=self.env.restart_count > 0).source
            except Exception as e:  # noqa: BLE001 - raised by _agree_on, after the other ranks hear of it
                plan_error = e
        source = self._agree_on(source, plan_error)
        record: dict[str, Any] = {}
        while source is not None:
            error: BaseException | None = None
            try:
                record = checkpoint.load(state, source.path, self.rank, self.world_size, kinds)
            except Exception as e:  # noqa: BLE001 - handled below, on every rank together
                error = e
            if self._multi:
                # A rank that fails alone would sit in its next collective while the others wait
                # in theirs: a hang until dist.timeout_s. Fail (and fall back) together.
                failed = torch.tensor([float(error is not None)], device=self.device)
                dist.all_reduce(failed)
                if error is None and failed.item() > 0:
                    error = checkpoint.CheckpointError(f"another rank could not load {source.path}; "
                                                       f"see {self.run_dir / 'logs'}")
            if error is None:
                break
            older = None
            if self.is_main:
                log.warning("skipping checkpoint %s: it does not load: %s", source.path,
                            str(error).splitlines()[0] if str(error) else type(error).__name__)
                older = resume.older_candidate(source, warn=log.warning)
            older = self._agree_on(older)
            if older is None:
                # State may be partly overwritten by the failed load: never train on from it.
                raise error
            source = older
        if source is not None:
            saved = record.get("world_size")
            log.info("resumed from %s: step %d, saved at world size %s%s", source.path, state["step"], saved,
                     "" if saved == self.world_size else
                     f" (saved at world size {saved}, now {self.world_size}: resharded)")
        self._start_step = state["step"] if source is not None else 0
        goodput.resume_gc()   # start-up ends here (a worker turned the collector off for it)
        ledger = self._ledger()
        if ledger is not None:
            ledger.restored(self._start_step, time.time() - t_load if source is not None else 0.0)
        own = source is not None and source.path.parent.resolve() == resume.ckpt_root(self.run_dir).resolve()
        self._resumed_from = source.step if own else -1
        if self._ckpt is not None:
            self._ckpt.last_step = self._start_step
            self._ckpt.resumed_from = self._resumed_from
        return self._start_step

    _PATH_BYTES = 4096   # a checkpoint path, broadcast as a fixed-size byte tensor (any backend)

    def _agree_on(self, chosen, error: Exception | None = None):
        """Every rank takes rank 0's ``chosen`` (a CkptInfo or None). The others check only that
        the directory is complete by sizes, failing together if any rank cannot see it. ``error``:
        rank 0 could not choose; raised there, and every other rank stops too (rather than wait
        in the next collective)."""
        from hpc_train.ckpt import checkpointer as checkpoint
        from hpc_train.ckpt import store as resume
        if not self._multi:
            if error is not None:
                raise error
            return chosen
        failed = torch.tensor([float(error is not None)], device=self.device)
        dist.all_reduce(failed)
        if failed.item() > 0:
            if error is not None:
                raise error
            raise checkpoint.CheckpointError(f"rank 0 could not choose a checkpoint to resume; see {self.run_dir / 'logs'}")
        buf = torch.zeros(self._PATH_BYTES, dtype=torch.uint8, device=self.device)
        if self.is_main and chosen is not None:
            raw = str(chosen.path).encode()
            if len(raw) >= self._PATH_BYTES:
                raise checkpoint.CheckpointError(f"checkpoint path longer than {self._PATH_BYTES} bytes: {chosen.path}")
            buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        dist.broadcast(buf, 0)
        raw = bytes(buf.cpu().tolist()).rstrip(b"\0")
        info, problem = chosen, None
        if not self.is_main and raw:
            info = resume.inspect(Path(raw.decode()))
            problem = None if info.complete else info.problem
        bad = torch.tensor([float(problem is not None)], device=self.device)
        dist.all_reduce(bad)
        if bad.item() > 0:
            raise checkpoint.CheckpointError(
                f"rank 0 chose {raw.decode()} but " + (f"rank {self.rank} finds it incomplete ({problem})"
                                                       if problem else "another rank finds it incomplete") +
                f"; is {self.run_dir} on a filesystem every node sees?")
        return info if raw else None

    def _flags(self) -> list[float]:
        timed = self._ckpt is not None and self._ckpt.due_by_time()
        return [float(self.stop.requested), float(timed)]

    @torch.no_grad()
    def _sync_buffers(self) -> None:
        """Give every rank rank 0's buffers (BatchNorm statistics) before a save or an eval.

        DDP broadcasts rank 0's buffers at the start of every training forward, so rank 0's are
        the canonical ones; syncing makes the replicated tensors truly equal (DCP writes each
        one from whichever rank it picks). Training is unchanged by it (the exactness tests).
        """
        if self._multi and self._replicated is not None:
            for buf in self._replicated.buffers():
                dist.broadcast(buf, 0)

    def step_end(self, state: dict[str, Any]) -> bool:
        """Call once per optimizer step, after ``state["step"] += 1``. Every rank agrees on a
        stop and on a timed save; saves when due. Returns True on a stop, once the checkpoint
        is committed and, under Slurm, the requeue requested: leave the loop."""
        kinds = self._kinds(state)
        self.stop.listening = True
        sums = self._agreement.collect(self.device)
        stop, timed = bool(sums[0] > 0), bool(sums[1] > 0)
        self.step_sums = sums[2:].tolist()
        self._last_state = state
        step = state["step"]
        if not all(math.isfinite(v) for v in self.step_sums):
            # Every rank sees the same sums, so every rank raises here, before any save.
            self._diverged(step, f"the values summed with the step are {self.step_sums} (the loss first)")
        ledger = self._ledger()
        if ledger is not None:
            ledger.step(step)
        ckpt = self._checkpointer()
        if ckpt is not None:
            if self.is_main:
                ckpt.poll()
            if ckpt.due(step, force=stop, timed=timed):
                t0 = time.perf_counter()
                self._sync_buffers()
                self._check_weights(state, kinds, step)
                ckpt.save(state, step, blocking=stop, kinds=kinds)
                if ledger is not None:
                    self._saved(ledger, step, time.perf_counter() - t0)
        if stop:
            self._on_stop(step)
        return stop

    def _ledger(self):
        """Rank 0's goodput ledger; None on other ranks (see :mod:`hpc_train.goodput`)."""
        if self._ledger_obj is None and self.is_main:
            from hpc_train.goodput import Ledger
            self._ledger_obj = Ledger(self.run_dir)
        return self._ledger_obj

    def _saved(self, ledger, step: int, blocked_s: float) -> None:
        ledger.saved(blocked_s)
        if self._monitor is not None and self.config.log.tensorboard:
            share = ledger.training_share()
            if share is not None:
                self._monitor.scalar("goodput/training", share, step)

    def _diverged(self, step: int, what: str) -> None:
        last = self._ckpt.last_step if self._ckpt is not None and self._ckpt.last_step >= 0 else None
        raise NonFiniteError(
            f"training diverged at step {step}: {what}, not finite on some rank; nothing was saved for this step"
            + (f" (the newest checkpoint is step {last})" if last is not None else "")
            + f". Lower optim.lr (now {self.config.optim.lr:g}), set optim.grad_clip, or check the data")

    @torch.no_grad()
    def _check_weights(self, state: Mapping[str, Any], kinds: dict[str, str], step: int) -> None:
        """Before a save: no NaN/inf weight is ever committed. One host sync per save (saves are
        rare), agreed over ranks so that sharded models decide together."""
        params = [p for k, kind in kinds.items() if kind == "module" for p in state[k].parameters()]
        if not params:
            return
        # FSDP parameters are DTensors: check this rank's shard (the agreement below covers the rest).
        local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
        bad = torch.stack([p.detach().isfinite().all() for p in local]).all().logical_not().float().reshape(1)
        if self._multi:
            dist.all_reduce(bad)
        if bad.item() > 0:
            self._diverged(step, "a weight about to be saved is NaN or infinite")

    def _on_stop(self, step: int) -> None:
        self.stopped, self.stop_step = True, step
        if self._ckpt is not None:
            self._ckpt.close()
        if self._monitor is not None:   # the loop may still log this step; closed at exit
            self._monitor.flush()
        saved = self._ckpt is not None
        record_stop(self.config.job, self.env, self.run_dir, self.stop, step=step, checkpoint=saved)
        if self.is_main:
            log.info("%s by %s at step %d", "checkpoint saved" if saved else "stopped", self.stop.name, step)

    # -- reporting ---------------------------------------------------------------------------
    def _mon(self):
        if self._monitor is None:
            from hpc_train.node.monitor import Monitor
            c = self.config
            self._monitor = Monitor(self.run_dir, self.total_steps, self._start_step, enabled=self.is_main,
                                    tensorboard=c.log.tensorboard, progress=c.log.progress)
        return self._monitor

    def log(self, step: int, *, epoch: int | None = None, console: bool | None = None, **scalars: float) -> None:
        """Rank 0: ``metrics.jsonl`` (with ``step``), TensorBoard, and a console line every
        ``train.log_every`` steps. Other ranks: nothing. Keys ``eval_*`` go to TensorBoard's
        ``eval/`` group, ``loss``/``acc`` to ``train/``."""
        if not self.is_main:
            return
        if console is None:
            console = step % self.config.train.log_every == 0
        self._mon().record(step, scalars, epoch=epoch, console=console)

    def _close(self) -> None:
        """Wait for saves, close the reporters and the loaders' worker processes."""
        if self._ckpt is not None:
            self._ckpt.close()
        if self._ledger_obj is not None:
            self._ledger_obj.close()
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None
        if self._last_state is not None:
            for v in self._last_state.values():
                if getattr(v, "hpc_train_per_rank", False) and hasattr(v, "close"):
                    v.close()
            self._last_state = None

    def finish(self, result: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The run is done: save a final checkpoint of the last state given to ``step_end`` (if
        that step is not saved yet), write ``result.json`` (rank 0), and return the result. Never
        marks a stopped run finished."""
        out = dict(result or {})
        if self.stopped:
            log.warning("finish() after a stop: the run is not finished; it resumes when run again")
            return out
        ckpt = self._checkpointer()
        if ckpt is not None and self._last_state is not None and ckpt.due(self._last_state["step"], force=True):
            self._sync_buffers()
            ckpt.save(self._last_state, self._last_state["step"], blocking=True, kinds=self._kinds(self._last_state))
        if self._last_state is not None:
            out.setdefault("steps", self._last_state["step"])
        out.setdefault("world_size", self.world_size)
        self._close()
        if self.is_main:
            rundir.write_json(self.run_dir / rundir.RESULT, out)
            (self.run_dir / rundir.STOPPED).unlink(missing_ok=True)
            if self.config.log.tensorboard and (self.run_dir / "tb").is_dir():
                log.info("TensorBoard logs: tensorboard --logdir %s", self.run_dir / "tb")
        self.finished = True
        self.stop.ignore_further()
        return out


def current() -> Run | None:
    """The process's Run, if one was built."""
    return _current


def start(cfg: Config, env: NodeEnv, run_dir: Path, stop: StopRequest, device: torch.device) -> Run:
    """Make a Run the process's own (the worker does this before the user's code runs)."""
    global _current
    _current = Run(cfg, env, run_dir, device, stop)
    return _current


def init(config: Config | str | os.PathLike | None = None, *, run_dir: str | os.PathLike | None = None,
         overrides: list[str] = ()) -> Run:
    """The process's Run: environment, process group, device, rank-prefixed logging, stop
    signals. A second call returns the same Run.

    Under ``python -m hpc_train run/submit/sbatch`` the config and run directory come from the
    launcher. Elsewhere (torchrun, plain ``srun``, ``python train.py``): ``config`` (a Config or
    a YAML path, else defaults plus ``overrides``) and ``run_dir`` (else the config's, else
    ``runs/<script name>``). A process group the script already initialised is used as is.
    """
    global _current
    if _current is not None:
        return _current
    from hpc_train.node import group as distributed
    from hpc_train.logs import setup_logging
    env_cfg = os.environ.get(rundir.CONFIG_ENV)
    if isinstance(config, Config):
        cfg = config
    else:
        cfg = config_mod.load(str(config) if config else env_cfg, list(overrides))
    script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] not in ("", "-c") else ""
    rd = Path(run_dir or os.environ.get(rundir.RUN_DIR_ENV) or cfg.run_dir or f"runs/{script or 'hpc_train'}")
    env = environment.current()
    setup_logging(env.rank, rd, cfg.log.level)
    stop = StopRequest()
    stop.install(stop_signals(cfg.job.signal), escalate=True)
    if dist.is_initialized():
        # The script set up its own group (its own init_process_group): use it as it is.
        backend = dist.get_backend()
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(backend) else torch.device("cpu")
    else:
        device = distributed.init(env, cfg.dist)
        import atexit
        atexit.register(_teardown)
    return start(cfg, env, rd, stop, device)


def _teardown() -> None:
    """At exit of a process whose group ``init()`` created: let saves finish, then destroy the
    group (after a collection, so no DDP reducer outlives it: see hpc_train.node.group)."""
    import gc
    run = _current
    if run is not None:
        run._close()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
