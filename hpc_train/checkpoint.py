"""Sharded, atomic, asynchronous checkpoints on ``torch.distributed.checkpoint`` (DCP).

Save: model and optimizer through ``get_state_dict`` (sharded by DCP, reshardable to another
world size), the schedule and progress alongside, and one small ``rank-R.pt`` per rank with its
RNG states and loader position. Rank 0 writes ``commit.json`` when the save has finished on
every rank (see :mod:`hpc_train.resume` for what makes a checkpoint complete).

Hazards:

* ``async_save`` on the training group deadlocks against DDP's all-reduce (measured). Saves
  use their own gloo group, created once, and only one save is ever in flight.
* DCP's reader unpickles ``.metadata`` with plain ``pickle`` and byte items with
  ``weights_only=False``. Loading a checkpoint must not run arbitrary code, so the reader
  here allows only DCP's metadata classes, and byte items load with ``weights_only=True``.
"""

from __future__ import annotations

import io
import logging
import pickle
import shutil
import time
import warnings
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hpc_train import resume
from hpc_train.config import CheckpointSection, Config

if TYPE_CHECKING:
    from hpc_train.trainer import Trainer

log = logging.getLogger("hpc_train")
# DCP says so on every single-process save/load; that is the intent here, so it is noise.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names it and says why."""


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


# -- per-rank state in plain types (loadable with weights_only=True) ------------------------
def _to_plain(st: dict[str, Any]) -> dict[str, Any]:
    rng = st["rng"]
    np_state = rng["numpy"]
    out = {"rng": {"python": [rng["python"][0], list(rng["python"][1]), rng["python"][2]],
                   "numpy": [np_state[0], torch.from_numpy(np.asarray(np_state[1]).astype(np.int64)),
                             int(np_state[2]), int(np_state[3]), float(np_state[4])],
                   "torch": rng["torch"]}}
    if "cuda" in rng:
        out["rng"]["cuda"] = list(rng["cuda"])
    if "loader" in st:
        out["loader"] = st["loader"]
    return out


def _from_plain(st: dict[str, Any]) -> dict[str, Any]:
    rng = st["rng"]
    n = rng["numpy"]
    out = {"rng": {"python": (rng["python"][0], tuple(rng["python"][1]), rng["python"][2]),
                   "numpy": (n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]),
                   "torch": rng["torch"]}}
    if "cuda" in rng:
        out["rng"]["cuda"] = rng["cuda"]
    if "loader" in st:
        out["loader"] = st["loader"]
    return out


IO_THREADS = 2   # DCP FileSystemWriter threads per rank (see Checkpointer.save)


def _dir_for(run_dir: Path, step: int) -> Path:
    return resume.ckpt_root(run_dir) / f"step-{step}"


