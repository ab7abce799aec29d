"""Sharded, atomic, asynchronous checkpoints on ``torch.distributed.checkpoint`` (DCP).

The checkpointer sees a mapping of state objects and nothing else (see :mod:`hpc_train.ckpt.state`
for what goes where). A ``step-N/`` directory holds DCP's shards and ``.metadata`` (modules and
optimizers, reshardable to another world size), ``app.pt`` (rank 0's copy of schedulers and
plain values), one ``rank-R.pt`` per rank (RNG states, loader positions) and, written last by
rank 0 once every rank's share is on disk, ``commit.json`` (see :mod:`hpc_train.ckpt.store` for
what makes a checkpoint complete).

Hazards:

* ``async_save`` on the training group deadlocks against DDP's all-reduce (measured). Saves
  use their own gloo group, created once, and only one save is ever in flight.
* DCP's reader unpickles ``.metadata`` with plain ``pickle`` and byte items with
  ``weights_only=False``. Loading a checkpoint must not run arbitrary code, so the reader
  here allows only DCP's metadata classes, and byte items load with ``weights_only=True``.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import pickle
import shutil
import time
import warnings
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch import nn

from hpc_train.ckpt import store as resume
from hpc_train.ckpt import state as state_mod
from hpc_train.config import CheckpointSection
from hpc_train.errors import CheckpointError, UsageError
from hpc_train.ckpt.state import is_plain, rng_state, set_rng_state

log = logging.getLogger("hpc_train")
# DCP says so on every single-process save/load; that is the intent here, so it is noise.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


# -- safe loading --------------------------------------------------------------------------
class _MetadataUnpickler(pickle.Unpickler):
    # Exact (module, name) pairs only. A module prefix is not enough: with pickle protocol 4 a
    # dotted name resolves attribute by attribute, so ("torch.distributed.checkpoint.filesystem",
    # "os.system") would reach os.system; and DCP's modules hold callables that write files or
    # call torch.load(weights_only=False) (tests/test_ckpt_cli.py crafts such a .metadata).
    _ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                ("pathlib", "WindowsPath"), ("collections", "OrderedDict"),
                ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                *(("torch.distributed.checkpoint.metadata", n) for n in (
                    "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                    "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"))}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # noqa: PLC0415
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


IO_THREADS = 2   # DCP FileSystemWriter threads per rank (see Checkpointer.save)
APP_FILE = "app.pt"   # rank 0's copy of the replicated non-DCP entries (schedulers, plain values)


def _dir_for(run_dir: Path, step: int) -> Path:
    return resume.ckpt_root(run_dir) / f"step-{step}"


def move_aside(path: Path) -> Path:
    """Rename a step directory to ``step-N.skipped-<unix time>[-k]`` beside it; never over another."""
    base = f"{path.name}.skipped-{int(time.time())}"
    dest, k = path.with_name(base), 1
    while dest.exists():
        dest, k = path.with_name(f"{base}-{k}"), k + 1
    path.rename(dest)
    log.warning("checkpoint %s moved aside to %s", path, dest.name)
    return dest


def _rank_file(path: Path, rank: int) -> Path:
    return path / f"rank-{rank}.pt"


def _save_pt(obj: Any, path: Path) -> None:
    """``torch.save`` into memory, then one plain write. torch's own file writer reports a full
    disk as "[enforce fail at inline_container.cc] unexpected pos ..."; Python's write raises
    OSError ENOSPC, which the error line names. Only for the small files (a rank's RNG state,
    the app state): the buffer is a second copy."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    with open(path, "wb") as f:
        f.write(buf.getbuffer())


def _owner_module(state: Mapping[str, Any], kinds: dict[str, str], key: str) -> nn.Module:
    """The module in ``state`` whose parameters ``state[key]`` (an optimizer) updates."""
    opt = state[key]
    first = next((p for g in opt.param_groups for p in g["params"]), None)
    for k, kind in kinds.items():
        if kind == "module" and first is not None and any(p is first for p in state[k].parameters()):
            return state[k]
    raise UsageError(f"state[{key!r}] is an optimizer whose parameters belong to no module in state; "
                     f"add the model it trains (e.g. state['model'] = model)")


