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
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpc_train import config_local, rundir
from hpc_train.ckpt.state import kinds_of
from hpc_train.config import Config
from hpc_train.errors import EXIT_STOPPED, UsageError, says_peer_lost
from hpc_train.node import guard
from hpc_train.node.environment import NodeEnv
from hpc_train.node.session import Session
from hpc_train.node.stops import Agreement, StopRequest, Votes, agree_signal, record_stop
from hpc_train.records import keeper as keeper_record, result as result_record, stop as stop_record
from hpc_train.records.keeper import Keeper

log = logging.getLogger("hpc_train")


class Run:
    """One process's handle on the job. Build it with :func:`hpc_train.init`."""

    def __init__(self, session: Session, device: torch.device) -> None:
        cfg, env = session.cfg, session.env
        self.config: Config = cfg
        self.env: NodeEnv = env
        self.run_dir: Path = Path(session.run_dir)
        self.device: torch.device = device
        self.stop: StopRequest = session.stop
        self.rank, self.local_rank, self.world_size = env.rank, env.local_rank, env.world_size
        self.local_world_size, self.node_rank = env.local_world_size, env.node_rank
        self.is_main: bool = env.rank == 0
        self._multi = dist.is_initialized() and env.world_size > 1
        self._agreement = Agreement(self._multi, lambda: self._votes().encode())
        from hpc_train.node.straggler import Stragglers
        self._stragglers = Stragglers.of(cfg.dist, cfg.job.replace_stragglers, cfg.checkpoint.enabled, env, self._multi,
                                         self.run_dir)   # named, and swapped (job.*)
        self._agreement.on_last_bucket = self._stragglers.enter
        self._wrapped = None     # strategies.Wrapped, once wrap() ran
        self._replicated: nn.Module | None = None
        self._scaler: torch.amp.GradScaler | None = None
        self._ckpt = None
        from hpc_train.node.report import Reporter
        self._report = Reporter(cfg.log, self.run_dir, self.is_main)
        self._local = None   # the node-local tier (hpc_train.ckpt.local.tier), once asked for
        self._keeping = None   # each rank's own state kept at a peer every step (hpc_train.ckpt.local.keep)
        self._no_keeping = ""   # why there is none, said at a failure
        self._moved = False      # an optimizer stepped since the last step_end: its state is not that step's
        self._hooked: set[int] = set()   # the optimizers whose steps set _moved
        self._failing = threading.Event()   # the save at a failure began: no optimizer step from now on
        self._keeper: Keeper | None = None   # the user's framework keeps the checkpoints (kept_by)
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
        self._result: dict[str, Any] = {}
        self._prev_step: int | None = None   # the step the last step_end saw
        self._session = session   # the run directory's side of the lifecycle (hpc_train.node.session)
        self._closed = False
        from hpc_train.node import hang, watchdog
        self._progress, self._watches = hang.watch(cfg.dist, session)
        watchdog.before_ending(self.save_at_failure)

    # -- what the loop asks ----------------------------------------------------------------
    def long_phase(self, name: str = "evaluation") -> contextlib.AbstractContextManager:
        """``with run.long_phase("evaluation"):`` code between steps that takes much longer than
        a step, so the hang watch gives it the long limit (see :mod:`hpc_train.node.hang`)."""
        return self._progress.marked(name)

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
            self._local_tier()   # built here, not in the hook that reads its timer (file-system probes)
            self._agreement.attach(ddp)
            self._replicated = ddp.module
        return ddp

    def wrap(self, model: nn.Module, stages: Sequence[nn.Module] | None = None) -> nn.Module:
        """Move ``model`` to this rank's device and wrap it as ``dist.strategy`` says (see
        :mod:`hpc_train.node.strategies`; DDP by default, when there is more than one rank). Under
        ``split``, ``stages`` are the model's parts in the order they apply (default: the
        model's ``stages()``). Every strategy keeps the per-step stop agreement."""
        from hpc_train.node import strategies
        model = model.to(self.device)
        self._local_tier()   # built before any strategy's hook reads its timer (see _votes)
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
            self._kinds_cache = (keys, kinds_of(state))
        elif isinstance(state["step"], bool) or not isinstance(state["step"], int):
            kinds_of(state)   # raises the clear error
        return self._kinds_cache[1]

    def checkpoints_kept_by(self, keeper: Keeper) -> None:
        """The code's framework keeps this run's checkpoints (a Hugging Face Trainer's
        ``output_dir``: :mod:`hpc_train.huggingface`): hpc_train saves none of its own, in either
        tier, so that no restart can load a step ahead of them (the framework's resume would then
        go back below it), and ``step_end`` still agrees on every stop. Rank 0 records the keeper
        for ``status`` and ``ckpt list``. Call before the first ``step_end``."""
        if self._ckpt is not None or self._local is not None or self._prev_step is not None:
            raise UsageError("run.checkpoints_kept_by: call it before the first step_end or restore "
                             "(hpc_train has started checkpointing this run)")
        self._keeper = keeper
        if self.is_main:
            keeper_record.write(self.run_dir, keeper)

    def _checkpointer(self):
        if self._ckpt is None and self.config.checkpoint.enabled and self._keeper is None:
            from hpc_train.ckpt.shared.save import Checkpointer
            self._ckpt = Checkpointer(self.config.checkpoint, self.run_dir, self.rank, self.world_size,
                                      self.checkpoint_record, timeout_s=self.config.dist.timeout_s)
            self._ckpt.resumed_from = self._resumed_from
        return self._ckpt

    def _local_tier(self):
        if self._local is None and config_local.enabled(self.config.checkpoint) and self._keeper is None:
            from hpc_train.ckpt.local.tier import LocalTier
            self._local = LocalTier(self.config.checkpoint, self.config.dist, self.run_dir, self.rank, self.world_size,
                                    self.checkpoint_record, env=self.env)
            self._keeping, self._no_keeping = self._keeping_for(self._local)
            if self._keeping is not None:
                self._agreement.on_sync = self._syncing
        return self._local

    def _keeping_for(self, local):
        """Each rank's own state kept at a peer (:mod:`hpc_train.ckpt.local.keep`), for the
        survivors' save at a failure, or (None, why not). The same on every rank: config and the
        job's shape only (the exchange is a collective)."""
        ckpt, strategy = self.config.checkpoint, self.config.dist.strategy
        if not self._multi:
            return None, ""
        if not ckpt.local_on_failure:
            return None, ""
        if strategy not in ("ddp", "allreduce", "dp"):
            return None, (f"dist.strategy={strategy} " + ("keeps a different model on each rank" if strategy == "none"
                          else "shards the state: each rank holds only its own part"))
        if local.peers is None and self.env.num_nodes > 1:
            return None, "the node-local tier's copies on a peer node are off (checkpoint.local_replicas=0)"
        from hpc_train.ckpt.local.keep import Keeping
        return Keeping(self.rank, self.world_size, local.peers.ring if local.peers else None,
                       self.config.dist.timeout_s), ""

    def restore(self, state: dict[str, Any]) -> int:
        """Load the checkpoint chosen for this run into ``state`` in place (plain values are
        replaced in the dict); returns the restored step, 0 on a fresh run. Every rank takes
        rank 0's choice, and falls back to an older checkpoint together if any rank cannot
        load it (see :func:`hpc_train.ckpt.restore.restore`)."""
        from hpc_train import goodput
        from hpc_train.ckpt import restore
        from hpc_train.ckpt import store
        kinds = self._kinds(state)
        self.stop.listening = True   # code that restores will call step_end: a stop waits for it
        t_load = time.time()
        before = self._progress.enter("restore")
        goodput.mark("restore")
        source = restore.restore(state, self.run_dir, rank=self.rank, world_size=self.world_size,
                                     device=self.device, multi=self._multi, kinds=kinds,
                                     spec=os.environ.get(rundir.RESUME_ENV, "latest"),
                                     requeued=self.env.restart_count > 0,
                                     advice=self._session.policy.advice,
                                     local=self._local_tier())
        self._start_step = state["step"] if source is not None else 0
        self._progress.leave(before)
        goodput.resume_gc()   # start-up ends here (a worker turned the collector off for it)
        ledger = self._report.ledger()
        if ledger is not None:
            ledger.restored(self._start_step, time.time() - t_load if source is not None else 0.0)
        own = source is not None and (source.record.get("tier") == "local"
                                      or source.path.parent.resolve() == store.ckpt_root(self.run_dir).resolve())
        self._resumed_from = source.step if own else -1
        if self._ckpt is not None:
            self._ckpt.last_step = self._start_step
            self._ckpt.resumed_from = self._resumed_from
        return self._start_step

    @property
    def checkpoint_stats(self) -> list[dict[str, Any]]:
        """One record per checkpoint saved by this process (time, bytes, blocking): for reports."""
        return list(self._ckpt.stats) if self._ckpt is not None else []

    def _votes(self) -> Votes:
        """This rank's votes, read by the step's agreement (under DDP in the backward's bucket-0
        hook, before step_end): reads timers only, builds nothing. A rank past the agreement has
        every local save begun earlier written, copies included (``settle`` waits for it)."""
        if self._local is not None:
            self._local.settle()
        return Votes(stop=self.stop.requested, timed=self._ckpt is not None and self._ckpt.due_by_time(),
                     local_timed=self._local is not None and self._local.due_by_time())

    def sync_buffers(self) -> None:
        """Give every rank rank 0's buffers (BatchNorm statistics) before a save or an eval
        (see :func:`hpc_train.node.guard.sync_buffers`)."""
        guard.sync_buffers(self._replicated if self._multi else None)

    def step_end(self, state: dict[str, Any]) -> bool:
        """Call once per optimizer step, after ``state["step"] += 1``. Every rank agrees on a
        stop and on a timed save; saves when due. Returns True on a stop, once the checkpoint
        is committed and, under Slurm, the requeue requested: leave the loop."""
        kinds = self._kinds(state)
        step = self._check_step(state)
        agreed = self._agree(step)
        self._last_state, self._prev_step = state, step
        self._check_sums(step)
        ledger = self._report.ledger()
        if ledger is not None:
            ledger.step(step)
        self._shared_save(state, step, kinds, agreed)
        self._local_save(state, step, kinds, agreed)
        if not agreed.stop:
            self._keep(state, step, kinds)
        if agreed.stop:
            self._on_stop(step)
        self._straggler_report(step, agreed.stop)
        return agreed.stop

    def _check_step(self, state: Mapping[str, Any]) -> int:
        step = state["step"]
        prev = self._start_step if self._prev_step is None else self._prev_step
        if step < 0 or step < prev:
            # A checkpoint is named by its step: one below 0 would be invisible to resume, list,
            # verify and pruning, and one below an earlier step would shadow newer work.
            raise UsageError(f"run.step_end: state['step'] is {step}, "
                             + ("below 0" if step < 0 else f"below the previous step {prev}")
                             + "; it counts the optimizer steps done and only goes up (state['step'] += 1 per step)")
        return step

    def _agree(self, step: int) -> Votes:
        """The step's one collective (or its ride on DDP's bucket 0): every rank's votes, and the
        sums the loop staged (``step_sums``)."""
        self.stop.listening = True
        self._local_tier()   # without a hook, the votes are read in collect(), just below
        self._stragglers.arrived()
        agreed, self.step_sums = Votes.decode(self._agreement.collect(self.device).tolist())
        self._progress.stepped(step)
        return agreed

    def _check_sums(self, step: int) -> None:
        if not all(math.isfinite(v) for v in self.step_sums):
            # Every rank sees the same sums, so every rank raises here, before any save.
            guard.diverged(step, f"the values summed with the step are {self.step_sums} (the loss first)", self._ckpt)

    def _shared_save(self, state: Mapping[str, Any], step: int, kinds: dict[str, str], agreed: Votes) -> None:
        ckpt = self._checkpointer()
        if ckpt is None:
            return
        if self.is_main:
            ckpt.poll()
        if not ckpt.due(step, force=agreed.stop, timed=agreed.timed):
            return
        before = self._progress.enter("checkpoint save")
        t0 = time.perf_counter()
        self.sync_buffers()
        guard.check_weights(state, kinds, self._multi, step, self._ckpt)
        self._report.checkpointed(step)
        ckpt.save(state, step, blocking=agreed.stop, kinds=kinds)
        ledger = self._report.ledger()
        if ledger is not None:
            self._report.saved(ledger, step, time.perf_counter() - t0)
        self._progress.leave(before)

    def _local_save(self, state: Mapping[str, Any], step: int, kinds: dict[str, str], agreed: Votes) -> None:
        local = self._local
        if local is not None and not agreed.stop and local.due(step, agreed.local_timed):
            self._report.checkpointed(step)
            local.save(state, step, kinds)

    # -- a failure costs one step ------------------------------------------------------------
    def _keep(self, state: Mapping[str, Any], step: int, kinds: dict[str, str]) -> None:
        """After the agreement: this rank's own state of ``step``, to its keeper in the background;
        from here, an optimizer step marks the modules and optimizers as no longer this step's."""
        if self._keeping is None:
            return
        if self._failing.is_set():
            self._hold()
        from hpc_train.ckpt.local.keep import take
        for k, kind in kinds.items():
            if kind == "optimizer" and id(state[k]) not in self._hooked:
                self._hooked.add(id(state[k]))
                state[k].register_step_pre_hook(self._stepping)
        if not self._hooked:
            self._no_keeping, self._keeping = "no optimizer in state marks its steps", None
            return
        self._keeping.start()
        self._keeping.after_step(state, kinds, step)
        self._keeping.mine = take(state, kinds, self.rank, step, self._keeping.sent(step))
        self._moved = False

    def _syncing(self) -> None:
        """Where the step's gradient averaging begins (the agreement's hook): this rank's own
        state goes out before the all-reduce, so the kept rank's is here by the time the
        optimizer step waits for it (:meth:`hpc_train.ckpt.local.keep.Keeping.send`)."""
        if (now := self._unstepped()) is not None:
            keeping, state, step = now
            keeping.send(state, self._kinds(state), step)

    def _unstepped(self) -> tuple[Any, Mapping[str, Any], int] | None:
        """(the keeping, the state, the step in flight) while no optimizer step of it has run,
        once a step has ended; else None."""
        if self._moved or self._keeping is None or self._last_state is None or self._prev_step is None:
            return None
        return self._keeping, self._last_state, self._prev_step + 1

    def _stepping(self, *_: Any) -> None:
        """An optimizer's step pre-hook: the first of a step waits for the kept rank's state
        (sending this rank's own first when no averaging hook did:
        :meth:`hpc_train.ckpt.local.keep.Keeping.before_step`)."""
        if self._failing.is_set():
            self._hold()
        if (now := self._unstepped()) is not None:
            keeping, state, step = now
            keeping.before_step(state, self._kinds(state), step)
        self._moved = True

    @staticmethod
    def _hold() -> None:
        """The training thread, once a watcher's save at a failure began (the collective it
        waited in may complete if the frozen peer is continued): no step from here; the watcher
        ends the process."""
        while True:
            time.sleep(60)

    def save_at_failure(self, why: str) -> None:
        """A peer failed (``why``: what happened, in a few words): save the step this rank holds, and the step of the
        rank whose own state it keeps, to the node-local tier, so that the restart redoes at most
        the step in flight (see :meth:`hpc_train.ckpt.local.tier.LocalTier.save_at_failure`).
        At most once, within ``keep.SAVE_LIMIT_S``; never raises: the failure is what the process
        reports. Called by the one teardown (:meth:`close`) and by the watchers that end a hung step."""
        if self._failing.is_set():
            return
        self._failing.set()
        if not self._multi or not self.config.checkpoint.local_on_failure:
            return
        keeping, state, local = self._keeping, self._last_state, self._local
        if keeping is None or keeping.mine is None or state is None or local is None or self._moved:
            log.warning("nothing saved at the failure: %s", self._not_saved())
            return
        from hpc_train.ckpt.common import why as why_line
        from hpc_train.ckpt.local.keep import SAVE_LIMIT_S
        step, mine = keeping.mine.step, keeping.mine
        held, not_held = keeping.held(mine)
        t0 = time.perf_counter()
        done = _within(SAVE_LIMIT_S, lambda: local.save_at_failure(state, self._kinds(state), mine, held))
        if done is None:
            log.warning("the save at the failure (step %d) did not finish within %.0fs; the restart loads the "
                        "newest step saved for every rank", step, SAVE_LIMIT_S)
        elif isinstance(done, Exception):
            log.warning("the save at the failure (step %d) failed: %s; the restart loads the newest step saved for "
                        "every rank", step, why_line(done))
        else:
            kept = f", and rank {keeping.source}'s from its state kept here" if held is not None else \
                f" ({not_held})"
            log.warning("%s: saved step %d to the node-local tier in %.2fs: rank %d's item%s",
                        why, step, time.perf_counter() - t0, self.rank, kept)

    def _not_saved(self) -> str:
        """Why a failure's save has nothing to save: the line's reason, and what the restart loads."""
        keeping = self._keeping
        if keeping is None or keeping.mine is None or self._last_state is None or self._local is None:
            not_kept = (self._no_keeping or ("the node-local tier is off" if self._local is None and self._keeper is None
                        else "a framework keeps this run's checkpoints" if self._keeper is not None
                        else "no step had ended"))
            return f"{not_kept}; the restart loads the tiers' newest step"
        return (f"rank {self.rank} stepped its optimizer after step {keeping.mine.step}, so it no longer holds that "
                f"step; the restart loads the newest step saved for every rank")

    def _straggler_report(self, step: int, stopping: bool) -> None:
        spread = self._stragglers.left(step, self.device, None if stopping else self.stop)
        if spread is not None:
            self._report.aside(step, spread, self.total_steps, self._start_step)

    def _on_stop(self, step: int) -> None:
        self.stopped, self.stop_step = True, step
        agree_signal(self.stop, self._multi, self.device)
        if self._ckpt is not None:
            self._ckpt.close()
        self._report.flush()     # the loop may still log this step; closed at exit
        saved = self._ckpt is not None or self._keeper is not None   # a keeper saves this step next
        record_stop(self.env, self.run_dir, self.stop, step=step, checkpoint=saved)
        if self.is_main:
            kept = f"; {self._keeper.framework} saves its checkpoint of it" if self._keeper is not None else ""
            log.info("%s by %s at step %d%s", "checkpoint saved" if self._ckpt is not None else "stopped",
                     self.stop.name, step, kept)

    # -- reporting ---------------------------------------------------------------------------
    def log(self, step: int, *, epoch: int | None = None, console: bool | None = None, **scalars: float) -> None:
        """Rank 0: ``metrics.jsonl`` (with ``step``), TensorBoard, and a console line every
        ``train.log_every`` steps. Other ranks: nothing. Keys ``eval_*`` go to TensorBoard's
        ``eval/`` group, ``loss``/``acc`` to ``train/``."""
        if not self.is_main:
            return
        if console is None:
            console = step % self.config.train.log_every == 0
        self._report.record(step, scalars, self.total_steps, self._start_step, epoch=epoch, console=console)

    def _close(self, failed: bool = False) -> None:
        """Wait for saves, close the reporters and the loaders' worker processes."""
        if self._keeping is not None:   # after a failure its peer may never send again
            self._keeping.close(wait=not failed)
        if self._ckpt is not None:
            self._ckpt.close()
        self._report.close()
        if self._local is not None:   # nothing there serves again after a finish or a stop
            self._local.close(remove=self.finished or self.stopped)
        if self._last_state is not None:
            for v in self._last_state.values():
                if getattr(v, "hpc_train_per_rank", False) and hasattr(v, "close"):
                    v.close()
            self._last_state = None

    def close(self, failed: bool = False, error: BaseException | None = None) -> None:
        """The one teardown, on every path: wait for saves, close the reporters and loaders,
        release the run directory (lock, heartbeat; a finished run keeps no stale stop record;
        in a user's program, the signal handlers found at ``init()`` given back) and the process
        group this Run's start-up made. Idempotent. ``failed``: the code raised, so peers may sit
        in a collective of it: no shutdown barrier. ``with hpc_train.init() as run:`` calls it;
        so does the exit of any process that called ``init()``. ``error``: what ended the code;
        a collective whose peer went away first saves what this rank holds (:meth:`save_at_failure`)."""
        if self._closed:
            return
        self._closed = True
        self._watches.stop()
        from hpc_train.node import watchdog
        watchdog.before_ending(None)
        if failed and isinstance(error, RuntimeError) and says_peer_lost(str(error)):
            self.save_at_failure("a peer left a collective")   # the error file names which, and how
        try:
            self._close(failed)
        except BaseException:   # noqa: BLE001 - after a failure, a pending save's error must not hide it
            if not failed:
                raise
        finally:
            try:
                self._session.close(finished=self.finished)
            finally:
                policy = self._session.policy
                if policy.owns_group:   # this Run's lifecycle set up the process group: it ends it,
                    from hpc_train.node import group   # or leaves it to the process's os._exit
                    group.shutdown(not failed, destroy=not policy.leaving)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.close(failed=exc_type is not None and not issubclass(exc_type, SystemExit), error=exc)

    @property
    def exit_code(self) -> int:
        """What the process should exit with: 0 once finished, 3 (``errors.EXIT_STOPPED``) after a
        stop (so a shell, torchrun and Slurm see that the run did not finish), else 1. Outside
        hpc_train's launchers the process exits with it after a stop by itself (see
        :mod:`hpc_train.lifecycle`); under them the launcher or the batch shell decides."""
        return 0 if self.finished else EXIT_STOPPED if self.stopped else 1

    def finish(self, result: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The run is done: save a final checkpoint of the last state given to ``step_end`` (if
        that step is not saved yet), write ``result.json`` (rank 0), and return the result. Never
        marks a stopped run finished; a second call changes nothing and says so. Then a signal is
        no stop, and the handlers found at ``init()`` are back (the code after it can be ended)."""
        out = dict(result or {})
        if self.finished:
            log.warning("finish() called again: the run finished already and result.json is written once; ignored")
            return dict(self._result)
        if self.stopped:
            log.warning("finish() after a stop: the run is not finished; it resumes when run again")
            return out
        self.stop.listening = True   # a step boundary too: a stop now waits for the final save
        ckpt = self._checkpointer()
        if ckpt is not None and self._last_state is not None and ckpt.due(self._last_state["step"], force=True):
            self.sync_buffers()
            ckpt.save(self._last_state, self._last_state["step"], blocking=True, kinds=self._kinds(self._last_state))
        if self._last_state is not None:
            out.setdefault("steps", self._last_state["step"])
        out.setdefault("world_size", self.world_size)
        self._close()
        self._agreement.all_reached(self.device)   # a peer that left fails this: no result.json then
        if self.is_main:
            result_record.write(self.run_dir, out)
            stop_record.remove(self.run_dir)   # now: a signal may end the code after finish()
            if self.config.log.tensorboard and (self.run_dir / rundir.TB).is_dir():
                log.info("TensorBoard logs: tensorboard --logdir %s", self.run_dir / rundir.TB)
        self.finished, self._result = True, out
        self.stop.finished()   # a later signal is no stop; the program's handlers are back
        return out


def _within(limit_s: float, call: Callable[[], Any]) -> Any:
    """``call()`` on a daemon thread, waited for at most ``limit_s``: what it returned, the
    exception it raised, or None when it had not finished (the process's exit ends it)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except Exception as e:  # noqa: BLE001 - handed to the caller, which says it
            out.append(e)
    thread = threading.Thread(target=run, name="hpc_train-save-at-failure", daemon=True)
    thread.start()
    thread.join(limit_s)
    return out[0] if out else None
