"""Mixed precision (``train.precision``): autocast for the forward, a GradScaler for fp16.

``fp32``
    Everything in float32 (the default; bitwise-exact resume is tested here).
``bf16``
    Forward under ``torch.autocast(dtype=bfloat16)``; weights, gradients and optimizer state stay
    float32. bfloat16 has float32's range, so no loss scaling. Works on CPU and on GPUs of
    compute capability 8.0 (A100) and newer.
``fp16``
    Forward under ``torch.autocast(dtype=float16)`` with a ``GradScaler`` (dynamic loss scaling:
    float16 gradients underflow otherwise). The scaler's state (scale, growth tracker) is
    checkpoint state: put ``run.scaler`` in ``state``, as the built-in trainer does.

``train.opt_level`` writes the same with NVIDIA Apex's names (Apex's ``amp`` is deprecated;
``torch.amp`` replaced it): ``O0`` = fp32; ``O1`` = fp16 (autocast per op plus dynamic loss
scaling: what O1 was); ``O2`` = fp16 too (Apex's O2 also kept float16 copies of the weights
with float32 master weights; autocast keeps float32 weights and casts per op, which is what
PyTorch recommends instead, so O2 and O1 train the same here). Apex's O3 (pure float16, no
master weights) has no safe equivalent and is not offered.

In a loop::

    with run.autocast():
        loss = loss_fn(model(x), y)
    run.scaler.scale(loss).backward()       # with fp32/bf16 the scaler is disabled: a no-op
    run.scaler.step(optim)
    run.scaler.update()
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from hpc_train.errors import UsageError

if TYPE_CHECKING:
    import torch



def check(precision: str, device_type: str, bf16_supported: bool) -> None:
    """Refuse a precision this device cannot run, saying what to use instead (pure)."""
    if precision == "bf16" and device_type == "cuda" and not bf16_supported:
        raise UsageError("config: train.precision=bf16 needs a GPU of compute capability 8.0 or newer (A100, H100); "
                         "this GPU has no bfloat16 arithmetic: use train.precision=fp16 (with loss scaling)")


def check_here(precision: str, backend: str) -> None:
    """:func:`check` for the devices of this machine (imports torch: only for a non-fp32 run)."""
    if precision == "fp32":
        return
    import torch
    cuda = backend == "nccl" or (backend == "auto" and torch.cuda.is_available())
    check(precision, "cuda" if cuda else "cpu", cuda and torch.cuda.is_bf16_supported())


def dtype(precision: str) -> torch.dtype | None:
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The forward's autocast context (a no-op for fp32)."""
    import torch
    dt = dtype(precision)
    if dt is None:
        return contextlib.nullcontext()
    # Again here: under submit/torchrun no launcher on this node has checked this device.
    check(precision, device.type, device.type == "cuda" and torch.cuda.is_bf16_supported())
    return torch.autocast(device.type, dtype=dt)


def scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler, enabled only for fp16 (disabled, its methods pass straight through)."""
    import torch
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