def _dcp_state(state: Mapping[str, Any], kinds: dict[str, str], copy_buffers: bool = False) -> dict[str, Any]:
    """Modules and optimizers as DCP state dicts (unwrapped from DDP, sharded under FSDP).
    ``copy_buffers``: buffers (BatchNorm statistics) as copies made now, for a copy of the rest
    that overlaps the next forward, which changes buffers (see Checkpointer._save)."""
    out: dict[str, Any] = {}
    for k, kind in kinds.items():
        if kind == "module":
            sd = get_model_state_dict(state[k])
            if copy_buffers:
                bufs = {id(b) for b in state[k].buffers()}
                sd = {n: (t.clone() if id(t) in bufs else t) for n, t in sd.items()}
            out[k] = sd
        elif kind == "optimizer":
            out[k] = get_optimizer_state_dict(_owner_module(state, kinds, k), state[k])
    return out


def _plain_of(key: str, obj: Any) -> Any:
    sd = obj.state_dict()
    if not is_plain(sd):
        raise UsageError(f"state[{key!r}].state_dict() holds something other than plain data (numbers, strings, "
                         f"tensors, lists and dicts of them), which cannot be loaded safely")
    return sd


def _app_state(state: Mapping[str, Any], kinds: dict[str, str]) -> dict[str, Any]:
    return {k: (_plain_of(k, state[k]) if kind == "stateful" else state[k])
            for k, kind in kinds.items() if kind in ("stateful", "plain")}


def _rank_state(state: Mapping[str, Any], kinds: dict[str, str]) -> dict[str, Any]:
    return {"rng": rng_state(),
            "objects": {k: _plain_of(k, state[k]) for k, kind in kinds.items() if kind == "per_rank"}}


