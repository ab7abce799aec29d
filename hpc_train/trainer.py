"""The training loop: DDP over the tutorial models, with exact-resume bookkeeping.

One optimizer step is ``optim.grad_accum`` micro-batches; accumulation micro-batches run under
``no_sync()`` so DDP skips their all-reduce. After every step, one 4-float all-reduce carries
both the metrics (loss sum, correct, count) and the stop flag, so stopping costs nothing extra.

Order matters for a bitwise resume (measured, see the shared notes): the loader's state is
loaded before its iterator is created, and the per-rank RNG state is restored *after*
``iter(loader)``, which draws from the global RNG.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from hpc_train import data as data_mod
from hpc_train import models
from hpc_train.config import Config
from hpc_train.environment import NodeEnv
from hpc_train.monitor import Monitor
from hpc_train.preemption import Agreement, StopRequest

log = logging.getLogger("hpc_train")
# BENCHMARK ONLY (benchmarks/preemption.py): skip the per-step agreement to measure its cost.
# Without it a stop reaches only the signalled rank and metrics are rank-local: never use it to train.
_BENCH_NO_AGREEMENT = os.environ.get("HPC_TRAIN_BENCH_NO_AGREEMENT") == "1"


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint."""
    step: int = 0              # optimizer steps done
    epoch: int = 0             # current epoch
    batch_in_epoch: int = 0    # micro-batches consumed in the current epoch
    samples_seen: int = 0      # global samples, for resuming at another world size
    train_time_s: float = 0.0  # wall time spent in steps, across runs
    last_loss: float = float("nan")
    last_eval_acc: float = float("nan")
    last_eval_loss: float = float("nan")
    last_eval_step: int = -1
    finished: bool = False


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def lr_lambda(cfg: Config, total_steps: int):
    o = cfg.optim

    def f(step: int) -> float:
        if o.warmup_steps and step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        if o.schedule == "step":
            return o.gamma ** (step // o.step_size)
        if o.schedule == "cosine":
            span = max(1, total_steps - o.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - o.warmup_steps) / span)))
        return 1.0
    return f


