"""Parallelism strategies: how ``run.wrap(model)`` spreads a model over processes and devices.

``dist.strategy`` picks one (the built-in trainer and a user's own loop both go through
:meth:`hpc_train.run.Run.wrap`):

``ddp`` (default)
    DistributedDataParallel: one process per device, gradients all-reduced in buckets while
    backward runs. The step's stop agreement is reduced beside its first bucket (no extra sync).
``fsdp``
    FSDP2 ``fully_shard``: parameters, gradients and optimizer state sharded over the ranks.
    Checkpoints are sharded DTensors in DCP, resharded on load at another world size. The stop
    agreement is one small extra all-reduce per step.
``dp``
    ``nn.DataParallel``: one process drives all of its node's GPUs (threads, a scatter and a
    gather every step, the GIL). Refused with more than one process per node. Across nodes,
    gradients are averaged as under ``allreduce``.
``allreduce``
    No wrapper: after backward, gradients are averaged with bucketed all-reduces (the
    tutorials' manual averaging, one collective per ~25 MB instead of one per tensor).
``split``
    The model's stages on successive devices of the node, activations moved between them; each
    process owns ``GPUs per node / processes per node`` devices, and DDP runs across processes.
    On CPU every stage is on the CPU.
``none``
    The model as it is (no gradient averaging: each rank trains its own copy).

This module imports torch lazily.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from hpc_train.config import STRATEGIES, check_launch
from hpc_train.errors import UsageError

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger("hpc_train")
BUCKET_BYTES = 25 * 2**20   # DDP's default bucket_cap_mb


def stage_devices(n_stages: int, device: torch.device, device_count: int, local_rank: int,
                  local_world_size: int) -> list[torch.device]:
    """The device of each stage: this process's share of the node's GPUs, in order; on CPU,
    the CPU for every stage."""
    import torch
    if device.type != "cuda":
        return [device] * n_stages
    per_proc = device_count // max(1, local_world_size)
    if n_stages > per_proc:
        raise UsageError(
            f"config: dist.strategy=split puts {n_stages} stages on {n_stages} devices, but each process has "
            f"{per_proc} ({device_count} GPUs per node / {local_world_size} processes per node); run fewer "
            f"processes per node, or give the model at most {per_proc} stages")
    first = local_rank * per_proc
    return [torch.device("cuda", first + i) for i in range(n_stages)]


def split_base_device(device_count: int, local_rank: int, local_world_size: int) -> int:
    """Under ``split`` a process's first GPU: it owns a block of the node's GPUs."""
    return local_rank * max(1, device_count // max(1, local_world_size))


def _stages_module():
    from torch import nn

    class Stages(nn.Module):
        """Runs ``stages`` in order, each on its device; the output returns to the first
        stage's device, so the loss (and the loop) sees the device it put the input on."""

        def __init__(self, stages: Sequence[nn.Module], devices: Sequence[torch.device]) -> None:
            super().__init__()
            self.stages = nn.ModuleList(stages)
            self.devices = list(devices)
            for s, d in zip(self.stages, self.devices):
                s.to(d)

        def forward(self, x):
            for stage, dev in zip(self.stages, self.devices):
                x = stage(x.to(dev, non_blocking=True))
            return x.to(self.devices[0], non_blocking=True)
    return Stages


class GradAverager:
    """The ``allreduce`` strategy: after each backward, average every parameter's gradient
    over the ranks with bucketed all-reduces; the model is not wrapped.

    Each parameter's post-accumulate-grad hook queues one end-of-backward callback (the
    autograd engine runs it once all gradients are accumulated, so a user's loop is unchanged).
    The callback divides by the world size and sums, as DDP's default hook does, so with 2
    ranks the weights are bitwise DDP's (a+b == b+a). The step's agreement values ride on
    the first bucket, as under DDP."""

    def __init__(self, model: nn.Module, agreement: Any) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.agreement = agreement
        self.sync = True
        self._queued = False
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, _param: Any) -> None:
        if self.sync and not self._queued:
            from torch.autograd import Variable
            self._queued = True
            Variable._execution_engine.queue_callback(self._average)

    def _buckets(self) -> Iterator[list[torch.Tensor]]:
        bucket: list = []
        size = 0
        for p in reversed(self.params):   # last layers' gradients are ready first (DDP's order too)
            if p.grad is None:
                continue
            bucket.append(p.grad)
            size += p.grad.numel() * p.grad.element_size()
            if size >= BUCKET_BYTES:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def _average(self) -> None:
        import torch
        import torch.distributed as dist
        self._queued = False
        world = dist.get_world_size()
        pending = []
        for i, grads in enumerate(self._buckets()):
            flat = torch.cat([g.flatten() for g in grads]).div_(world)
            n = flat.numel()
            if i == 0:
                if self.agreement.on_sync is not None:
                    self.agreement.on_sync()
                flat = torch.cat([flat, self.agreement._values(flat.device, flat.dtype)])
            pending.append((dist.all_reduce(flat, async_op=True), flat, grads, n, i == 0))
        for work, flat, grads, n, first in pending:
            work.wait()
            if first:
                self.agreement._inflight = (work, flat[n:].clone())   # collect() reads it
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.sync = False
        try:
            yield
        finally:
            self.sync = True


