"""Sharded, atomic, asynchronous checkpoints on ``torch.distributed.checkpoint`` (DCP): saving.

The checkpointer sees a mapping of state objects and nothing else (see :mod:`hpc_train.ckpt.state`
for what goes where, and :mod:`hpc_train.ckpt.common` for the files of a step directory). Every
file's checksum is computed as it is written (:mod:`hpc_train.ckpt.shared.crc`); rank 0 writes them into
``commit.json``, last, once every rank's share is on disk.

Hazards:

* ``async_save`` on the training group deadlocks against DDP's all-reduce (measured). Saves
  use their own gloo group, created once, and only one save is ever in flight.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from hpc_train.ckpt import store
from hpc_train.ckpt.common import (APP_FILE, app_state, dcp_state, digest, dir_for, move_aside, rank_file, rank_state,
                                   save_pt, why)
from hpc_train.ckpt.shared.crc import ChecksummingWriter
from hpc_train.ckpt.state import kinds_of
from hpc_train.config import CheckpointSection
from hpc_train.errors import CheckpointError, UsageError

log = logging.getLogger("hpc_train")

IO_THREADS = 2   # DCP FileSystemWriter threads per rank (see Checkpointer.save)


def _reusable(stager: Any) -> bool:
    """False for a DCP stager that closed itself: torch 2.11's DefaultStager closes its
    StateDictStager at the end of every stage (pytorch#183413, fixed by pytorch#183424), which
    empties its copy dispatch, and a second save with it fails (``KeyError: <class 'type'>``).
    Such a stager is replaced at each save (its cached copy is gone anyway)."""
    inner = getattr(stager, "_state_dict_stager", None)
    return inner is None or bool(getattr(inner, "_deepcopy_dispatch", True))


def _save_error(e: BaseException, step: int, run_dir: Path) -> BaseException:
    """One line for a save that failed (a full disk, a lost peer): DCP's CheckpointException
    holds every rank's traceback; the last line is the cause."""
    if isinstance(e, (UsageError, CheckpointError)):
        return e
    return CheckpointError(f"cannot save checkpoint step {step} in {store.ckpt_root(run_dir)}: {why(e)} "
                           f"(the newest complete checkpoint is kept)")


class Checkpointer:
    """Saves a mapping of state objects on schedule and on request; one save in flight; rank 0
    commits and prunes. Knows nothing of what trains: see :mod:`hpc_train.ckpt.state`."""

    def __init__(self, cfg: CheckpointSection, run_dir: Path, rank: int, world_size: int,
                 record: dict[str, Any] | None = None, timeout_s: float = 600.0) -> None:
        self.cfg, self.run_dir, self.rank, self.world = cfg, Path(run_dir), rank, world_size
        self.record = dict(record or {})     # extra fields for commit.json (config hash, ...)
        distributed = dist.is_initialized() and world_size > 1
        # A group only for checkpoints: DCP's collectives must never interleave with DDP's. It
        # gets dist.timeout_s like every group hpc_train makes (torch's default is 30 minutes:
        # a rank lost mid-save would hang the others that long).
        from datetime import timedelta
        # Also at world size 1 under NCCL: DCP's async save needs a CPU backend in the group it
        # is given, and falls back to the (NCCL-only) default group without one.
        self.pg = (dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
                   if dist.is_initialized() else None)
        self.no_dist = not distributed
        self.pending: tuple[Future, int] | None = None   # (committed, step)
        self.last_save_t = time.monotonic()
        self.last_step = -1
        self.stats: list[dict[str, float]] = []
        self.stager = None   # DCP's CPU staging, kept between async saves (see save)
        self._stager_overlaps = False
        self.staging: Future | None = None      # the last save's copy, while it runs (see _save)
        self._hooked: dict[int, Any] = {}       # optimizer id -> its step pre-hook handle
        # Set by Run.restore: the step resumed from (-1: a fresh start, or a checkpoint from
        # another run directory). Step directories newer than it that this run did not write
        # were passed over by resume (damaged, or never finished); see _prune.
        self.resumed_from: int | None = None
        self.written: set[int] = set()

    # -- schedule ----------------------------------------------------------------------------
    def due_by_time(self) -> bool:
        return bool(self.cfg.every_seconds) and time.monotonic() - self.last_save_t >= self.cfg.every_seconds

    def due(self, step: int, force: bool = False, timed: bool = False) -> bool:
        return step != self.last_step and bool(force or timed or (self.cfg.every_steps
                                                                   and step % self.cfg.every_steps == 0))

    # -- save --------------------------------------------------------------------------------
    def save(self, state: Mapping[str, Any], step: int, blocking: bool = False,
             kinds: dict[str, str] | None = None) -> None:
        try:
            self._save(state, step, blocking, kinds)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            raise _save_error(e, step, self.run_dir) from None

    def _save(self, state: Mapping[str, Any], step: int, blocking: bool,
              kinds: dict[str, str] | None) -> None:
        t0 = time.perf_counter()
        kinds = kinds or kinds_of(state)
        self.wait()                      # one save in flight (see module docstring)
        path = self._step_dir(step)
        # Checksummed as written; they reach rank 0 with DCP's write results (crc.ChecksummingWriter).
        own = {rank_file(path, self.rank).name: save_pt(rank_state(state, kinds), rank_file(path, self.rank))}
        if self.rank == 0:
            own[APP_FILE] = save_pt(app_state(state, kinds), path / APP_FILE)
        plain = {k: digest(state[k]) for k, kind in kinds.items() if kind == "plain"}
        # Overlap: the copy of modules and optimizers runs on the stager's thread during the next
        # step's forward and backward. Parameters and optimizer state change only in an optimizer's
        # step(), which waits for the copy (a step pre-hook); buffers change in the forward, so
        # they are copied here. A checkpoint still holds exactly this step's state (the exactness
        # tests resume from such saves). Needs an optimizer in state to hang the wait on.
        wanted = self.cfg.overlap_staging == "always" or (self.cfg.overlap_staging == "auto" and torch.cuda.is_available())
        overlap = (self.cfg.async_save and wanted and not blocking
                   and any(kind == "optimizer" for kind in kinds.values()))
        if overlap:
            self._hook_optimizers(state, kinds)
        dcp_st = dcp_state(state, kinds, copy_buffers=overlap)
        # IO_THREADS writer threads per rank: one thread's fsync overlaps another's serialization,
        # so a large fsync'd save is faster than with DCP's default of one (benchmarks/checkpoint.py
        # measures it); a small state gains nothing from a single thread either (benchmarks/overhead.py).
        # An async save writes behind the loop with one thread, at a lower priority: the training
        # threads keep the CPU (a sync save has the machine to itself: IO_THREADS, full priority).
        background = self.cfg.async_save and not blocking
        writer = ChecksummingWriter(str(path), own=own, facts={"plain": plain},
                                    thread_count=1 if background else IO_THREADS, sync_files=True,
                                    background=background)
        kw = dict(storage_writer=writer, process_group=self.pg, no_dist=self.no_dist)
        if self.cfg.async_save and not blocking:
            res = dcp.async_save(dcp_st, async_stager=self._stager_for(overlap), **kw)
            if overlap:
                self.staging, fut = res.staging_completion, res.upload_completion
            else:
                fut = res
            self.pending = (self._committed_when_written(fut, step, t0, kinds, writer), step)
        else:
            dcp.save(dcp_st, **kw)
            done: Future = Future()
            done.set_result(None)
            self.pending = (self._committed_when_written(done, step, t0, kinds, writer), step)
            self.wait()
        self.stats.append({"step": step, "blocked_s": time.perf_counter() - t0})
        self.last_save_t, self.last_step = time.monotonic(), step

    def _step_dir(self, step: int) -> Path:
        """The step's directory, new and made on every rank (after rank 0 moved aside a leftover
        of a run not resumed from: skipped as incomplete or damaged, never written into or
        deleted)."""
        path = dir_for(self.run_dir, step)
        if self.rank == 0 and path.exists():
            move_aside(path)
        if self.pg is not None:
            dist.barrier(group=self.pg)
        path.mkdir(parents=True, exist_ok=True)
        self.written.add(step)
        return path

    def _stager_for(self, overlap: bool):
        """One stager for the run keeps its CPU copy of the state between saves, so a save copies
        into warm buffers instead of allocating and faulting in the state's size again (DCP's
        default: a new stager per call), so the loop is blocked for a shorter time at each save
        (benchmarks/checkpoint.py measures it). The copy stays allocated between saves (DCP's
        default allocates as much at every save). Safe: one save in flight (wait()), so no
        background write still reads the buffers when the next save refills them."""
        if self.stager is not None and (self._stager_overlaps != overlap or not _reusable(self.stager)):
            self.stager.close()
            self.stager = None
        if self.stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            # On GPU, stage into pinned memory with non-blocking copies (torchtitan's
            # async_with_pinned_mem); on CPU, pinned memory and streams do not apply.
            gpu = torch.cuda.is_available()
            self.stager = DefaultStager(StagingOptions(gpu, False, overlap, gpu and overlap))
            self._stager_overlaps = overlap
        return self.stager

    def _committed_when_written(self, written: Future, step: int, t0: float, kinds: dict[str, str],
                                writer: ChecksummingWriter) -> Future:
        """A future that completes once ``written`` has and, on rank 0, the commit record is
        durable and old checkpoints are pruned. The commit runs on the thread that finishes the
        write (DCP's save thread), not the training thread: its fsyncs and the prune's rmtree
        cost rank 0 milliseconds per save, and every other rank waits for rank 0 at
        the next all-reduce (py-spy on jobs/charlm.py: the largest share of a save's stall).
        Safe: one save in flight, and the next save, ``close`` and a stop all ``wait`` first."""
        committed: Future = Future()

        def finish(f: Future) -> None:
            try:
                f.result()   # every rank: its share is written. Rank 0: .metadata is written too.
                if self.rank == 0:
                    self._commit(step, time.perf_counter() - t0, kinds, writer)
                committed.set_result(None)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread by wait()
                committed.set_exception(e)
        written.add_done_callback(finish)
        return committed

    def _hook_optimizers(self, state: Mapping[str, Any], kinds: dict[str, str]) -> None:
        for k, kind in kinds.items():
            opt = state[k]
            if kind == "optimizer" and id(opt) not in self._hooked:
                self._hooked[id(opt)] = opt.register_step_pre_hook(lambda *_: self.wait_staged())

    def wait_staged(self) -> None:
        """Block until the last save's copy of the state is made (an optimizer's step pre-hook:
        the weights must not change under the copy). A failed copy is raised by ``wait``."""
        staging, self.staging = self.staging, None
        if staging is not None:
            t0 = time.perf_counter()
            try:
                staging.result()
            except BaseException:  # noqa: BLE001 - the upload future fails too; wait() raises it in one line
                pass
            if self.stats:
                self.stats[-1]["staging_wait_s"] = time.perf_counter() - t0

    def poll(self) -> None:
        """Raise a failed async save without waiting for an unfinished one (rank 0 commits in
        the background: see _committed_when_written)."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        if self.pending is None:
            return
        fut, step = self.pending
        self.pending, self.staging = None, None   # written implies copied
        try:
            fut.result()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - see save
            raise _save_error(e, step, self.run_dir) from None

    def _commit(self, step: int, seconds: float, kinds: dict[str, str], writer: ChecksummingWriter) -> None:
        path = dir_for(self.run_dir, step)
        if self.world > 1:
            # Rank 0's future completes after DCP gathered every rank's write results, but the
            # small per-rank files were written before; check they are all there.
            missing = [r for r in range(self.world) if not rank_file(path, r).exists()]
            if missing:
                raise CheckpointError(f"{path}: rank files missing for ranks {missing}")
        # Plain values that differ across ranks: each rank gets its own back at the same world
        # size; at another, rank 0's with a warning naming them (see hpc_train.ckpt.load).
        digests = [f["plain"] for f in writer.facts if isinstance(f, dict)]
        differs = sorted(k for k in kinds if kinds[k] == "plain" and len({d.get(k) for d in digests}) > 1)
        store.write_commit(path, {**self.record, "step": step, "time": time.time(), "world_size": self.world,
                                   "torch": torch.__version__, "state": kinds, "save_seconds": round(seconds, 4),
                                   **({"differs_by_rank": differs} if differs else {})},
                            sums=writer.checksums, warn=log.warning)
        log.info("checkpoint %s committed (%.2fs)", store.label(path), seconds)
        self._prune(step)

    def _prune(self, committed: int | None = None) -> None:
        """Delete only complete checkpoints beyond ``keep``. What resume passed over (damaged or
        never finished: newer than the step resumed from, and not written by this run) and
        anything incomplete (a crash leftover) is moved aside, never deleted, and never counts
        toward ``keep`` (a damaged save kept in place of an intact one). Only the newest
        checkpoint.keep_skipped moved-aside copies are kept."""
        infos = store.scan(self.run_dir)
        floor = committed if self.resumed_from is None else self.resumed_from

        def skipped(i: store.CkptInfo) -> bool:
            # One save in flight, and rank 0 commits before the next one starts: no step directory
            # newer than `committed` is being written by this run while this runs.
            return floor is not None and i.step > floor and i.step not in self.written

        complete = [i for i in infos if i.complete and not skipped(i)]
        if not complete:
            return
        newest = complete[0].step
        keep = {i.step for i in complete[: self.cfg.keep]}
        for info in infos:
            if skipped(info):
                move_aside(info.path)
            elif not info.complete:
                if info.step < newest:     # a newer one may be a save still being written
                    move_aside(info.path)
            elif info.step not in keep:
                shutil.rmtree(info.path, ignore_errors=True)
        for old in store.moved_aside(self.run_dir)[self.cfg.keep_skipped:]:
            shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        self.wait()
        for handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()
        if self.stager is not None:
            self.stager.close()
            self.stager = None