class Trainer:
    def __init__(self, cfg: Config, env: NodeEnv, device: torch.device, run_dir: Path,
                 stop: StopRequest | None = None) -> None:
        self.cfg, self.env, self.device, self.run_dir = cfg, env, device, run_dir
        self.stop = stop or StopRequest()
        self.progress = Progress()
        # Same seed on every rank for the weights (DDP also broadcasts rank 0's), then a
        # per-rank stream for dropout and anything else random in the step.
        seed_everything(cfg.seed)
        self.model = models.build(cfg.model).to(device)
        self._multi = dist.is_initialized() and env.world_size > 1
        self.ddp = cfg.dist.strategy == "ddp" and self._multi
        self.net: nn.Module = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None) \
            if self.ddp else self.model
        train_ds, test_ds = data_mod.build(cfg.data, cfg.seed)
        d = cfg.data
        self.sampler = DistributedSampler(train_ds, num_replicas=env.world_size, rank=env.rank,
                                          shuffle=d.shuffle, seed=cfg.seed, drop_last=True)
        self.loader = data_mod.loader(train_ds, self.sampler, d.batch_size, d.num_workers,
                                      cfg.seed + env.rank, drop_last=True)
        # The held-out split, sharded without padding so every sample counts exactly once.
        shard = torch.utils.data.Subset(test_ds, range(env.rank, len(test_ds), env.world_size))
        self.test_loader = DataLoader(shard, batch_size=d.eval_batch_size, shuffle=False,
                                      generator=torch.Generator().manual_seed(0))
        self.batches_per_epoch = len(self.loader) - len(self.loader) % cfg.optim.grad_accum
        self.steps_per_epoch = self.batches_per_epoch // cfg.optim.grad_accum
        if self.steps_per_epoch == 0:
            from hpc_train.errors import UsageError
            raise UsageError(f"config: data.batch_size={d.batch_size} x world size {env.world_size} x "
                             f"optim.grad_accum={cfg.optim.grad_accum} is larger than the training set "
                             f"({len(train_ds)} samples): not one optimizer step fits in an epoch")
        t = cfg.train
        self.total_steps = t.max_steps or t.epochs * self.steps_per_epoch
        self.optimizer = self._make_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, self.total_steps))
        self.criterion = nn.CrossEntropyLoss()
        seed_everything(cfg.seed + 1000003 * (env.rank + 1))
        self._pending_rng: dict[str, Any] | None = None
        self._skip_batches = 0
        self.agreement = Agreement(self.net if self.ddp else None, self._multi, enabled=not _BENCH_NO_AGREEMENT)
        self.checkpointer = None  # set by hpc_train.worker when checkpoints are enabled
        # TEST HOOK (tests/test_checkpoint_exact.py), see fit(): HPC_TRAIN_TEST_STOP_AT_STEP="K" or "K:M".
        k, _, m = os.environ.get("HPC_TRAIN_TEST_STOP_AT_STEP", "").partition(":")
        self._test_stop = (int(k), int(m or cfg.optim.grad_accum)) if k and env.rank == 0 else None

    def _make_optimizer(self) -> torch.optim.Optimizer:
        o, params = self.cfg.optim, self.model.parameters()
        if o.name == "sgd":
            return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
        if o.name == "adamw":
            return torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay)
        return torch.optim.Adam(params, lr=o.lr, weight_decay=o.weight_decay)

    # -- exact-resume hooks (used by hpc_train.checkpoint) ----------------------------------
    def rank_state(self) -> dict[str, Any]:
        """What differs per rank: RNG and the loader's position."""
        st: dict[str, Any] = {"rng": rng_state()}
        if self.progress.batch_in_epoch:
            st["loader"] = self.loader.state_dict()
        return st

    def load_rank_state(self, st: dict[str, Any]) -> None:
        if "loader" in st:
            self.loader.load_state_dict(st["loader"])
        self._pending_rng = st["rng"]  # applied after iter(loader); see the module docstring

    # -- the loop ---------------------------------------------------------------------------
    def _micro_step(self, x: torch.Tensor, y: torch.Tensor, sync: bool, prior: torch.Tensor | None) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns the metrics summed over the cycle.

        On the cycle's last micro-batch the agreement is staged before the backward, whose
        gradient all-reduce carries it (see :class:`hpc_train.preemption.Agreement`).
        """
        ctx = self.net.no_sync() if (self.ddp and not sync) else contextlib.nullcontext()
        with ctx:
            out = self.net(x)
            loss = self.criterion(out, y)
            correct = (out.detach().argmax(1) == y).sum()
            stats = torch.stack([loss.detach() * y.numel(), correct.float(),
                                 torch.tensor(float(y.numel()), device=x.device)])
            if prior is not None:
                stats = prior + stats
            if sync:
                timed = self.checkpointer is not None and self.checkpointer.due_by_time()
                flags = torch.tensor([float(self.stop.requested), float(timed)], device=x.device)
                self.agreement.stage(torch.cat([flags, stats]))
            (loss / self.cfg.optim.grad_accum).backward()
        return stats

    def _agree(self, step: int, epoch: int, mon: Monitor) -> tuple[bool, bool]:
        """Read this step's agreement, log its metrics; return the (stop, timed save) decisions."""
        buf = self.agreement.collect()
        rec = {"step": step, "epoch": epoch, "lr": self.scheduler.get_last_lr()[0], "stop": bool(buf[0] > 0),
               "timed": bool(buf[1] > 0), "loss": float(buf[2] / buf[4]), "acc": float(buf[3] / buf[4]),
               "samples": int(buf[4])}
        cfg = self.cfg
        self.progress.last_loss = rec["loss"]
        self._window_samples += rec["samples"]
        log_now = rec["step"] % cfg.train.log_every == 0 or rec["step"] == self.total_steps
        scalars = {"loss": rec["loss"], "acc": rec["acc"], "lr": rec["lr"]}
        if log_now:
            now = time.perf_counter()
            scalars["samples_per_s"] = self._window_samples / max(now - self._window_t, 1e-9)
            self._window_t, self._window_samples = now, 0
        mon.step(rec["step"], rec["epoch"], scalars, log_now)
        return rec["stop"], rec["timed"]

    def reshard_progress(self, saved_world: int) -> None:
        """Resuming at another world size: continue after the same number of samples.

        DistributedSampler hands rank r the permutation's elements r, r+W, ...; after b batches
        per rank at world W the first b*B*W samples are consumed, at any W. So skipping
        b*W/W' batches at the new world W' continues with exactly the unseen samples.
        """
        p, b = self.progress, self.cfg.data.batch_size
        per_rank = p.batch_in_epoch * b * saved_world // (b * self.env.world_size)
        per_rank -= per_rank % self.cfg.optim.grad_accum
        p.batch_in_epoch = min(per_rank, self.batches_per_epoch)
        self._skip_batches = p.batch_in_epoch

    def fit(self) -> dict[str, Any]:
        cfg, p = self.cfg, self.progress
        world = self.env.world_size
        self.t_start = time.time()
        global_batch = cfg.data.batch_size * world * cfg.optim.grad_accum
        log.info("model %s (%.2fM parameters), data %s: %d train batches/rank/epoch, %d steps/epoch",
                 cfg.model.name, sum(t.numel() for t in self.model.parameters()) / 1e6, cfg.data.name,
                 len(self.loader), self.steps_per_epoch)
        log.info("effective batch size %d = %d per rank x %d ranks x %d accumulation", global_batch,
                 cfg.data.batch_size, world, cfg.optim.grad_accum)
        mon = Monitor(self.run_dir, self.total_steps, p.step, enabled=self.env.is_main,
                      tensorboard=cfg.log.tensorboard, progress=cfg.log.progress)
        stopped = False
        self._window_t, self._window_samples = time.perf_counter(), 0
        try:
            while not stopped and p.step < self.total_steps:
                self.sampler.set_epoch(p.epoch)
                # Worker seeds depend on (seed, rank, epoch) only, never on how many epochs this
                # process has run: a resumed run draws the same ones as a straight run.
                self.loader.generator.manual_seed(cfg.seed + 7919 * self.env.rank + 104729 * p.epoch)
                self.net.train()
                it = iter(self.loader)
                for _ in range(self._skip_batches):
                    next(it)
                self._skip_batches = 0
                if self._pending_rng is not None:
                    set_rng_state(self._pending_rng)
                    self._pending_rng = None
                acc_stats = None
                while p.batch_in_epoch < self.batches_per_epoch and p.step < self.total_steps:
                    t_step = time.perf_counter()
                    x, y = next(it)
                    x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                    p.batch_in_epoch += 1
                    sync = p.batch_in_epoch % cfg.optim.grad_accum == 0
                    micro = (p.batch_in_epoch - 1) % cfg.optim.grad_accum + 1
                    # TEST HOOK: "K:M" sends a real SIGTERM to the `run` launcher after micro-batch M of step K
                    # (for M = the last one: just before it, as its backward carries the step's agreement) and
                    # waits (<= 30 s) for the forwarded one, so the stop lands at step K.
                    if self._test_stop is not None and self._test_stop[0] == p.step + 1 and \
                            micro == min(self._test_stop[1] + 1, cfg.optim.grad_accum):
                        os.kill(os.getppid(), signal.SIGTERM)
                        for _ in range(3000):
                            if self.stop.requested:
                                break
                            time.sleep(0.01)
                    acc_stats = self._micro_step(x, y, sync, acc_stats)
                    if not sync:
                        continue
                    if cfg.optim.grad_clip:
                        nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)
                    self.optimizer.step()
                    self.scheduler.step()
                    self.optimizer.zero_grad(set_to_none=True)
                    p.step += 1
                    p.samples_seen += global_batch   # every batch is full (drop_last)
                    p.train_time_s += time.perf_counter() - t_step
                    stopped, timed = self._agree(p.step, p.epoch, mon)
                    acc_stats = None
                    if self.checkpointer is not None:
                        self.checkpointer.after_step(self, force=stopped, timed=timed)
                    if stopped:
                        break
                if stopped:
                    break
                if p.batch_in_epoch >= self.batches_per_epoch:
                    if cfg.train.eval:
                        p.last_eval_loss, p.last_eval_acc = self.evaluate()
                        p.last_eval_step = p.step
                        mon.eval(p.step, p.epoch, p.last_eval_loss, p.last_eval_acc)
                    p.epoch += 1
                    p.batch_in_epoch = 0
            if not stopped:
                p.finished = True
                if cfg.train.eval and p.last_eval_step != p.step:   # max_steps ended mid-epoch
                    p.last_eval_loss, p.last_eval_acc = self.evaluate()
                    p.last_eval_step = p.step
                    mon.eval(p.step, p.epoch, p.last_eval_loss, p.last_eval_acc)
                if self.checkpointer is not None:
                    self.checkpointer.after_step(self, force=True)
        finally:
            mon.close()
            if self.checkpointer is not None:
                self.checkpointer.close()
        return {"stopped": stopped, "stop_signal": self.stop.name if stopped else None,
                "train_loss": p.last_loss, "test_accuracy": p.last_eval_acc, "test_loss": p.last_eval_loss,
                "steps": p.step, "epochs": p.epoch, "wall_seconds": time.time() - self.t_start,
                "world_size": world, "effective_batch_size": global_batch, "total_steps": self.total_steps,
                "tb_dir": str(self.run_dir / "tb"), "progress": asdict(p),
                "checkpoint_saves": self.checkpointer.stats if self.checkpointer else []}

    @torch.no_grad()
    def sync_buffers(self) -> None:
        """Give every rank rank 0's buffers (BatchNorm statistics).

        DDP broadcasts rank 0's buffers at the start of every training forward, so rank 0's are
        the canonical ones and other ranks' copies are overwritten before training reads them.
        Syncing before a save makes the replicated tensors truly equal (DCP writes each one from
        whichever rank it picks), and before eval makes every rank evaluate the same model.
        Training is unchanged by it, which the exact-resume test checks.
        """
        if self.ddp:
            for buf in self.model.buffers():
                dist.broadcast(buf, 0)

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        self.sync_buffers()
        self.net.eval()
        stats = torch.zeros(3, dtype=torch.float64, device=self.device)
        for x, y in self.test_loader:
            x, y = x.to(self.device), y.to(self.device)
            out = self.model(x)
            stats += torch.stack([nn.functional.cross_entropy(out, y, reduction="sum").double(),
                                  (out.argmax(1) == y).sum().double(), torch.tensor(float(y.numel()),
                                                                                    device=self.device).double()])
        if self._multi:
            dist.all_reduce(stats)
        self.net.train()
        return float(stats[0] / stats[2]), float(stats[1] / stats[2])
