"""Loading a checkpoint into a mapping of state objects (resharding to another world size).

Each rank checks the checksums of what it reads as it reads it (:mod:`hpc_train.ckpt.safe`), so
nothing is read twice and no rank reads what it does not load. A mismatch raises
:class:`CheckpointError`, like any failed load: :meth:`hpc_train.run.Run.restore` then moves every
rank on to the next older checkpoint together.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

from hpc_train.ckpt import store
from hpc_train.ckpt.checksum import Checks
from hpc_train.ckpt.common import APP_FILE, dcp_state, owner_module, rank_file, why
from hpc_train.ckpt.local import flat
from hpc_train.ckpt.safe import SafePlanner, SafeReader, safe_torch_load
from hpc_train.ckpt.state import kinds_of, set_rng_state
from hpc_train.errors import CheckpointError, UsageError

__all__ = ["CheckpointError", "check_keys", "load"]
log = logging.getLogger("hpc_train")


def check_keys(path: Path, saved: dict[str, str] | None, kinds: dict[str, str]) -> None:
    """The checkpoint's entries must be the state's: name what is missing and what is extra."""
    if saved is None:
        return
    missing, extra = sorted(set(kinds) - set(saved)), sorted(set(saved) - set(kinds))
    changed = sorted(k for k in set(kinds) & set(saved) if kinds[k] != saved[k])
    if missing or extra or changed:
        parts = ([f"in state but not in the checkpoint: {', '.join(missing)}"] if missing else []) + \
                ([f"in the checkpoint but not in state: {', '.join(extra)}"] if extra else []) + \
                (["of another kind: " + ", ".join(f"{k} (saved {saved[k]}, now {kinds[k]})" for k in changed)]
                 if changed else [])
        raise UsageError(f"checkpoint {store.label(path)} does not match state ({'; '.join(parts)}); restore with "
                         f"the same state keys it was saved with, or start a new run directory")


def load(state: dict[str, Any], path: Path, rank: int, world_size: int,
         kinds: dict[str, str] | None = None, single: bool = False) -> dict[str, Any]:
    """Restore ``state`` in place from a complete checkpoint (resharding if the world size
    changed), checking the checksums of every byte read. Returns the commit record. A
    :class:`CheckpointError` says why the checkpoint does not load; the caller names it.
    ``single``: one rank's own item of the local tier (:mod:`hpc_train.ckpt.local.tier`), read by
    this rank alone, with no collective."""
    info = store.inspect(path)
    if not info.complete:
        raise CheckpointError(f"not complete: {info.problem}")
    kinds = kinds or kinds_of(state)
    check_keys(path, info.record.get("state"), kinds)
    checks = Checks(path, info.record)
    saved = info.record.get("world_size")
    mine = None
    if single or "layout" in info.record:
        mine = _load_local_item(state, kinds, path, info.record, rank, world_size, checks)
    elif dcp_st := dcp_state(state, kinds):
        _load_dcp(state, kinds, dcp_st, path, world_size, checks)
    app = safe_torch_load(path / APP_FILE, checks)
    for k, kind in kinds.items():
        if kind == "stateful":
            state[k].load_state_dict(app[k])
    if saved == world_size:
        if mine is None:
            # A shared checkpoint's own file is read after DCP's load, a collective that every
            # rank must enter even when its own file is bad (it then fails after it, with the rest).
            mine = safe_torch_load(rank_file(path, rank), checks)
        # This rank's own plain values; a checkpoint from before they were saved per rank has
        # only rank 0's, in app.pt.
        plain = mine.get("plain", {}) if isinstance(mine, dict) else {}
        for k, kind in kinds.items():
            if kind == "plain":
                state[k] = plain[k] if k in plain else app[k]
            elif kind == "per_rank":
                state[k].load_state_dict(mine["objects"][k])
        set_rng_state(mine["rng"])
        for k, kind in kinds.items():
            if kind in ("per_rank", "stateful"):
                _no_draw_at_next_iter(state[k])
        return info.record
    _load_at_other_world_size(state, kinds, path, info.record, app, rank, world_size, checks)
    return info.record


def _load_dcp(state: dict[str, Any], kinds: dict[str, str], dcp_st: dict[str, Any], path: Path, world_size: int,
              checks: Checks) -> None:
    """Modules and optimizers through DCP (resharding), its errors made one line a user can act on."""
    no_dist = not (dist.is_initialized() and world_size > 1)
    try:
        reader = SafeReader(str(path), checks)
        reader.read_metadata()    # checked before DCP reads it (see SafeReader)
        dcp.load(dcp_st, storage_reader=reader, planner=SafePlanner(), process_group=None, no_dist=no_dist)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's CheckpointException (a BaseException!)
        # wraps per-rank errors; its last line is the underlying error, e.g. a size mismatch.
        w = why(e)
        hint = " (does the model match the one it was saved with?)" if "mismatch" in w else ""
        raise CheckpointError(f"{w}{hint}") from None
    for k, kind in kinds.items():
        if kind == "module":
            set_model_state_dict(state[k], dcp_st[k])
    for k, kind in kinds.items():
        if kind == "optimizer":
            set_optimizer_state_dict(owner_module(state, kinds, k), state[k], dcp_st[k])


def _load_at_other_world_size(state: dict[str, Any], kinds: dict[str, str], path: Path, record: dict[str, Any],
                              app: dict[str, Any], rank: int, world_size: int, checks: Checks) -> None:
    """Plain and per-rank values saved at another world size: what can carry over does, the rest is named."""
    # Per-rank RNG streams do not carry over; loaders continue after the same number of samples
    # where they know how (hpc_train.node.loader.ShardedLoader), else restart. Plain values:
    # rank 0's for every rank; the same value on every rank when saved (the usual case) is
    # exact, and those that differed are named.
    saved = record.get("world_size")
    differs = set(record.get("differs_by_rank", []))
    for k, kind in kinds.items():
        if kind == "plain":
            state[k] = app[k]
            if k in differs and rank == 0:
                log.warning("state[%r] differed from rank to rank in the checkpoint saved at world size %s; at "
                            "world size %d every rank gets rank 0's value", k, saved, world_size)
    first = safe_torch_load(rank_file(path, 0), checks)
    for k, kind in kinds.items():
        if kind != "per_rank":
            continue
        if hasattr(state[k], "load_resharded"):
            state[k].load_resharded(first["objects"][k], saved or world_size)
        else:
            log.warning("state[%r] cannot continue at world size %d from a checkpoint saved at %s; it "
                        "starts from its beginning", k, world_size, saved)


def _load_local_item(state: dict[str, Any], kinds: dict[str, str], path: Path, record: dict[str, Any], rank: int,
                     world_size: int, checks: Checks) -> dict[str, Any]:
    """A local item's modules and optimizers (:mod:`hpc_train.ckpt.local.flat`); returns this rank's
    own file, which holds the item's layout."""
    layout, saved = record.get("layout"), record.get("world_size")
    if layout != flat.LAYOUT:
        raise CheckpointError(f"a local item of layout {str(layout)[:40]!r}, which this version of hpc_train does not "
                              f"read (it reads {flat.LAYOUT!r})")
    if saved != world_size or record.get("rank") != rank:
        raise CheckpointError(f"a local item loads for the rank and world size it was saved at (rank "
                              f"{record.get('rank')} of {saved}), not rank {rank} of {world_size}")
    mine = safe_torch_load(rank_file(path, rank), checks)
    skeleton = mine.get(flat.KEY) if isinstance(mine, dict) else None
    if skeleton is None:
        raise CheckpointError(f"{rank_file(path, rank).name} holds no layout for this item's tensors")
    flat.restore(state, kinds, skeleton, flat.read(path, skeleton, checks))
    return mine


def _no_draw_at_next_iter(loader: Any) -> None:
    """A restored StatefulDataLoader's next iterator leaves torch's RNG as it found it. Each
    iterator draws its base seed from torch's global RNG (without a ``generator`` of the
    loader's own); the run that never stopped drew it at the epoch's start, before the save,
    and the restored RNG state is the one after it: drawn again by the resumed loop's
    ``iter()``, it would shift every later random number (dropout masks). The loader's own state
    holds what the draw would give (its base seed), so the draw is undone, once. Hazard: this
    wraps torchdata's own ``_get_iterator`` (every iterator comes from it, ``state_dict()``'s
    too) on the instance; a torchdata release that renames it leaves the draw in place, which
    ``tests/guarantees/test_claims.py`` catches."""
    if not type(loader).__module__.startswith("torchdata.") or not callable(getattr(loader, "_get_iterator", None)):
        return
    make = loader._get_iterator

    def once():
        del loader._get_iterator       # the class's own from now on
        rng = torch.get_rng_state()
        try:
            return make()
        finally:
            torch.set_rng_state(rng)
    loader._get_iterator = once
