"""The restore protocol: every rank resumes from the same checkpoint, or fails together.

Rank 0 chooses (complete by sizes) and the other ranks take its choice; each rank checks the
checksums of what it loads as it reads it (:mod:`hpc_train.ckpt.safe`), so no byte is read
twice. If the chosen checkpoint fails to load (or to verify) on any rank, every rank moves on
together to the next older complete one, until one loads or none is left. A rank that failed
alone would otherwise sit in its next collective while the others wait in theirs: a hang until
``dist.timeout_s``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpc_train.advice import VARIABLES, Advice
from hpc_train import rundir
from hpc_train.ckpt import load
from hpc_train.ckpt import store
from hpc_train.errors import CheckpointError, UsageError

log = logging.getLogger("hpc_train")
_PATH_BYTES = 4096   # a checkpoint path, broadcast as a fixed-size byte tensor (any backend)


def restore(state: dict[str, Any], run_dir: Path, *, rank: int, world_size: int, device: torch.device,
            multi: bool, kinds: Mapping[str, str], spec: str, requeued: bool = False,
            advice: Advice = VARIABLES, local=None) -> store.CkptInfo | None:
    """Load the agreed checkpoint into ``state``; returns what was loaded, None when fresh.
    ``spec``: ``latest``, ``none`` (the launcher already moved old checkpoints aside) or a path;
    ``requeued``: a requeued job goes on from its own newest checkpoint, not a given path;
    ``advice``: how the user speaks to hpc_train (an error's way out names ``--resume``, or
    ``HPC_TRAIN_RESUME`` in their own program). ``local``: this rank's :class:`hpc_train.ckpt.local.tier.LocalTier`,
    tried first when it holds a step at least as new as the shared tier's (see :func:`_local_allowed`). When none loads: one :class:`CheckpointError` naming each."""
    t0 = time.perf_counter()
    use_local = local is not None and _local_allowed(spec, requeued)
    told = _hook_choice() if use_local else None
    if told is not None:
        # The hook chose "in place, from the node-local tier at step N": checked against what the
        # ranks hold, without planning the shared tier (nothing of it is read).
        item, damaged = _from_local(state, local, told, rank, world_size, device, multi, kinds)
        if item is not None:
            return _restored_local(local, item, world_size, t0, "as the requeue hook chose")
        use_local = not damaged   # said once, by the rank that found it: the shared tier restores
        if not damaged and rank == 0:
            log.warning("the node-local tier's step %d, the requeue hook's choice, is not held for every rank; "
                        "planning the restore from both tiers", told)
    source, shared_error = _shared_source(run_dir, spec, requeued, rank, device, multi, raise_now=not use_local)
    if use_local:
        item, _ = _from_local(state, local, source.step if source is not None else -1, rank, world_size, device,
                              multi, kinds)
        if item is not None:
            if shared_error is not None and rank == 0:
                log.warning("the shared tier has no checkpoint to resume from (%s); the local tier has one",
                            str(shared_error).splitlines()[0])
            return _restored_local(local, item, world_size, t0)
    if shared_error is not None:
        raise shared_error
    source, record = _load_shared(state, source, run_dir, rank=rank, world_size=world_size, device=device,
                                  multi=multi, kinds=kinds, advice=advice)
    if local is not None:
        local.restored(source.step if source is not None else 0)
    if source is not None:
        saved = record.get("world_size")
        log.info("resumed from %s, saved at world size %s%s (shared tier, %.2fs)", source.label, saved,
                 "" if saved == world_size else f", now {world_size}: resharded", time.perf_counter() - t0)
    return source


def _shared_source(run_dir: Path, spec: str, requeued: bool, rank: int, device: torch.device, multi: bool,
                   raise_now: bool) -> tuple[store.CkptInfo | None, Exception | None]:
    """Rank 0 plans the shared tier (sizes only: each rank checks the checksums of what it loads
    as it reads it) and every rank takes its choice; with ``raise_now`` False, an error raised on
    every rank together (no shared checkpoint to resume from, say its only one was still being
    written when a rank died) is returned instead: the local tier may still serve."""
    source: store.CkptInfo | None = None
    plan_error: Exception | None = None
    if rank == 0:
        try:
            source = store.plan(run_dir, "latest" if spec == "none" else spec, None, warn=log.warning,
                                verify=False, requeued=requeued).source
        except Exception as e:  # noqa: BLE001 - raised by _agree_on, after the other ranks hear of it
            plan_error = e
    try:
        return _agree_on(source, run_dir, rank, device, multi, plan_error), None
    except (CheckpointError, UsageError) as e:
        if raise_now:
            raise
        return None, e


def _restored_local(local, item: store.CkptInfo, world_size: int, t0: float, how: str = "") -> store.CkptInfo:
    log.info("resumed from %s, saved at world size %d (local tier%s, %.2fs)", item.label, world_size,
             f", {how}" if how else "", time.perf_counter() - t0)
    local.restored(item.step)
    return item


def _hook_choice() -> int | None:
    """The step the requeue hook told this job step to restore from the node-local tier
    (``HPC_TRAIN_LOCAL_STEP``, from its typed answer), or None."""
    told = os.environ.get(rundir.LOCAL_STEP_ENV, "")
    return int(told) if rundir.name_number(told, "") is not None else None


