"""The local tier's layout: a rank's modules and optimizers as one raw file per dtype.

A local item is one rank's whole state, written by that rank alone and read back only by the
same code at the same world size: nothing in it is ever resharded, so nothing in it needs
DCP's planning, names or metadata. What it saves of a module or an optimizer is what that object
gives itself (``state_dict()``: the live tensors, no copy), not DCP's view of it: building DCP's
view maps every parameter to its name on every call, and with DCP's writer (a ``torch.save``
per item, the planner, ``.metadata``) it was most of a small model's save, on the CPU the ranks
train on. Here every tensor is copied into its dtype's buffer on the training thread (the one
copy an asynchronous save takes anyway), and the writer thread writes each buffer as one file,
``flat-<dtype>.bin``, its CRC32C computed on the buffer as it is written. What goes where is a
*skeleton*: the state dicts' own nesting with each tensor replaced by a mark
``{MARK: [dtype, offset, shape]}``, kept with the rank's small values in ``rank-R.pt`` (plain
data: read with ``weights_only=True``). The files are checked like any item's, against the
commit record's sizes and checksums.

A restore checks every module's places, shapes and dtypes and every optimizer's groups against
the live objects before it writes anything (a model that changed is a :class:`CheckpointError`
naming the first place that differs), then hands each object its state dict back through its
own ``load_state_dict``. Hazard: the buffer files are in the machine's byte order; an item is
read only on the node that wrote it or a peer of the same job.

Also here, what a save does with an item's files: the item it prunes becomes the rank's spare,
whose buffer files the next save overwrites (:func:`retire`, :func:`reuse_spare`), and the
check that the parameters are finite before a save (:func:`finite`).
"""

from __future__ import annotations

import math
import os
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hpc_train.ckpt import store
from hpc_train.ckpt.checksum import Checks, extend, hexdigest, open_regular
from hpc_train.errors import CheckpointError

LAYOUT = store.BUFFERS          # the commit record's "layout" for an item written so
MARK = "__hpc_train_flat__"     # a tensor's place in the skeleton: {MARK: [dtype, offset, shape]}
KEY = "flat"                    # the skeleton's entry in rank-R.pt
_SAVED = ("module", "optimizer")


def views(state: Mapping[str, Any], kinds: dict[str, str]) -> dict[str, Any]:
    """The modules' and optimizers' own state dicts: the live tensors, nothing copied."""
    return {k: state[k].state_dict() for k, kind in kinds.items() if kind in _SAVED}


def pack(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any], int]:
    """(one CPU buffer per dtype name, the skeleton, their bytes) of ``state`` (:func:`views`)."""
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
        return obj      # a plain value (a learning rate, a parameter's index): kept as it is

    skeleton = mark(state)
    # One copy per dtype, in the places' order, on the CPU (a GPU's tensors come over one by one,
    # as a copy into a CPU buffer would bring them; Adam's step counts are CPU tensors beside them).
    buffers = {name: torch.cat(ts if all(t.device.type == "cpu" for t in ts) else [t.cpu() for t in ts])
               for name, ts in parts.items()}
    return buffers, skeleton, sum(b.numel() * b.element_size() for b in buffers.values())


def file_name(dtype_name: str) -> str:
    return f"flat-{dtype_name}.bin"


def _bytes(buf: torch.Tensor) -> memoryview:
    return memoryview(buf.view(torch.uint8).numpy()).cast("B") if buf.numel() else memoryview(b"")