class Checkpointer:
    """Saves on schedule and on request; one save in flight; rank 0 commits and prunes."""

    def __init__(self, cfg: Config, run_dir: Path, rank: int, world_size: int) -> None:
        self.cfg: CheckpointSection = cfg.checkpoint
        self.full_cfg, self.run_dir, self.rank, self.world = cfg, Path(run_dir), rank, world_size
        distributed = dist.is_initialized() and world_size > 1
        # A group only for checkpoints: DCP's collectives must never interleave with DDP's.
        self.pg = dist.new_group(backend="gloo") if distributed else None
        self.no_dist = not distributed
        self.pending: tuple[Future, int, float] | None = None
        self.last_save_t = time.monotonic()
        self.last_step = -1
        self.stats: list[dict[str, float]] = []
        self.stager = None   # DCP's CPU staging, kept between async saves (see save)

    # -- schedule ----------------------------------------------------------------------------
    def due_by_time(self) -> bool:
        return bool(self.cfg.every_seconds) and time.monotonic() - self.last_save_t >= self.cfg.every_seconds

    def after_step(self, trainer: Trainer, force: bool = False, timed: bool = False) -> None:
        step = trainer.progress.step
        if self.rank == 0:
            self.poll()
        due = force or timed or (self.cfg.every_steps and step % self.cfg.every_steps == 0)
        if due and step != self.last_step:
            self.save(trainer, blocking=force)

    # -- save --------------------------------------------------------------------------------
    def save(self, trainer: Trainer, blocking: bool = False) -> None:
        t0 = time.perf_counter()
        self.wait()                      # one save in flight (see module docstring)
        step = trainer.progress.step
        path = _dir_for(self.run_dir, step)
        if self.rank == 0 and path.exists():
            # A leftover from a run we did not resume from (it was skipped as incomplete):
            # move it aside rather than write into it or delete it.
            path.rename(path.with_name(f"{path.name}.skipped-{int(time.time())}"))
        if self.pg is not None:
            dist.barrier(group=self.pg)
        path.mkdir(parents=True, exist_ok=True)
        torch.save(_to_plain(trainer.rank_state()), path / f"rank-{self.rank}.pt")
        trainer.sync_buffers()
        model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
        state = {"model": model_sd, "optim": optim_sd,
                 "trainer": {"scheduler": trainer.scheduler.state_dict(), "progress": asdict(trainer.progress)}}
        # IO_THREADS writer threads per rank: one thread's fsync overlaps another's serialization
        # (234 MB, 2 ranks, 2 cores: fsync'd saves 15-35% faster than DCP's default of 1; benchmarks/checkpoint.py).
        writer = dcp.FileSystemWriter(str(path), thread_count=IO_THREADS, sync_files=True)
        kw = dict(storage_writer=writer, process_group=self.pg, no_dist=self.no_dist)
        if self.cfg.async_save and not blocking:
            if self.stager is None:
                # One stager for the run keeps its CPU copy of the state between saves, so a save copies
                # into warm buffers instead of allocating and faulting in the state's size again (DCP's
                # default: a new stager per call). 234 MB on 2 ranks: the save blocks for 0.04-0.08 s instead
                # of 0.11-0.23 s (benchmarks/checkpoint.py). The copy stays allocated between saves (DCP's
                # default allocates as much at every save). Safe: one save in flight (wait() above), so no
                # background write still reads the buffers when the next save refills them.
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
                self.stager = DefaultStager(StagingOptions(False, False, False, False))
            fut = dcp.async_save(state, async_stager=self.stager, **kw)
            self.pending = (fut, step, t0)
        else:
            dcp.save(state, **kw)
            done: Future = Future()
            done.set_result(None)
            self.pending = (done, step, t0)
            self.wait()
        self.stats.append({"step": step, "blocked_s": time.perf_counter() - t0})
        self.last_save_t, self.last_step = time.monotonic(), step

    def poll(self) -> None:
        """Rank 0: commit a finished async save without waiting for an unfinished one."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        if self.pending is None:
            return
        fut, step, t0 = self.pending
        self.pending = None
        fut.result()   # every rank: its share is written. Rank 0: .metadata is written too.
        if self.rank == 0:
            self._commit(step, time.perf_counter() - t0)

    def _commit(self, step: int, seconds: float) -> None:
        path = _dir_for(self.run_dir, step)
        if self.world > 1:
            # Rank 0's future completes after DCP gathered every rank's write results, but the
            # small per-rank files were written before; check they are all there.
            missing = [r for r in range(self.world) if not (path / f"rank-{r}.pt").exists()]
            if missing:
                raise CheckpointError(f"{path}: rank files missing for ranks {missing}")
        resume.write_commit(path, {"step": step, "time": time.time(), "world_size": self.world,
                                   "torch": torch.__version__, "config_hash": self.full_cfg.digest(),
                                   "model": resume.model_signature(self.full_cfg),
                                   "save_seconds": round(seconds, 4)})
        log.info("checkpoint committed: %s (%.2fs)", path, seconds)
        self._prune()

    def _prune(self) -> None:
        infos = resume.scan(self.run_dir)
        complete = [i for i in infos if i.complete]
        if not complete:
            return
        newest = complete[0].step
        keep = {i.step for i in complete[: self.cfg.keep]}
        for info in infos:
            # Older than the newest complete save and not kept: a pruned save, or a crash leftover.
            if info.step < newest and info.step not in keep:
                shutil.rmtree(info.path, ignore_errors=True)

    def close(self) -> None:
        self.wait()
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


def load(trainer: Trainer, path: Path, world_size: int) -> None:
    """Restore ``trainer`` from a complete checkpoint (resharding if the world size changed)."""
    info = resume.inspect(path)
    if not info.complete:
        raise CheckpointError(f"checkpoint {path} is not complete: {info.problem}")
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    from hpc_train.trainer import Progress
    state = {"model": model_sd, "optim": optim_sd,
             "trainer": {"scheduler": trainer.scheduler.state_dict(), "progress": asdict(Progress())}}
    try:
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafePlanner(),
                 process_group=None, no_dist=not (dist.is_initialized() and world_size > 1))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's CheckpointException (a BaseException!)
        # wraps per-rank errors; its last line is the underlying error, e.g. a size mismatch.
        why = _why(e)
        hint = " (does the model config match the one it was saved with?)" if "mismatch" in why else ""
        raise CheckpointError(f"cannot load checkpoint {path}: {why}{hint}") from None
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    trainer.scheduler.load_state_dict(state["trainer"]["scheduler"])
    saved = info.record.get("world_size")
    prog = state["trainer"]["progress"]
    for k, v in prog.items():
        setattr(trainer.progress, k, v)
    rank_file = path / f"rank-{trainer.env.rank}.pt"
    if saved == world_size and rank_file.exists():
        try:
            rank_state = torch.load(rank_file, weights_only=True)
        except Exception as e:  # noqa: BLE001 - e.g. a pickle that names a forbidden global
            raise CheckpointError(f"cannot load {rank_file}: {_why(e)}") from None
        trainer.load_rank_state(_from_plain(rank_state))
    else:
        trainer.reshard_progress(saved or world_size)
    log.info("resumed from %s: step %d, epoch %d, batch %d of the epoch%s", path, trainer.progress.step,
             trainer.progress.epoch, trainer.progress.batch_in_epoch,
             "" if saved == world_size else f" (saved at world size {saved}, now {world_size}: resharded)")


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
    tmp = Path(str(out) + ".tmp")
    torch.save(model, tmp)
    tmp.replace(out)
    return len(model)