def declared_stages(model: nn.Module, stages: Sequence[nn.Module] | None) -> list[nn.Module]:
    if stages is None:
        declare = getattr(model, "stages", None)
        if not callable(declare):
            raise UsageError(f"dist.strategy=split needs the model's stages: pass run.wrap(model, stages=[...]) "
                             f"(modules applied in order), or give {type(model).__name__} a stages() method")
        stages = declare()
    stages = list(stages)
    if not stages:
        raise UsageError("dist.strategy=split: the list of stages is empty")
    return stages


class Wrapped:
    """What :func:`wrap` made: ``net`` (what the loop calls) and how to skip a gradient sync."""

    def __init__(self, net: nn.Module, averager: GradAverager | None = None) -> None:
        self.net, self.averager = net, averager

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Accumulate gradients locally for this micro-batch (the next synced backward averages
        the sum)."""
        from torch.distributed.fsdp import FSDPModule
        from torch.nn.parallel import DistributedDataParallel as DDP
        if isinstance(self.net, DDP):
            return self.net.no_sync()
        if self.averager is not None:
            return self.averager.no_sync()
        if isinstance(self.net, FSDPModule):
            return _fsdp_no_sync(self.net)
        return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(net: Any) -> Iterator[None]:
    net.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        net.set_requires_gradient_sync(True)


def wrap(model: nn.Module, strategy: str, device: torch.device, *, multi: bool, local_rank: int,
         local_world_size: int, agreement: Any, stages: Sequence[nn.Module] | None = None) -> Wrapped:
    """Wrap ``model`` (already on ``device``) as ``strategy`` says. ``multi``: more than one rank."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp_ids = [device.index] if device.type == "cuda" else None
    if strategy == "split":
        parts = declared_stages(model, stages)
        count = torch.cuda.device_count() if device.type == "cuda" else 0
        devices = stage_devices(len(parts), device, count, local_rank, local_world_size)
        net = _stages_module()(parts, devices)
        log.info("split: %d stages on %s", len(parts), ", ".join(map(str, devices)))
        if not multi:
            return Wrapped(net)
        ddp = DDP(net)   # a module spanning devices: DDP takes no device_ids
        agreement.attach(ddp)
        return Wrapped(ddp)
    if strategy == "dp":
        check_launch("dp", local_world_size)
        net = nn.DataParallel(model) if device.type == "cuda" else model   # on CPU DataParallel is the module itself
        if not multi:
            return Wrapped(net)
        return Wrapped(net, GradAverager(model, agreement))
    if not multi or strategy == "none":
        return Wrapped(model)
    if strategy == "ddp":
        ddp = DDP(model, device_ids=ddp_ids)
        agreement.attach(ddp)
        return Wrapped(ddp)
    if strategy == "allreduce":
        return Wrapped(model, GradAverager(model, agreement))
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard
        # Each top-level child holding parameters is its own unit (only one unit's full
        # parameters exist at a time), then the root for what is left. Not the declared stages:
        # fully_shard unshards in its unit's forward, and a stage list may be containers the
        # model's own forward never calls.
        for unit in [c for c in model.children() if any(True for _ in c.parameters())]:
            fully_shard(unit)
        fully_shard(model)
        return Wrapped(model)
    raise UsageError(f"config: dist.strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")


def eval_module(net: nn.Module) -> nn.Module:
    """The module to evaluate with: without DDP's per-forward buffer broadcast."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    return net.module if isinstance(net, DDP) else net