def _save_error(e: BaseException, step: int, run_dir: Path) -> BaseException:
    """One line for a save that failed (a full disk, a lost peer): DCP's CheckpointException
    holds every rank's traceback; the last line is the cause."""
    if isinstance(e, (UsageError, CheckpointError)):
        return e
    return CheckpointError(f"cannot save checkpoint step {step} in {resume.ckpt_root(run_dir)}: {_why(e)} "
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
        kinds = kinds or state_mod.kinds(state)
        self.wait()                      # one save in flight (see module docstring)
        path = _dir_for(self.run_dir, step)
        if self.rank == 0 and path.exists():
            # A leftover from a run we did not resume from (skipped as incomplete or damaged):
            # move it aside rather than write into it or delete it.
            move_aside(path)
        if self.pg is not None:
            dist.barrier(group=self.pg)
        path.mkdir(parents=True, exist_ok=True)
        self.written.add(step)
        _save_pt(_rank_state(state, kinds), _rank_file(path, self.rank))
        if self.rank == 0:
            _save_pt(_app_state(state, kinds), path / APP_FILE)
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
        dcp_state = _dcp_state(state, kinds, copy_buffers=overlap)
        # IO_THREADS writer threads per rank: one thread's fsync overlaps another's serialization
        # (234 MB, 2 ranks, 2 cores: fsync'd saves 15-35% faster than DCP's default of 1;
        # benchmarks/checkpoint.py). For a 14 MB state, one thread measured no better (4
        # interleaved runs of benchmarks/overhead.py with a save every 10 steps: 0.97x).
        writer = dcp.FileSystemWriter(str(path), thread_count=IO_THREADS, sync_files=True)
        kw = dict(storage_writer=writer, process_group=self.pg, no_dist=self.no_dist)
        if self.cfg.async_save and not blocking:
            if self.stager is not None and self._stager_overlaps != overlap:
                self.stager.close()
                self.stager = None
            if self.stager is None:
                # One stager for the run keeps its CPU copy of the state between saves, so a save copies
                # into warm buffers instead of allocating and faulting in the state's size again (DCP's
                # default: a new stager per call). 234 MB on 2 ranks: the save blocks for 0.04-0.08 s instead
                # of 0.11-0.23 s (benchmarks/checkpoint.py). The copy stays allocated between saves (DCP's
                # default allocates as much at every save). Safe: one save in flight (wait() above), so no
                # background write still reads the buffers when the next save refills them.
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
                # On GPU, stage into pinned memory with non-blocking copies (torchtitan's
                # async_with_pinned_mem); on CPU, pinned memory and streams do not apply.
                gpu = torch.cuda.is_available()
                self.stager = DefaultStager(StagingOptions(gpu, False, overlap, gpu and overlap))
                self._stager_overlaps = overlap
            res = dcp.async_save(dcp_state, async_stager=self.stager, **kw)
            if overlap:
                self.staging, fut = res.staging_completion, res.upload_completion
            else:
                fut = res
            self.pending = (self._committed_when_written(fut, step, t0, kinds), step)
        else:
            dcp.save(dcp_state, **kw)
            done: Future = Future()
            done.set_result(None)
            self.pending = (self._committed_when_written(done, step, t0, kinds), step)
            self.wait()
        self.stats.append({"step": step, "blocked_s": time.perf_counter() - t0})
        self.last_save_t, self.last_step = time.monotonic(), step

    def _committed_when_written(self, written: Future, step: int, t0: float, kinds: dict[str, str]) -> Future:
        """A future that completes once ``written`` has and, on rank 0, the commit record is
        durable and old checkpoints are pruned. The commit runs on the thread that finishes the
        write (DCP's save thread), not the training thread: its CRC-32 pass, three fsyncs and the
        prune's rmtree cost rank 0 10-25 ms per save, and every other rank waits for rank 0 at
        the next all-reduce (py-spy on jobs/charlm.py: the largest share of a save's stall).
        Safe: one save in flight, and the next save, ``close`` and a stop all ``wait`` first."""
        committed: Future = Future()

        def finish(f: Future) -> None:
            try:
                f.result()   # every rank: its share is written. Rank 0: .metadata is written too.
                if self.rank == 0:
                    self._commit(step, time.perf_counter() - t0, kinds)
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

    def _commit(self, step: int, seconds: float, kinds: dict[str, str]) -> None:
        path = _dir_for(self.run_dir, step)
        if self.world > 1:
            # Rank 0's future completes after DCP gathered every rank's write results, but the
            # small per-rank files were written before; check they are all there.
            missing = [r for r in range(self.world) if not _rank_file(path, r).exists()]
            if missing:
                raise CheckpointError(f"{path}: rank files missing for ranks {missing}")
        resume.write_commit(path, {**self.record, "step": step, "time": time.time(), "world_size": self.world,
                                   "torch": torch.__version__, "state": kinds, "save_seconds": round(seconds, 4)})
        log.info("checkpoint committed: %s (%.2fs)", path, seconds)
        self._prune(step)

    def _prune(self, committed: int | None = None) -> None:
        """Delete only complete checkpoints beyond ``keep``. What resume passed over (damaged or
        never finished: newer than the step resumed from, and not written by this run) and
        anything incomplete (a crash leftover) is moved aside, never deleted, and never counts
        toward ``keep`` (a damaged save kept in place of an intact one). Only the newest
        checkpoint.keep_skipped moved-aside copies are kept."""
        infos = resume.scan(self.run_dir)
        floor = committed if self.resumed_from is None else self.resumed_from

        def skipped(i: resume.CkptInfo) -> bool:
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
        for old in resume.moved_aside(self.run_dir)[self.cfg.keep_skipped:]:
            shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        self.wait()
        for handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()
        if self.stager is not None:
            self.stager.close()
            self.stager = None


# -- load --------------------------------------------------------------------------------
def _why(e: BaseException) -> str:
    """One line for a load failure: the line naming a refused global, else the last line (for
    DCP's CheckpointException, the underlying per-rank error)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    named = [ln for ln in lines if "GLOBAL" in ln or "not allowed" in ln]
    return (named or lines or [type(e).__name__])[-1]


def _safe_torch_load(path: Path) -> Any:
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - e.g. a pickle that names a forbidden global
        raise CheckpointError(f"cannot load {path}: {_why(e)}") from None


def check_keys(path: Path, saved: dict[str, str] | None, kinds: dict[str, str]) -> None:
    """The checkpoint's entries must be the state's: name what is missing and what is extra."""
    if saved is None:
        return
    missing, extra = sorted(set(kinds) - set(saved)), sorted(set(saved) - set(kinds))
    changed = sorted(k for k in set(kinds) & set(saved) if kinds[k] != saved[k])
    if missing or extra or changed:
        parts = ([f"in state but not in the checkpoint: {', '.join(missing)}"] if missing else []) + \
                ([f"in the checkpoint but not in state: {', '.join(extra)}"] if extra else []) + \
                ([f"of another kind: " + ", ".join(f"{k} (saved {saved[k]}, now {kinds[k]})" for k in changed)]
                 if changed else [])
        raise UsageError(f"checkpoint {path} does not match state ({'; '.join(parts)}); restore with the same "
                         f"state keys it was saved with, or start a new run directory")


def load(state: dict[str, Any], path: Path, rank: int, world_size: int,
         kinds: dict[str, str] | None = None) -> dict[str, Any]:
    """Restore ``state`` in place from a complete checkpoint (resharding if the world size
    changed). Returns the commit record."""
    info = resume.inspect(path)
    if not info.complete:
        raise CheckpointError(f"checkpoint {path} is not complete: {info.problem}")
    kinds = kinds or state_mod.kinds(state)
    check_keys(path, info.record.get("state"), kinds)
    dcp_state = _dcp_state(state, kinds)
    if dcp_state:
        try:
            dcp.load(dcp_state, storage_reader=SafeReader(str(path)), planner=SafePlanner(),
                     process_group=None, no_dist=not (dist.is_initialized() and world_size > 1))
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's CheckpointException (a BaseException!)
            # wraps per-rank errors; its last line is the underlying error, e.g. a size mismatch.
            why = _why(e)
            hint = " (does the model match the one it was saved with?)" if "mismatch" in why else ""
            raise CheckpointError(f"cannot load checkpoint {path}: {why}{hint}") from None
        for k, kind in kinds.items():
            if kind == "module":
                set_model_state_dict(state[k], dcp_state[k])
        for k, kind in kinds.items():
            if kind == "optimizer":
                set_optimizer_state_dict(_owner_module(state, kinds, k), state[k], dcp_state[k])
    app = _safe_torch_load(path / APP_FILE)
    for k, kind in kinds.items():
        if kind == "stateful":
            state[k].load_state_dict(app[k])
        elif kind == "plain":
            state[k] = app[k]
    saved = info.record.get("world_size")
    if saved == world_size:
        mine = _safe_torch_load(_rank_file(path, rank))
        for k, kind in kinds.items():
            if kind == "per_rank":
                state[k].load_state_dict(mine["objects"][k])
        set_rng_state(mine["rng"])
    else:
        # Another world size: per-rank RNG streams do not carry over; loaders continue after the
        # same number of samples where they know how (hpc_train.node.loader.ShardedLoader), else restart.
        first = _safe_torch_load(_rank_file(path, 0))
        for k, kind in kinds.items():
            if kind != "per_rank":
                continue
            if hasattr(state[k], "load_resharded"):
                state[k].load_resharded(first["objects"][k], saved or world_size)
            else:
                log.warning("state[%r] cannot continue at world size %d from a checkpoint saved at %s; it "
                            "starts from its beginning", k, world_size, saved)
    return info.record


def export(path: Path, out: Path) -> int:
    """A consolidated model ``state_dict`` that ``torch.load(out, weights_only=True)`` reads."""
    try:
        meta = SafeReader(str(path)).read_metadata()
        state: dict[str, Any] = {}
        for fqn, md in meta.state_dict_metadata.items():
            if fqn.startswith("model.") and hasattr(md, "size"):
                state[fqn] = torch.empty(md.size, dtype=md.properties.dtype)
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafePlanner(), no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - one clear line, not a traceback
        raise CheckpointError(f"cannot load checkpoint {path}: {_why(e)}") from None
    model = {k[len("model."):]: v for k, v in state.items()}
    # The temporary file is opened exclusively: an existing "OUT.tmp" is not ours to overwrite.
    tmp = Path(str(out) + ".tmp")
    try:
        with open(tmp, "xb") as f:
            torch.save(model, f)      # streamed: a model-sized buffer would double the memory
    except FileExistsError:
        raise CheckpointError(f"{tmp} exists (left over from an interrupted export?); remove it first") from None
    except (OSError, RuntimeError) as e:
        # torch's writer reports a full disk as "enforce fail ... unexpected pos": name it.
        if not isinstance(e, OSError) and shutil.disk_usage(tmp.parent).free < (1 << 20):
            e = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        tmp.unlink(missing_ok=True)   # ours (opened exclusively above) and incomplete
        raise CheckpointError(f"cannot write {out}: {_why(e)}") from None
    tmp.replace(out)
    return len(model)