def write(path: Path, buffers: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each buffer as ``path/flat-<dtype>.bin``, over the file of that name already there (a
    recycled item's: its pages are reused) or a new one, never through a link; returns {file
    name: CRC32C of what was written}."""
    sums = {}
    for name, buf in buffers.items():
        data, fname = _bytes(buf), file_name(name)
        fd = os.open(path / fname, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{fname} is not a regular file")
            os.set_blocking(fd, True)
            done = 0
            while done < data.nbytes:     # one write() moves at most about 2 GiB
                done += os.write(fd, data[done:])
            os.ftruncate(fd, data.nbytes)
        finally:
            os.close(fd)
        sums[fname] = hexdigest(extend(0, data))
    return sums


def reuse_spare(spare: Path, path: Path, keep: set[str]) -> None:
    """Make the item directory ``path`` from ``spare`` (a pruned item, see :func:`retire`) when
    there is one, keeping only its buffer files named in ``keep``, which :func:`write` then
    overwrites in place: a file's memory pages are reused instead of freed and allocated again,
    which in tmpfs costs more than the copy itself for a large state. Else a new directory."""
    if os.path.isdir(spare) and not os.path.islink(spare):
        try:
            os.rename(spare, path)
            for entry in os.scandir(path):
                # A file another item links to (a copy saved at a failure, tier.save_at_failure)
                # is never written over: it is unlinked here, and written anew.
                if entry.name not in keep or not entry.is_file(follow_symlinks=False) \
                        or entry.stat(follow_symlinks=False).st_nlink > 1:
                    (shutil.rmtree if entry.is_dir(follow_symlinks=False) else os.unlink)(entry.path)
            return
        except OSError:
            shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o700)


def retire(item: Path, spare: Path) -> None:
    """A pruned item: its commit record goes first (it is never complete again), then it becomes
    ``spare``, which the next save overwrites, or goes when there is a spare already."""
    try:
        if not os.path.lexists(spare) and item.is_dir() and not item.is_symlink():
            (item / store.COMMIT).unlink(missing_ok=True)
            item.rename(spare)
            return
    except OSError:
        pass
    shutil.rmtree(item, ignore_errors=True)


def read(path: Path, skeleton: Any, checks: Checks) -> dict[str, torch.Tensor]:
    """The buffers the skeleton's marks need, read from ``path`` into fresh tensors and checked
    against the commit record's checksums, in the buffers they were read into."""
    sizes: dict[str, int] = {}
    for name, offset, shape in _marks(skeleton):
        sizes[name] = max(sizes.get(name, 0), offset + math.prod(shape))
    out = {}
    for name, n in sizes.items():
        buf = torch.empty(n, dtype=_dtype(name))
        data, fname = _bytes(buf), file_name(name)
        try:
            with open_regular(path / fname) as f:
                got = f.readinto(data) if data.nbytes else 0
                extra = f.read(1)
        except OSError as e:
            raise CheckpointError(f"cannot read {fname}: {e.strerror or e}") from None
        if got != data.nbytes or extra:
            raise CheckpointError(f"{fname} does not hold the {data.nbytes} bytes its layout needs")
        checks.data(fname, data)
        out[name] = buf
    return out


def finite(params: list[torch.Tensor]) -> bool:
    """Whether every parameter is finite. A sum is NaN or infinite if any element is (they
    propagate through every partial sum), and one vectorized pass costs a fraction of
    ``isfinite().all()``; only a sum that is not finite (a NaN, or an overflow of finite values)
    is checked element by element. One synchronization on a GPU, not one per parameter."""
    if not params:
        return True
    parts = [torch.view_as_real(p.detach()) if p.is_complex() else p.detach() for p in params]
    sums = torch.stack([p.sum(dtype=torch.float32 if p.element_size() < 4 else None).float().reshape(())
                        for p in parts])
    if math.isfinite(float(sums.sum())):
        return True
    return all(bool(p.detach().isfinite().all()) for p in params)


def restore(state: Mapping[str, Any], kinds: dict[str, str], skeleton: Any, buffers: dict[str, torch.Tensor]) -> None:
    """Load ``state``'s modules and optimizers from the skeleton and buffers. Everything is
    checked before anything is written: a mismatch changes nothing."""
    keys = [k for k, kind in kinds.items() if kind in _SAVED]
    if not isinstance(skeleton, dict) or set(skeleton) != set(keys):
        have = sorted(map(str, skeleton)) if isinstance(skeleton, dict) else []
        raise CheckpointError(f"the item holds state for {', '.join(have) or 'nothing'}, not {', '.join(keys)}")
    for k in keys:
        if kinds[k] == "module":
            _check(state[k].state_dict(), skeleton[k], buffers, k)
        else:
            _check_groups(state[k], skeleton[k], k)
    for k in keys:
        if kinds[k] == "optimizer":   # a copy of each tensor: the optimizer keeps what it is given
            state[k].load_state_dict(_unpack(skeleton[k], buffers, clone=True))
        else:
            state[k].load_state_dict(_unpack(skeleton[k], buffers, clone=False))


def _check(target: Any, skeleton: Any, bufs: dict[str, torch.Tensor], where: str) -> None:
    """That ``skeleton`` fits ``target`` (a live state dict) place by place."""
    if _is_mark(skeleton):
        name, offset, shape = _mark(skeleton)
        if not isinstance(target, torch.Tensor):
            raise CheckpointError(f"{where} is a tensor in the checkpoint and not in the state now")
        now = _name(target.dtype)
        if list(target.shape) != list(shape) or now != name:
            raise CheckpointError(f"size mismatch for {where}: the checkpoint holds {name} {list(shape)}, the "
                                  f"state now {now} {list(target.shape)}")
        if name not in bufs or offset + target.numel() > bufs[name].numel():
            raise CheckpointError(f"{where} lies past the end of the item's {name} buffer")
    elif isinstance(skeleton, dict):
        if not isinstance(target, dict) or set(skeleton) != set(target):
            have = set(target) if isinstance(target, dict) else set()
            odd = sorted(map(str, set(skeleton) ^ have))[:3]
            raise CheckpointError(f"the checkpoint's entries under {where} differ from the state's ({', '.join(odd)})")
        for k in skeleton:
            _check(target[k], skeleton[k], bufs, f"{where}.{k}")
    elif isinstance(skeleton, (list, tuple)):
        if not isinstance(target, (list, tuple)) or len(target) != len(skeleton):
            raise CheckpointError(f"{where} has {len(skeleton)} entries in the checkpoint, not as many in the state now")
        for i, (t, s) in enumerate(zip(target, skeleton)):
            _check(t, s, bufs, f"{where}.{i}")
    elif isinstance(target, torch.Tensor):
        raise CheckpointError(f"{where} is a tensor in the state now and not in the checkpoint")


def _check_groups(optimizer: Any, skeleton: Any, where: str) -> None:
    """What ``Optimizer.load_state_dict`` checks, before any module is written: as many groups
    of as many parameters, and state only for parameters it has."""
    groups = skeleton.get("param_groups") if isinstance(skeleton, dict) else None
    own = skeleton.get("state") if isinstance(skeleton, dict) else None
    if not isinstance(groups, list) or not isinstance(own, dict) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        raise CheckpointError(f"{where} in the checkpoint is not an optimizer's state")
    live = [len(g["params"]) for g in optimizer.param_groups]
    saved = [len(g["params"]) for g in groups]
    if live != saved:
        raise CheckpointError(f"{where}: the checkpoint's parameter groups hold {saved} parameters, the optimizer's "
                              f"now {live}")
    ids = {i for g in groups for i in g["params"]}
    if not set(own) <= ids:
        raise CheckpointError(f"{where}: the checkpoint has state for parameters its groups do not list")


def _unpack(skeleton: Any, bufs: dict[str, torch.Tensor], clone: bool) -> Any:
    """The skeleton with every mark replaced by its slice of the buffer (a copy: ``clone``)."""
    if _is_mark(skeleton):
        name, offset, shape = _mark(skeleton)
        t = bufs[name][offset:offset + math.prod(shape)].view(shape)
        return t.clone() if clone else t
    if isinstance(skeleton, dict):
        return {k: _unpack(v, bufs, clone) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_unpack(v, bufs, clone) for v in skeleton)
    return skeleton


def _is_mark(obj: Any) -> bool:
    return isinstance(obj, dict) and len(obj) == 1 and MARK in obj


def _mark(obj: dict) -> tuple[str, int, list[int]]:
    """A mark's fields, checked: a damaged or foreign skeleton is an error, not a crash."""
    m = obj[MARK]
    if not (isinstance(m, list) and len(m) == 3 and isinstance(m[0], str) and isinstance(m[1], int)
            and not isinstance(m[1], bool) and m[1] >= 0 and isinstance(m[2], list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in m[2])):
        raise CheckpointError(f"the item's layout holds a bad entry ({str(m)[:80]})")
    _dtype(m[0])
    return m[0], m[1], m[2]


def _marks(obj: Any):
    """Every mark in the skeleton, checked."""
    if _is_mark(obj):
        yield _mark(obj)
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
    if not isinstance(dt, torch.dtype) or name.startswith("_"):
        raise CheckpointError(f"the item's layout names {name!r}, which is not a torch dtype")
    return dt