def _load_shared(state: dict[str, Any], source: store.CkptInfo | None, run_dir: Path, *, rank: int,
                 world_size: int, device: torch.device, multi: bool, kinds: Mapping[str, str],
                 advice: Advice) -> tuple[store.CkptInfo | None, dict[str, Any]]:
    """Load ``source`` or the next older one that loads everywhere: ranks that fell back alone would hang."""
    record: dict[str, Any] = {}
    tried: list[tuple[int, str]] = []     # (step, why it did not load), for the error if none does
    is_main = rank == 0
    while source is not None:
        error: BaseException | None = None
        try:
            record = load.load(state, source.path, rank, world_size, kinds)
        except Exception as e:  # noqa: BLE001 - handled below, on every rank together
            error = e
        if multi:
            failed = torch.tensor([float(error is not None)], device=device)
            dist.all_reduce(failed)
            if error is None and failed.item() > 0:
                error = CheckpointError(f"another rank could not load it; see {Path(run_dir) / rundir.LOGS}")
        if error is None:
            break
        why = str(error).splitlines()[0] if str(error) else type(error).__name__
        tried.append((source.step, why))
        older = None
        if is_main:
            log.warning("skipping checkpoint %s: it does not load: %s", source.label, why)
            older = store.older_candidate(source, warn=log.warning)
        older = _agree_on(older, run_dir, rank, device, multi)
        if older is None:
            # State may be partly overwritten by the failed load: never train on from it.
            if isinstance(error, UsageError):   # the state does not fit (its own message says how)
                raise error
            raise CheckpointError(_none_loads(source.path.parent, tried, advice)) from None
        source = older
    return source, record


def _local_allowed(spec: str, requeued: bool) -> bool:
    """Whether the local tier may serve this restore: ``latest``, a requeue (or torchrun's
    restart), or a job step restarted in place by the batch script (``HPC_TRAIN_ATTEMPT`` above 1,
    where the hook may still name the PATH the job started from). Never ``none``, nor a PATH
    asked for at the start: local items are then older work that the request goes back from."""
    attempt = os.environ.get(rundir.ATTEMPT_ENV, "")
    return spec == "latest" or requeued or (rundir.decimal(attempt) or 0) > 1


def _from_local(state: dict[str, Any], local, floor: int, rank: int, world_size: int,
                device: torch.device, multi: bool, kinds: Mapping[str, str]) -> tuple[store.CkptInfo | None, bool]:
    """Load the local item every rank agrees on, if any: (the item, False); (None, False) when there
    is none; (None, True), every rank together, when it does not load on some rank: the shared
    tier's restore follows and overwrites whatever a failed load changed. A damaged item is one
    warning, named by the rank that found it."""
    item = local.choose(floor, device, multi)
    if item is None:
        return None, False
    error: BaseException | None = None
    try:
        if not item.complete:   # a copy that could not be fetched (see LocalTier.choose)
            raise CheckpointError(item.problem or "not complete")
        load.load(state, item.path, rank, world_size, dict(kinds), single=True)
    except Exception as e:  # noqa: BLE001 - every rank falls back together
        error = e
    failed = error is not None
    if multi:
        flag = torch.tensor([float(failed)], device=device)
        dist.all_reduce(flag)
        failed = flag.item() > 0
    if error is not None:
        why = str(error).splitlines()[0] if str(error) else type(error).__name__
        log.warning("skipping local checkpoint %s: it does not load: %s; restoring from the shared tier",
                    item.label, why)
    return (None, True) if failed else (item, False)


def _none_loads(root: Path, tried: list[tuple[int, str]], advice: Advice) -> str:
    """One line for a restore that found no checkpoint it could load: each one tried and why,
    and what to do, in the words of how this process was started (as ``run`` says it when its
    own check finds every checkpoint damaged)."""
    listing = "; ".join(f"step {step}: {why}" for step, why in tried[:5])
    how = (f"Use {advice.resume('none')} to move them aside and start over, or {advice.resume('PATH')} "
           f"to resume from another checkpoint")
    return (f"{root} holds checkpoints but none loads ({listing}); refusing to restart from scratch over "
            f"them. {how}")


def _agree_on(chosen: store.CkptInfo | None, run_dir: Path, rank: int, device: torch.device, multi: bool,
              error: Exception | None = None) -> store.CkptInfo | None:
    """Every rank takes rank 0's ``chosen`` (a CkptInfo or None). The others check only that
    the directory is complete by sizes, failing together if any rank cannot see it. ``error``:
    rank 0 could not choose; raised there, and every other rank stops too (rather than wait
    in the next collective)."""
    is_main = rank == 0
    if not multi:
        if error is not None:
            raise error
        return chosen
    failed = torch.tensor([float(error is not None)], device=device)
    dist.all_reduce(failed)
    if failed.item() > 0:
        if error is not None:
            raise error
        raise CheckpointError(f"rank 0 could not choose a checkpoint to resume; see {Path(run_dir) / rundir.LOGS}")
    buf = torch.zeros(_PATH_BYTES, dtype=torch.uint8, device=device)
    if is_main and chosen is not None:
        raw = str(chosen.path).encode()
        if len(raw) >= _PATH_BYTES:
            raise CheckpointError(f"checkpoint path longer than {_PATH_BYTES} bytes: {chosen.path}")
        buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    dist.broadcast(buf, 0)
    raw = bytes(buf.cpu().tolist()).rstrip(b"\0")
    info, problem = chosen, None
    if not is_main and raw:
        info = store.inspect(Path(raw.decode()))
        problem = None if info.complete else info.problem
    bad = torch.tensor([float(problem is not None)], device=device)
    dist.all_reduce(bad)
    if bad.item() > 0:
        raise CheckpointError(
            f"rank 0 chose {raw.decode()} but " + (f"rank {rank} finds it incomplete ({problem})"
                                                   if problem else "another rank finds it incomplete") +
            f"; is {run_dir} on a filesystem every node sees?")
    return info if raw else None
