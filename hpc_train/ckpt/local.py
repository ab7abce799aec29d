"""The node-local checkpoint tier: each rank's whole state, often, in its own node's memory or disk.

A local item is a step directory of the shared tier's format (DCP items, ``app.pt``,
``rank-R.pt``, ``commit.json`` with CRC32C checksums computed as written: the same writer, commit
record and checks), but written by one rank alone, with DCP's ``no_dist``: a normal DCP save keeps
each replicated tensor once across ranks, so one rank's files would not hold what that rank
needs. Here every rank writes everything it holds (under DDP the whole replica), so a rank
restores from its own node alone. Where it lives: :mod:`hpc_train.config_local`.

Saves are asynchronous: the training thread copies the state (one copy, as the shared tier's
stager does) and a thread of this tier's writes and commits it; one save in flight; the newest
``checkpoint.local_keep`` are kept. The tier never fails a run: a directory that is missing, not
creatable, not a real directory of this user, not writable, on the run directory, or too small
for two items turns it off for the run with one warning, as does a save that fails at the disk.

Restore (:meth:`LocalTier.choose`, called by :func:`hpc_train.ckpt.restore.restore`): every rank
lists its complete items, one all-gather finds the newest step all of them hold, and it is used
when at least as new as the shared tier's newest and saved at this world size.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import stat
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from hpc_train import config_local
from hpc_train.ckpt import store
from hpc_train.ckpt.common import APP_FILE, dcp_state, rank_file, why
from hpc_train.ckpt.crc import ChecksummingWriter, save_pt
from hpc_train.ckpt.save import _app_state, _rank_state
from hpc_train.config import Config

log = logging.getLogger("hpc_train")
TIER = "local"
_LISTED = 16   # steps per rank in the restore's all-gather (local_keep is small; the newest count)


def _copy_to_cpu(obj: Any) -> Any:
    """One copy of a (nested) state dict, tensors detached on the CPU: what the background write reads."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _copy_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copy_to_cpu(v) for v in obj)
    return copy.deepcopy(obj)


