"""The local tier's layout: a rank's modules and optimizers as one flat tensor per dtype.

A local item is one rank's whole state, written by that rank alone and read back only at the
same world size: nothing in it is ever resharded. So its tensors need not be DCP items of their
own. Each DCP item costs a ``torch.save`` (a zip container: headers, a pickle, padding) and a
share of DCP's planning, and an optimizer is many small items (Adam's per-parameter ``step``,
each ``param_groups`` value): for a small model, most of a save's CPU time went there, on
cores the ranks train on. Here every tensor is copied into its dtype's buffer (the one copy a
save takes anyway, on the training thread), and DCP writes the buffers: a few items, checked by
the same CRC32C and commit record as any item. What goes where is a *skeleton*: the state's own
nesting with each tensor replaced by a mark ``{MARK: [dtype, offset, shape]}``, kept with the
rank's small values in ``rank-R.pt`` (plain data: read with ``weights_only=True``).

Loading copies each slice into the tensor the live state holds at the same place, as DCP's own
load does, once every place and shape is checked: a model that changed is a
:class:`CheckpointError` naming the first place that differs, and nothing is written.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hpc_train.errors import CheckpointError

LAYOUT = "flat"                 # the commit record's "layout" for an item written so
MARK = "__hpc_train_flat__"     # a tensor's place in the skeleton: {MARK: [dtype, offset, shape]}
KEY = "flat"                    # the DCP state dict's one entry: {KEY: {dtype name: buffer}}


def pack(state: dict[str, Any]) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any], int]:
    """(what DCP saves: the buffers, on the CPU; the skeleton; their bytes). ``state``: DCP's
    view of the modules and optimizers (:func:`hpc_train.ckpt.common.dcp_state`)."""
    parts: dict[str, list[torch.Tensor]] = {}
    sizes: dict[str, int] = {}

    def mark(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            name = _name(obj.dtype)
            offset = sizes.get(name, 0)
            sizes[name] = offset + obj.numel()
            parts.setdefault(name, []).append(obj.detach().reshape(-1))
            return {MARK: [name, offset, list(obj.shape)]}
        if isinstance(obj, dict):
            return {k: mark(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(mark(v) for v in obj)
        return obj      # a plain value (a learning rate, a parameter's name): kept as it is

    skeleton = mark(state)
    # One copy per dtype, in the places' order, on the CPU (a GPU's tensors come over one by one,
    # as a copy into a CPU buffer would bring them; Adam's step counts are CPU tensors beside them).
    buffers = {name: torch.cat(ts if all(t.device.type == "cpu" for t in ts) else [t.cpu() for t in ts])
               for name, ts in parts.items()}
    return {KEY: buffers}, skeleton, sum(b.numel() * b.element_size() for b in buffers.values())


def empty_buffers(skeleton: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Buffers of the sizes the skeleton's marks need, for DCP to load into."""
    sizes: dict[str, int] = {}
    for name, offset, shape in _marks(skeleton):
        sizes[name] = max(sizes.get(name, 0), offset + math.prod(shape))
    return {KEY: {name: torch.empty(n, dtype=_dtype(name)) for name, n in sizes.items()}}


def fill(target: Any, skeleton: Any, buffers: dict[str, dict[str, torch.Tensor]]) -> Any:
    """``target`` (the live state's DCP view, as :func:`pack` took it) with every tensor
    overwritten in place from its slice and every plain value the skeleton's; returns it.
    Every place is checked before anything is written: a mismatch changes nothing."""
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    sets: list[tuple[Any, Any, Any]] = []
    out = _plan(target, skeleton, buffers[KEY], "", copies, sets)
    for dst, src in copies:
        dst.copy_(src)
    for container, key, value in sets:
        container[key] = value
    return out


def _plan(target: Any, skeleton: Any, bufs: dict[str, torch.Tensor], where: str,
          copies: list[tuple[torch.Tensor, torch.Tensor]], sets: list[tuple[Any, Any, Any]]) -> Any:
    """What :func:`fill` writes at ``where`` (copies, then values set in containers); the value
    that belongs there afterwards."""
    if _is_mark(skeleton):
        name, offset, shape = skeleton[MARK]
        if not isinstance(target, torch.Tensor):
            raise CheckpointError(f"{where or 'the state'} is a tensor in the checkpoint and not in the state now")
        now = _name(target.dtype)
        if list(target.shape) != list(shape) or now != name:
            raise CheckpointError(f"size mismatch for {where}: the checkpoint holds {name} {list(shape)}, the "
                                  f"state now {now} {list(target.shape)}")
        src = bufs[name][offset:offset + target.numel()]
        if src.numel() != target.numel():
            raise CheckpointError(f"{where} lies past the end of the item's {name} buffer")
        copies.append((target, src.view(target.shape)))
        return target
    if isinstance(skeleton, dict):
        if not isinstance(target, dict) or set(skeleton) != set(target):
            have = set(target) if isinstance(target, dict) else set()
            odd = sorted(map(str, set(skeleton) ^ have))[:3]
            raise CheckpointError(f"the checkpoint's entries under {where or 'the state'} differ from the state's "
                                  f"({', '.join(odd)})")
        for k in skeleton:
            sets.append((target, k, _plan(target[k], skeleton[k], bufs, f"{where}.{k}" if where else str(k),
                                          copies, sets)))
        return target
    if isinstance(skeleton, (list, tuple)):
        if not isinstance(target, (list, tuple)) or len(target) != len(skeleton):
            raise CheckpointError(f"{where} has {len(skeleton)} entries in the checkpoint, not as many in the state now")
        vals = [_plan(t, s, bufs, f"{where}.{i}", copies, sets) for i, (t, s) in enumerate(zip(target, skeleton))]
        if isinstance(target, list):
            sets.extend((target, i, v) for i, v in enumerate(vals))
            return target
        return type(skeleton)(vals)
    return skeleton


def _is_mark(obj: Any) -> bool:
    return isinstance(obj, dict) and len(obj) == 1 and MARK in obj


def _marks(obj: Any):
    """Every mark in the skeleton, checked: a damaged or foreign skeleton is an error, not a crash."""
    if _is_mark(obj):
        m = obj[MARK]
        if not (isinstance(m, list) and len(m) == 3 and isinstance(m[0], str) and isinstance(m[1], int)
                and m[1] >= 0 and isinstance(m[2], list) and all(isinstance(d, int) and d >= 0 for d in m[2])):
            raise CheckpointError(f"the item's layout holds a bad entry ({str(m)[:80]})")
        _dtype(m[0])
        yield m
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _marks(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _marks(v)


def _name(dtype: torch.dtype) -> str:
    """A dtype as the skeleton names it (``float32``), which :func:`_dtype` reads back."""
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"the item's layout names {name!r}, which is not a torch dtype")
    return dt
