"""The built-in loop: the tutorials' models on digits/MNIST, as one client of :class:`hpc_train.run.Run`.

It holds a ``Run`` like any user's loop: ``run.wrap`` applies ``dist.strategy`` (DDP by default),
``run.loader`` shards the data, ``run.restore`` / ``run.step_end`` / ``run.finish`` checkpoint, stop
and finish. Its state is a mapping of state objects, which is all the checkpointer sees.

One optimizer step is ``optim.grad_accum`` micro-batches; accumulation micro-batches run under
``run.no_sync()`` so the strategy skips their gradient averaging. The step's metrics (loss sum,
correct, count) are summed over ranks with the step's agreement, on the gradient all-reduce
(``ddp``, ``allreduce``, ``split``; one small extra all-reduce under ``fsdp``): logging costs no
collective and no host sync beyond the one ``step_end`` makes anyway. ``train.precision``: the
forward runs under ``run.autocast()``, and the backward and step go through ``run.scaler``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from hpc_train import rundir
from hpc_train.trainer import data as data_mod
from hpc_train.trainer import models
from hpc_train.node import strategies
from hpc_train.config import Config
from hpc_train.errors import NonFiniteError, UsageError
from hpc_train.run import Run
from hpc_train.ckpt.state import seed_everything

log = logging.getLogger("hpc_train")


@dataclass
class Progress:
    """Where training stands beyond the step count; saved in every checkpoint."""
    samples_seen: int = 0      # global samples, for resuming at another world size
    train_time_s: float = 0.0  # wall time spent in steps, across runs
    last_loss: float = float("nan")
    last_eval_acc: float = float("nan")
    last_eval_loss: float = float("nan")
    last_eval_step: int = -1

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for k, v in sd.items():
            setattr(self, k, v)


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


def make_optimizer(cfg: Config, params) -> torch.optim.Optimizer:
    o = cfg.optim
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    if o.name == "adamw":
        return torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay)
    return torch.optim.Adam(params, lr=o.lr, weight_decay=o.weight_decay)


class Trainer:
    def __init__(self, cfg: Config, run: Run) -> None:
        self.cfg, self.run, self.device = cfg, run, run.device
        # Same seed on every rank for the weights (DDP also broadcasts rank 0's), then a
        # per-rank stream for dropout and anything else random in the step.
        seed_everything(cfg.seed)
        self.model = models.build(cfg.model).to(self.device)
        self.net = run.wrap(self.model)   # dist.strategy: the model may now be sharded (fsdp) or split
        self.eval_net = strategies.eval_module(self.net)   # no DDP buffer broadcast in eval
        train_ds, test_ds = data_mod.build(cfg.data, cfg.seed)
        d, accum = cfg.data, cfg.optim.grad_accum
        self.loader = run.loader(train_ds, d.batch_size, shuffle=d.shuffle, num_workers=d.num_workers,
                                 reshard_multiple=accum)
        # An optimizer step needs grad_accum micro-batches: the epoch's remainder is not used.
        self.loader.batches_per_epoch -= self.loader.batches_per_epoch % accum
        self.steps_per_epoch = self.loader.batches_per_epoch // accum
        if self.steps_per_epoch == 0:
            raise UsageError(f"config: data.batch_size={d.batch_size} x world size {run.world_size} x "
                             f"optim.grad_accum={accum} is larger than the training set "
                             f"({len(train_ds)} samples): not one optimizer step fits in an epoch")
        # The held-out split, sharded without padding so every sample counts exactly once.
        shard = torch.utils.data.Subset(test_ds, range(run.rank, len(test_ds), run.world_size))
        self.test_loader = DataLoader(shard, batch_size=d.eval_batch_size, shuffle=False,
                                      generator=torch.Generator().manual_seed(0))
        # fsdp all-gathers parameters in every forward, so every rank must run as many eval
        # forwards as rank 0 (the largest shard), or one waits forever: the others pad with
        # empty batches. (Shards differ by one sample: e.g. 513 samples, 2 ranks, batch 256.)
        most = -(-len(range(0, len(test_ds), run.world_size)) // d.eval_batch_size)
        self.eval_pad = most - len(self.test_loader) if cfg.dist.strategy == "fsdp" else 0
        self.eval_shape = tuple(test_ds[0][0].shape) if self.eval_pad else ()
        t = cfg.train
        self.total_steps = t.max_steps or t.epochs * self.steps_per_epoch
        run.total_steps = self.total_steps
        self.optimizer = make_optimizer(cfg, self.model.parameters())
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, self.total_steps))
        self.criterion = nn.CrossEntropyLoss()
        self.scaler = run.scaler          # fp16: loss scaling; a pass-through otherwise
        seed_everything(cfg.seed + 1000003 * (run.rank + 1))
        self.progress = Progress()
        from hpc_train.trainer.signature import model_signature
        run.checkpoint_record["model"] = model_signature(cfg.model)   # resume refuses another model config early
        self.state: dict[str, Any] = {"model": self.model, "optim": self.optimizer, "sched": self.scheduler,
                                      "loader": self.loader, "progress": self.progress, "step": 0}
        if self.scaler.is_enabled():
            self.state["scaler"] = self.scaler   # its scale and growth tracker resume with the run

    def _micro_step(self, x: torch.Tensor, y: torch.Tensor, sync: bool, prior: torch.Tensor | None) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns the metrics summed over the cycle.
        On the cycle's last micro-batch they are staged before the backward that carries them."""
        ctx = self.run.no_sync() if not sync else contextlib.nullcontext()
        with ctx:
            with self.run.autocast():
                out = self.net(x)
                loss = self.criterion(out, y)
            correct = (out.detach().argmax(1) == y).sum()
            stats = torch.stack([loss.detach() * y.numel(), correct.float(),
                                 torch.tensor(float(y.numel()), device=x.device)])
            if prior is not None:
                stats = prior + stats
            if sync:
                self.run.sum_with_step(stats)
            self.scaler.scale(loss / self.cfg.optim.grad_accum).backward()
        return stats

    def fit(self) -> dict[str, Any]:
        try:
            return self._fit()
        except NonFiniteError as e:   # the advice that fits this trainer's config
            raise NonFiniteError(f"{e}. Lower optim.lr (now {self.cfg.optim.lr:g}), set optim.grad_clip, "
                                 f"or check the data") from None

    def _fit(self) -> dict[str, Any]:
        cfg, p, run, st = self.cfg, self.progress, self.run, self.state
        accum = cfg.optim.grad_accum
        self.t_start = time.time()
        if run.restore(st):
            self._apply_hyperparameters()
        global_batch = cfg.data.batch_size * run.world_size * accum
        log.info("model %s (%.2fM parameters), data %s: %d train batches/rank/epoch, %d steps/epoch",
                 cfg.model.name, sum(t.numel() for t in self.model.parameters()) / 1e6, cfg.data.name,
                 len(self.loader), self.steps_per_epoch)
        log.info("effective batch size %d = %d per rank x %d ranks x %d accumulation", global_batch,
                 cfg.data.batch_size, run.world_size, accum)
        stopped = False
        window_t, window_samples = time.perf_counter(), 0
        while not stopped and st["step"] < self.total_steps:
            self.net.train()
            epoch = self.loader.epoch
            acc_stats, t_step = None, time.perf_counter()
            for i, (x, y) in enumerate(self.loader, start=self.loader.batches):
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                sync = (i + 1) % accum == 0
                acc_stats = self._micro_step(x, y, sync, acc_stats)
                if not sync:
                    continue
                self._optimizer_step()
                st["step"] += 1
                p.samples_seen += global_batch   # every batch is full (drop_last)
                now = time.perf_counter()
                p.train_time_s += now - t_step
                stopped = run.step_end(st)
                loss_sum, correct, count = run.step_sums
                p.last_loss = loss_sum / count
                window_samples += int(count)
                step = st["step"]
                console = step % cfg.train.log_every == 0 or step == self.total_steps
                scalars = {"loss": p.last_loss, "acc": correct / count, "lr": self.scheduler.get_last_lr()[0]}
                if console:
                    scalars["samples_per_s"] = window_samples / max(now - window_t, 1e-9)
                    window_t, window_samples = now, 0
                run.log(step, epoch=epoch, console=console, **scalars)
                acc_stats, t_step = None, time.perf_counter()
                if stopped or step >= self.total_steps:
                    break
            if not stopped and self.loader.batches == 0 and cfg.train.eval:   # the epoch ended
                self._eval_and_log(epoch)
        if not stopped and cfg.train.eval and p.last_eval_step != st["step"]:   # max_steps ended mid-epoch
            self._eval_and_log(self.loader.epoch)
        result = self._summary(stopped, global_batch)
        if not stopped:
            result = run.finish(result)
            result["checkpoint_saves"] = run.checkpoint_stats
            log.info("done: %d steps, %d epochs, test accuracy %.4f, final train loss %.4f, %.1fs", result["steps"],
                     result["epochs"], result["test_accuracy"], result["train_loss"], result["wall_seconds"])
        return result

    def _optimizer_step(self) -> None:
        """Apply the accumulated gradients once per global batch, through the AMP scaler, then clear them."""
        clip = self.cfg.optim.grad_clip
        if clip:
            self.scaler.unscale_(self.optimizer)   # clip the true gradients, not the scaled ones
            nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.scaler.step(self.optimizer)   # fp16: skipped when a gradient overflowed
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _summary(self, stopped: bool, global_batch: int) -> dict[str, Any]:
        """What ``fit`` returns (and ``Run.finish`` records) about this run, stopped or not."""
        p, run = self.progress, self.run
        return {"stopped": stopped, "stop_signal": run.stop.signal_name if stopped else None,
                "train_loss": p.last_loss, "test_accuracy": p.last_eval_acc, "test_loss": p.last_eval_loss,
                "steps": self.state["step"], "epochs": self.loader.epochs_done,
                "wall_seconds": time.time() - self.t_start, "world_size": run.world_size,
                "effective_batch_size": global_batch, "total_steps": self.total_steps,
                "tb_dir": str(run.run_dir / rundir.TB), "progress": asdict(p)}

    def _apply_hyperparameters(self) -> None:
        """After a restore: the config's optimizer hyperparameters win over the checkpoint's, so an
        edited config applies from the resumed step on (the schedule's shape already does: its
        lambda is built from the config). Unchanged values give the same floats: still bitwise."""
        o = self.cfg.optim
        self.scheduler.base_lrs = [o.lr for _ in self.optimizer.param_groups]
        for g, factor in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            g["initial_lr"] = o.lr
            g["lr"] = o.lr * factor(self.scheduler.last_epoch)
            g["weight_decay"] = o.weight_decay
            if "momentum" in g:
                g["momentum"] = o.momentum

    def _eval_and_log(self, epoch: int) -> None:
        p = self.progress
        with self.run.long_phase("evaluation"):
            p.last_eval_loss, p.last_eval_acc = self.evaluate()
        p.last_eval_step = self.state["step"]
        self.run.log(p.last_eval_step, epoch=epoch, console=True, eval_loss=p.last_eval_loss,
                     eval_acc=p.last_eval_acc)

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        self.run.sync_buffers()    # every rank evaluates rank 0's BatchNorm statistics
        self.net.eval()
        stats = torch.zeros(3, dtype=torch.float64, device=self.device)
        for x, y in self.test_loader:
            x, y = x.to(self.device), y.to(self.device)
            with self.run.autocast():
                out = self.eval_net(x)
            stats += torch.stack([nn.functional.cross_entropy(out, y, reduction="sum").double(),
                                  (out.argmax(1) == y).sum().double(),
                                  torch.tensor(float(y.numel()), device=self.device).double()])
        for _ in range(self.eval_pad):
            self.eval_net(torch.zeros((0, *self.eval_shape), device=self.device))
        if self.run.world_size > 1 and dist.is_initialized():
            dist.all_reduce(stats)
        self.net.train()
        return float(stats[0] / stats[2]), float(stats[1] / stats[2])