def _real_dir(path: Path) -> str | None:
    """Why ``path`` is not a real directory of this user (a symlink, another owner's), else None."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != os.getuid():
        return f"{path} belongs to another user"
    return None


class LocalTier:
    """One rank's side of the local tier. Build it on every rank when :func:`config_local.enabled`:
    the restore's agreement is a collective, so a rank whose tier is off still takes part."""

    def __init__(self, config: Config, run_dir: Path, rank: int, world_size: int,
                 record: dict[str, Any] | None = None, node: Path | None = None) -> None:
        cfg = self.cfg = config.checkpoint
        self.rank, self.world = rank, world_size
        self.run_dir = Path(run_dir).resolve()
        self.record = dict(record or {})
        self.node = node or config_local.this_process(cfg.local_dir)
        self.dir = config_local.rank_dir(self.node, rank)
        self.off: str | None = None
        self.pending: tuple[Future, int, Path] | None = None
        self.last_t = time.monotonic()
        self.last_step = -1
        self.stats: list[dict[str, float]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._checked_space = False
        self._made = False   # the directories are made at the first save: a run that never saves leaves none
        if config.dist.strategy == "fsdp":
            self._turn_off("dist.strategy=fsdp shards the state; the local tier holds whole replicas only")
        else:
            self._turn_off(self._where())

    # -- health --------------------------------------------------------------------------------
    def _turn_off(self, reason: str | None) -> None:
        if reason and self.off is None:
            self.off = reason
            log.warning("local checkpoint tier off for this run: %s; training and the shared tier go on", reason)

    def _where(self) -> str | None:
        base = self.node.parent.parent
        if not base.is_dir():
            return f"{base} does not exist or is not a directory"
        if self.run_dir == base.resolve() or self.run_dir in base.resolve().parents:
            return f"{base} is inside the run directory {self.run_dir}, which is shared, not node-local"
        return None

    def _setup(self) -> str | None:
        try:
            for d in (self.node.parent, self.node, self.dir):
                try:
                    d.mkdir(mode=0o700)
                except FileExistsError:
                    pass
                bad = _real_dir(d)   # never through a symlink another user planted in /dev/shm
                if bad:
                    return bad
            probe = self.dir / ".probe"
            probe.write_bytes(b"0")
            probe.unlink()
        except OSError as e:
            return f"{self.dir} is not writable ({e.strerror or type(e).__name__})"
        return None

    def _space_ok(self, nbytes: int) -> bool:
        if self._checked_space:
            return True
        self._checked_space = True
        free = shutil.disk_usage(self.dir).free + sum(i.size for i in self._items() if i.complete)
        if free < 2 * nbytes:
            self._turn_off(f"{self.dir} has {free >> 20} MiB free, less than two items of {nbytes >> 20} MiB")
            return False
        return True

    # -- schedule ------------------------------------------------------------------------------
    def due_by_time(self) -> bool:
        s = self.cfg.local_every_seconds
        return self.off is None and bool(s) and time.monotonic() - self.last_t >= s

    def due(self, step: int, timed: bool) -> bool:
        n = self.cfg.local_every_steps
        return self.off is None and step != self.last_step and bool(timed or (n and step % n == 0))

    # -- save ----------------------------------------------------------------------------------
    def save(self, state: Mapping[str, Any], step: int, kinds: dict[str, str]) -> None:
        """Copy this rank's state now (the blocking part), write and commit it in the background."""
        self.wait()
        if not self._made and self.off is None:
            self._made = True
            self._turn_off(self._setup())
        if self.off is not None:
            return
        if not all(bool(p.detach().isfinite().all()) for k, kind in kinds.items() if kind == "module"
                   for p in state[k].parameters()):
            return   # the next step's agreement names the divergence; never keep a NaN locally
        t0 = time.perf_counter()
        staged = _copy_to_cpu(dcp_state(state, kinds))
        nbytes = sum(t.numel() * t.element_size() for t in _tensors(staged))
        if not self._space_ok(nbytes):
            return
        small = copy.deepcopy((_rank_state(state, kinds), _app_state(state, kinds)))
        path = self.dir / f"step-{step}"
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="hpc_train-local")
        fut = self._pool.submit(self._write, staged, small, path, step, kinds, t0)
        self.pending = (fut, step, path)
        if not self.stats:   # where it is and what it costs, once per run and rank
            log.info("local checkpoint tier: step %d to %s (%.1f MB, %.3fs blocking); every %s steps / %s s, "
                     "keeping %d", step, self.dir, nbytes / 1e6, time.perf_counter() - t0,
                     self.cfg.local_every_steps or "-", self.cfg.local_every_seconds or "-", self.cfg.local_keep)
        self.stats.append({"step": step, "blocked_s": time.perf_counter() - t0})
        self.last_t, self.last_step = time.monotonic(), step

    def _write(self, staged: dict[str, Any], small: tuple[Any, Any], path: Path, step: int,
               kinds: dict[str, str], t0: float) -> None:
        if os.path.lexists(path):
            shutil.rmtree(path)   # a leftover of a save cut short, or of a future a restore went back from
        path.mkdir(mode=0o700)
        own = {rank_file(path, self.rank).name: save_pt(small[0], rank_file(path, self.rank)),
               APP_FILE: save_pt(small[1], path / APP_FILE)}
        writer = ChecksummingWriter(str(path), own=own, thread_count=1, sync_files=True, background=True)
        try:
            dcp.save(staged, storage_writer=writer, no_dist=True)
        except CheckpointException as e:   # a BaseException: make it an ordinary one for wait()
            raise OSError(why(e)) from None
        store.write_commit(path, {**self.record, "step": step, "time": time.time(), "world_size": self.world,
                                  "rank": self.rank, "tier": TIER, "run_dir": str(self.run_dir),
                                  "torch": torch.__version__, "state": kinds,
                                  "save_seconds": round(time.perf_counter() - t0, 4)},
                           sums=writer.checksums, warn=log.warning)
        self._prune()

    def _prune(self) -> None:
        complete = [i for i in self._items() if i.complete]
        keep = {i.step for i in complete[: self.cfg.local_keep]}
        newest = complete[0].step if complete else -1
        for info in self._items():
            if info.step not in keep and info.step < newest:
                shutil.rmtree(info.path, ignore_errors=True)

    def wait(self) -> None:
        """Finish the save in flight; one that failed is one warning and turns the tier off."""
        if self.pending is None:
            return
        fut, step, path = self.pending
        self.pending = None
        try:
            fut.result()
        except Exception as e:  # noqa: BLE001 - a local save never fails the run
            shutil.rmtree(path, ignore_errors=True)
            self._turn_off(f"the save of step {step} in {path} failed ({why(e)})")

    # -- restore -------------------------------------------------------------------------------
    def _items(self) -> list[store.CkptInfo]:
        if self.off is not None and not self.dir.is_dir():
            return []
        try:
            names = [p for p in self.dir.iterdir() if p.name.startswith("step-") and p.name[5:].isdigit()]
        except OSError:
            return []
        return sorted((store.inspect(p) for p in names), key=lambda i: i.step, reverse=True)

    def usable(self) -> list[store.CkptInfo]:
        """This rank's complete items of this run, at this world size, newest first."""
        return [i for i in self._items() if i.complete and i.record.get("tier") == TIER
                and i.record.get("run_dir") == str(self.run_dir) and i.record.get("world_size") == self.world
                and i.record.get("rank") == self.rank
                and i.record.get("config_hash") == self.record.get("config_hash")]

    def choose(self, shared_step: int, device: torch.device, multi: bool) -> store.CkptInfo | None:
        """The item to restore: the newest step every rank holds, if not older than the shared
        tier's newest (``shared_step``, -1: none). One all-gather; every rank decides the same."""
        mine = [i.step for i in self.usable()][:_LISTED]
        steps = set(mine)
        if multi:
            buf = torch.full((_LISTED,), -1, dtype=torch.int64, device=device)
            if mine:
                buf[:len(mine)] = torch.tensor(mine, dtype=torch.int64)
            every = [torch.empty_like(buf) for _ in range(dist.get_world_size())]
            dist.all_gather(every, buf)
            for b in every:
                steps &= {int(s) for s in b.cpu().tolist() if s >= 0}
        best = max(steps, default=-1)
        if best < 0 or best < shared_step:
            return None
        return next(i for i in self.usable() if i.step == best)

    def restored(self, step: int) -> None:
        """After a restore from ``step`` (either tier): this rank's items newer than it are a future
        the run goes back from, and are removed; the timer starts again."""
        for info in self._items():
            if info.step > step:
                shutil.rmtree(info.path, ignore_errors=True)
        self.last_t, self.last_step = time.monotonic(), step

    # -- end -----------------------------------------------------------------------------------
    def close(self, remove: bool = False) -> None:
        """Finish the save in flight. ``remove``: the run finished or stopped, so nothing here
        can serve again (an in-place restart follows only a failure): this rank's directory goes,
        and the node's and the job's with it once empty."""
        self.wait()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)
            for d in (self.node, self.node.parent):
                try:
                    d.rmdir()
                except OSError:
                    break


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
