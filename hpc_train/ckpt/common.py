"""What saving, loading and exporting share: a step directory's files, and the state as DCP sees it.

A ``step-N/`` directory holds DCP's shards and ``.metadata`` (modules and optimizers, reshardable
to another world size), ``app.pt`` (rank 0's copy of schedulers and plain values), one
``rank-R.pt`` per rank (RNG states, loader positions, that rank's plain values) and, written last
by rank 0 once every rank's share is on disk, ``commit.json`` (see :mod:`hpc_train.ckpt.store`).
"""

from __future__ import annotations

import io
import logging
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, get_state_dict

from hpc_train import rundir
from hpc_train.ckpt import store
from hpc_train.ckpt.checksum import extend, hexdigest
from hpc_train.ckpt.state import is_plain, rng_state
from hpc_train.errors import UsageError

log = logging.getLogger("hpc_train")
# DCP says so on every single-process save/load; that is the intent here, so it is noise.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

APP_FILE = rundir.APP_STATE   # rank 0's copy of the replicated non-DCP entries (schedulers, plain values)


def dir_for(run_dir: Path, step: int) -> Path:
    return store.ckpt_root(run_dir) / f"step-{step}"


def rank_file(path: Path, rank: int) -> Path:
    return path / f"rank-{rank}.pt"


def move_aside(path: Path) -> Path:
    """Rename a step directory to ``step-N.skipped-<unix time>[-k]`` beside it; never over another."""
    base = f"{path.name}.skipped-{int(time.time())}"
    dest, k = path.with_name(base), 1
    while dest.exists():
        dest, k = path.with_name(f"{base}-{k}"), k + 1
    path.rename(dest)
    log.warning("checkpoint %s moved aside to %s", store.label(path), dest.name)
    return dest


def owner_module(state: Mapping[str, Any], kinds: dict[str, str], key: str) -> nn.Module:
    """The module in ``state`` whose parameters ``state[key]`` (an optimizer) updates."""
    opt = state[key]
    first = next((p for g in opt.param_groups for p in g["params"]), None)
    for k, kind in kinds.items():
        if kind == "module" and first is not None and any(p is first for p in state[k].parameters()):
            return state[k]
    raise UsageError(f"state[{key!r}] is an optimizer whose parameters belong to no module in state; "
                     f"add the model it trains (e.g. state['model'] = model)")


def dcp_state(state: Mapping[str, Any], kinds: dict[str, str], copy_buffers: bool = False) -> dict[str, Any]:
    """Modules and optimizers as DCP state dicts (unwrapped from DDP, sharded under FSDP).
    ``copy_buffers``: buffers (BatchNorm statistics) as copies made now, for a copy of the rest
    that overlaps the next forward, which changes buffers (see Checkpointer._save)."""
    owners = {k: owner_module(state, kinds, k) for k, kind in kinds.items() if kind == "optimizer"}
    got: dict[str, Any] = {}
    for k, kind in kinds.items():
        if kind != "module":
            continue
        mine = [o for o, m in owners.items() if m is state[k]]
        if len(mine) == 1:
            # One call for a module and its optimizer: each call maps every parameter to its
            # name first, the larger part of its cost on the training thread for a small model.
            got[k], got[mine[0]] = get_state_dict(state[k], state[mine[0]])
        else:
            got[k] = get_model_state_dict(state[k])
        if copy_buffers:
            bufs = {id(b) for b in state[k].buffers()}
            got[k] = {n: (t.clone() if id(t) in bufs else t) for n, t in got[k].items()}
    for k, module in owners.items():
        if k not in got:
            got[k] = get_optimizer_state_dict(module, state[k])
    return {k: got[k] for k in kinds if k in got}


def plain_of(key: str, obj: Any) -> Any:
    sd = obj.state_dict()
    if not is_plain(sd):
        raise UsageError(f"state[{key!r}].state_dict() holds something other than plain data (numbers, strings, "
                         f"tensors, lists and dicts of them), which cannot be loaded safely")
    return sd


def why(e: BaseException) -> str:
    """One line for a failure: the line naming a refused global, else the last line (for DCP's
    CheckpointException, the underlying per-rank error)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    named = [ln for ln in lines if "GLOBAL" in ln or "not allowed" in ln]
    line = (named or lines or [type(e).__name__])[-1]
    # DCP re-raises a rank's error as "module.Class: message"; hpc_train's own need no prefix.
    return line.removeprefix("hpc_train.errors.CheckpointError: ")


def app_state(state: Mapping[str, Any], kinds: dict[str, str]) -> dict[str, Any]:
    return {k: (plain_of(k, state[k]) if kind == "stateful" else state[k])
            for k, kind in kinds.items() if kind in ("stateful", "plain")}


def rank_state(state: Mapping[str, Any], kinds: dict[str, str]) -> dict[str, Any]:
    """This rank's own: RNG states, per-rank objects, and its plain values (which may differ
    from rank to rank; see hpc_train.ckpt.state)."""
    return {"rng": rng_state(),
            "objects": {k: plain_of(k, state[k]) for k, kind in kinds.items() if kind == "per_rank"},
            "plain": {k: state[k] for k, kind in kinds.items() if kind == "plain"}}


def save_pt(obj: Any, path: Path) -> str:
    """``torch.save`` into memory, then one plain write; returns the bytes' CRC32C. torch's own
    file writer reports a full disk as "[enforce fail at inline_container.cc] unexpected pos
    ..."; Python's write raises OSError ENOSPC, which the error line names. Only for the small
    files (a rank's RNG state, the app state): the buffer is a second copy."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    with open(path, "wb") as f:
        f.write(data)
    return hexdigest(extend(0, data))


def digest(obj: Any) -> str:
    """A fingerprint of a plain value, to tell whether ranks hold the same one."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return hexdigest(extend(0, buf.getvalue()))
