"""The node-local checkpoint tier: each rank's whole state, often, in its own node's memory or disk.

A local item is a step directory checked as the shared tier's are (``app.pt``, ``rank-R.pt``,
``commit.json`` with sizes and CRC32C checksums computed as written: the same commit record,
checks and fallbacks), written by one rank alone: a shared checkpoint keeps each replicated
tensor once across ranks, so one rank's files would not hold what that rank needs. Here every
rank writes everything it holds (under DDP the whole replica), so a rank restores from its own
node alone. An item is never resharded, so its tensors are not DCP items: one raw buffer file
per dtype (:mod:`hpc_train.ckpt.local.flat`, the record's ``"layout": "buffers"``), which costs a
small fraction of the CPU that DCP's view, planner and writer took per save. Where it lives:
:mod:`hpc_train.config_local`.

Saves are asynchronous: the training thread copies the state (one copy, as the shared tier's
stager does) and a thread of this tier's writes and commits it; one save in flight; the newest
``checkpoint.local_keep`` are kept. The write overlaps the next step's forward and backward: its
agreement waits for the item and its copies if still unwritten (:meth:`LocalTier.settle`), so a
crash redoes at most ``local_every_steps`` steps, on the same nodes or a spare.
Items are not fsync'd: a crashed process leaves its writes in the page cache, a lost node's
memory is gone either way (its copies serve), and a torn item fails its checksums.

The tier never fails a run: a directory that is missing, not creatable, not a real directory of
this user, not writable, on the run directory, or too small for two items turns it off for the
run with one warning, as does a save that fails at the disk.

Copies (``checkpoint.local_replicas``, :mod:`hpc_train.ckpt.local.peer`): after each save the
writer thread sends the new item to the same local rank on the next node(s), which keeps it
under its own node's directory; on a single node they are off (said once).

Restore (:meth:`LocalTier.choose`, called by :func:`hpc_train.ckpt.restore.restore`): every rank
lists its complete items (with copies: every item its node holds, for any rank), one all-gather
finds the newest step held for every rank, and it is used when at least as new as the shared
tier's newest and saved at this world size. A rank whose node lacks its item receives it from
a node that holds a copy.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpc_train import config_local
from hpc_train.ckpt import store, tiers
from hpc_train.ckpt.checksum import CRC32C
from hpc_train.ckpt.common import APP_FILE, app_state, rank_file, rank_state, save_pt, why
from hpc_train.ckpt.local import flat, peer
from hpc_train.ckpt.local.keep import Kept, keeper_of
from hpc_train.config import CheckpointSection, DistSection

log = logging.getLogger("hpc_train")
TIER = tiers.TIER   # the commit record's "tier"
SPARE = "spare"     # a rank's pruned item, its files overwritten by the next save (flat.retire)


@dataclass
class _Staged:
    """A save's copy of this rank's state, taken on the training thread, for the writer thread."""
    state: dict[str, torch.Tensor]    # the flat buffers (modules, optimizers), on the CPU, by dtype
    small: tuple[Any, Any]            # (rank-R.pt's, app.pt's) contents
    path: Path                        # the step directory it goes to
    kinds: dict[str, str]
    t0: float                         # when the copy began (save_seconds in the commit record)


class LocalTier:
    """One rank's side of the local tier. Build it on every rank when :func:`config_local.enabled`:
    the restore's agreement is a collective, so a rank whose tier is off still takes part."""

    def __init__(self, checkpoint: CheckpointSection, dist: DistSection, run_dir: Path, rank: int, world_size: int,
                 record: dict[str, Any] | None = None, node: Path | None = None, env: Any = None) -> None:
        cfg = self.cfg = checkpoint
        self.rank, self.world = rank, world_size
        self.run_dir = Path(run_dir).resolve()
        self.record = dict(record or {})
        self.node = node or tiers.node_here(cfg.local_dir, self.run_dir)
        # What makes an item this run's: the path already is this job's (the tier's ID).
        self.ident = tiers.Identity.of(self.run_dir, self.record.get("config_hash"), world_size)
        self.dir = config_local.rank_dir(self.node, rank)
        self.off: str | None = None
        self.pending: tuple[Future, int, Path] | None = None
        self.last_t = time.monotonic()
        self.last_step = -1
        self.stats: list[dict[str, float]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._checked_space = False
        self._made = False   # the directories are made at the first save: a run that never saves leaves none
        self._kept: list[int] | None = None   # steps of the complete items in self.dir, newest first; None: unknown
        self._copies_off: str | None = None
        # Copies: the same on every rank (config and the job's shape only), whatever each
        # node's directory turns out to be: every rank takes part in every exchange.
        self.peers: peer.Peers | None = None
        if dist.strategy == "fsdp":
            self._turn_off("dist.strategy=fsdp shards the state; the local tier holds whole replicas only")
            return
        ring, why_not = peer.ring(env, world_size, cfg.local_replicas)
        if ring is not None:
            self.peers = peer.Peers(ring, self.node, dist.timeout_s)
        elif why_not and rank == 0:
            log.info("local checkpoint tier: %s", why_not)
        self._turn_off(self._where())

    # -- health --------------------------------------------------------------------------------
    def _turn_off(self, reason: str | None) -> None:
        if reason and self.off is None:
            self.off = reason
            log.warning("local checkpoint tier off for this run: %s; training and the shared tier go on", reason)

    def _where(self) -> str | None:
        base = config_local.base_of(self.node)
        if not base.is_dir():
            return f"{base} does not exist or is not a directory"
        if self.run_dir == base.resolve() or self.run_dir in base.resolve().parents:
            return f"{base} is inside the run directory {self.run_dir}, which is shared, not node-local"
        return None

    def _setup(self) -> str | None:
        try:
            bad = config_local.enter(self.node, self.dir)   # never through a symlink
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
        copies = self.peers.ring.replicas if self.peers is not None else 0
        if free < 2 * nbytes * (1 + copies):
            self._turn_off(f"{self.dir} has {free >> 20} MiB free, less than two items of {nbytes >> 20} MiB"
                           + (f" plus {copies} peer's copies of as many" if copies else ""))
            return False
        return True

    # -- schedule ------------------------------------------------------------------------------
    def due_by_time(self) -> bool:
        s = self.cfg.local_every_seconds
        return self.off is None and bool(s) and time.monotonic() - self.last_t >= s

    def due(self, step: int, timed: bool) -> bool:
        """With copies, due on every rank alike, its own tier off or not: the exchange needs all."""
        n = self.cfg.local_every_steps
        return ((self.off is None or self.peers is not None) and step != self.last_step
                and bool(timed or (n and step % n == 0)))

    # -- save ----------------------------------------------------------------------------------
    def save(self, state: Mapping[str, Any], step: int, kinds: dict[str, str]) -> None:
        """Copy this rank's state now (the blocking part), write and commit it in the background,
        then send it to the peers (with copies, also when this rank has nothing to send)."""
        self.wait()
        if not self._made and self.off is None:
            self._made = True
            self._turn_off(self._setup())
        self.last_t, self.last_step = time.monotonic(), step
        job = self._staged(state, step, kinds) if self.off is None else None
        if job is None and self.peers is None:
            return
        if self.peers is not None:
            self.peers.group()   # made here, on the training thread, at the same step on every rank
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="hpc_train-local")
        fut = self._pool.submit(self._background, job, step)
        self.pending = (fut, step, job.path if job is not None else None)

    def settle(self) -> None:
        """Before every step's agreement (``Run._votes``): the save begun at an earlier step is
        written, copies included (or failed), by now, waiting for it if needed."""
        if self.pending is None:
            return
        t0 = time.perf_counter()
        self.wait()
        if self.stats:
            self.stats[-1]["settle_wait_s"] = time.perf_counter() - t0

    def _staged(self, state: Mapping[str, Any], step: int, kinds: dict[str, str]) -> _Staged | None:
        """The blocking copy of this rank's state, or None when it is not saved this time."""
        if not flat.finite([p for k, kind in kinds.items() if kind == "module" for p in state[k].parameters()]):
            return None   # the next step's agreement names the divergence; never keep a NaN locally
        t0 = time.perf_counter()
        staged, skeleton, nbytes = flat.pack(flat.views(state, kinds))
        if not self._space_ok(nbytes):
            return None
        own = rank_state(state, kinds)
        rng = own.pop("rng")   # built fresh for this save: a deep copy would copy it again
        small = copy.deepcopy((own, app_state(state, kinds)))
        small[0]["rng"] = rng
        small[0][flat.KEY] = skeleton
        path = self.dir / f"step-{step}"
        if not self.stats:   # where it is and what it costs, once per run and rank
            ring = self.peers.ring if self.peers is not None else None
            to = f"; copies to rank {', '.join(str(ring.buddy(d)) for d in range(1, ring.replicas + 1))}" \
                if ring else ""
            log.info("local checkpoint tier: step %d to %s (%.1f MB, %.3fs blocking); every %s steps / %s s, "
                     "keeping %d%s", step, self.dir, nbytes / 1e6, time.perf_counter() - t0,
                     self.cfg.local_every_steps or "-", self.cfg.local_every_seconds or "-", self.cfg.local_keep, to)
        self.stats.append({"step": step, "blocked_s": time.perf_counter() - t0})
        return _Staged(staged, small, path, kinds, t0)

    def _background(self, job: _Staged | None, step: int) -> None:
        """The writer thread: this rank's item, then the exchange with the peers. A failed write
        is raised to wait() after the exchange, which the peers wait for either way."""
        error: Exception | None = None
        written = None
        if job is not None:
            try:
                self._write(job.state, job.small, job.path, step, job.kinds, job.t0)
                written = job.path
            except Exception as e:  # noqa: BLE001 - raised below, once the peers had their exchange
                error = e
        if self.peers is not None and self._copies_off is None:
            try:
                self.peers.exchange(written, step, self.cfg.local_keep, receive=self.off is None and error is None)
            except Exception as e:  # noqa: BLE001 - a peer gone mid-transfer: the run fails elsewhere if it must
                self._copies_off = why(e)
                log.warning("local checkpoint copies off for this run: the exchange of step %d failed (%s); the "
                            "local and shared tiers go on", step, self._copies_off)
        if error is not None:
            raise error

    def _write(self, staged: dict[str, torch.Tensor], small: tuple[Any, Any], path: Path, step: int,
               kinds: dict[str, str], t0: float, saved_at: str | None = None) -> None:
        if os.path.lexists(path):
            shutil.rmtree(path)   # a leftover of a save cut short, or of a future a restore went back from
        # Not niced as the shared tier's writer is: the next step's agreement waits for this
        # write, so a lower priority only moves the wait, and a niced thread holding the GIL
        # stalls the training thread behind the other ranks' (an inversion).
        flat.reuse_spare(self.dir / SPARE, path, {flat.file_name(name) for name in staged})
        own = {rank_file(path, self.rank).name: save_pt(small[0], rank_file(path, self.rank)),
               APP_FILE: save_pt(small[1], path / APP_FILE), **flat.write(path, staged)}
        store.write_commit(path, self._record(step, self.rank, kinds, **({"saved_at": saved_at} if saved_at else {}),
                                              save_seconds=round(time.perf_counter() - t0, 4)),
                           sums={"algorithm": CRC32C, "files": own}, warn=log.warning, durable=False)
        self._prune(step)

    def _record(self, step: int, rank: int, kinds: dict[str, str], **extra: Any) -> dict[str, Any]:
        """The commit record of ``rank``'s item of ``step`` (this rank's own, or one it saves at a failure)."""
        return {**self.record, "step": step, "time": time.time(), "world_size": self.world, "rank": rank,
                "tier": TIER, "layout": flat.LAYOUT, "run_dir": str(self.run_dir), "torch": torch.__version__,
                "state": kinds, **extra}

    def _prune(self, step: int) -> None:
        """Keep the newest ``local_keep`` complete items. What the directory holds is read once
        (and again after a restore); from then on this rank's writer is the only one adding to
        it, so each save adds ``step`` to what is known, without reading every record again."""
        keep = self.cfg.local_keep
        if self._kept is None:
            complete = [i for i in self._items() if i.complete]
            kept = {i.step for i in complete[:keep]}
            for info in self._items():
                if info.step not in kept and info.step < step:
                    flat.retire(info.path, self.dir / SPARE)
            self._kept = sorted(kept, reverse=True)
            return
        self._kept = [step] + [s for s in self._kept if s != step]
        for old in self._kept[keep:]:
            flat.retire(self.dir / f"step-{old}", self.dir / SPARE)
        del self._kept[keep:]

    def wait(self) -> None:
        """Finish the save in flight; one that failed is one warning and turns the tier off."""
        if self.pending is None:
            return
        fut, step, path = self.pending
        self.pending = None
        try:
            fut.result()
        except Exception as e:  # noqa: BLE001 - a local save never fails the run
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)
            self._turn_off(f"the save of step {step} in {path} failed ({why(e)})")

    # -- at a failure --------------------------------------------------------------------------
    def save_at_failure(self, state: Mapping[str, Any], kinds: dict[str, str], mine: Kept,
                        held: Kept | None) -> list[int]:
        """A peer failed while this rank holds the modules and optimizers of ``mine.step`` (its last
        ``step_end``; the caller checked that no optimizer stepped since): this rank's item of that
        step, made from them and its own state kept then (``mine``), unless a save of it is written
        already; and, with ``held`` (the state of the rank this one keeps, :mod:`.keep`), that
        rank's item of the same step as a copy beside it (``NODE/copies/rank-R/step-N``: the
        modules' files linked, not copied), which its replacement loads. Returns the ranks saved;
        raises OSError (a full directory) with nothing committed that was not whole."""
        step = mine.step
        if self.off is not None:
            raise OSError(f"the local tier is off ({self.off})")
        path = self.dir / f"step-{step}"
        views = flat.views(state, kinds)
        for k, bufs in (mine.buffers or {}).items():
            views[k].update({n: b for n, b in bufs.items() if n in views[k]})
        staged, skeleton, nbytes = flat.pack(views)
        saved = []
        if not self._written(path, step):
            if not self._made:
                self._made = True
                self._turn_off(self._setup())
            own = dict(mine.own, **{flat.KEY: skeleton})
            self._write(staged, (own, mine.app), path, step, kinds, time.perf_counter(), saved_at="failure")
            saved.append(self.rank)
        if held is not None:
            self._copy_at_failure(path, held, skeleton, kinds)
            saved.append(held.rank)
        return saved

    def _written(self, path: Path, step: int) -> bool:
        """This rank's item of ``step`` is committed: by the save begun at that step, given a few
        seconds to finish its write (its copies' exchange with a dead peer may never end)."""
        deadline = time.monotonic() + 3.0
        while True:
            info = store.inspect(path)
            if info.complete or self.pending is None or self.pending[1] != step or self.pending[0].done():
                return info.complete
            if time.monotonic() > deadline:   # its writer still holds the directory
                raise OSError(f"the save of step {step} begun before the failure did not finish its write")
            time.sleep(0.01)

    def _copy_at_failure(self, own_path: Path, held: Kept, skeleton: Any, kinds: dict[str, str]) -> None:
        """``held.rank``'s item of ``held.step``: this rank's module and optimizer files (hard links:
        the same bytes; a spare's files are reused only when no link shares them,
        :func:`flat.reuse_spare`), that rank's own state and a commit record of its own."""
        record = store.inspect(own_path).record
        sums = dict(record.get("checksums", {}).get("files", {}))
        parent = self.node / config_local.COPIES / f"rank-{held.rank}"
        bad = config_local.private_dirs(self.node / config_local.COPIES, parent)
        if bad:
            raise OSError(bad)
        path = parent / f"step-{held.step}"
        if os.path.lexists(path):
            shutil.rmtree(path)
        path.mkdir(mode=0o700)
        files = {}
        for name in sums:
            if name.startswith("flat-"):
                try:
                    os.link(own_path / name, path / name)
                except OSError:
                    shutil.copyfile(own_path / name, path / name, follow_symlinks=False)
                files[name] = sums[name]
        rank_pt = rank_file(path, held.rank)
        files[rank_pt.name] = save_pt(dict(held.own, **{flat.KEY: skeleton}), rank_pt)
        files[APP_FILE] = save_pt(held.app, path / APP_FILE)
        store.write_commit(path, self._record(held.step, held.rank, kinds, saved_at="failure", held_by=self.node.name,
                                              copy_of=self.node.name),
                           sums={"algorithm": CRC32C, "files": files}, warn=log.warning, durable=False)
        for old in tiers.numbered(parent, "step-"):
            if old[0] < held.step:
                shutil.rmtree(old[1], ignore_errors=True)

    # -- restore -------------------------------------------------------------------------------
    def _items(self) -> list[store.CkptInfo]:
        if self.off is not None and not self.dir.is_dir():
            return []
        return sorted((store.inspect(p) for _, p in tiers.numbered(self.dir, "step-")), key=lambda i: i.step,
                      reverse=True)

    def _accepts(self, info: store.CkptInfo, rank: int) -> bool:
        """A complete item of this run, at this world size, for ``rank`` (:func:`tiers.foreign`)."""
        return info.complete and info.record.get("rank") == rank and tiers.foreign(info.record, self.ident) is None

    def usable(self) -> list[store.CkptInfo]:
        """This rank's complete items of this run, at this world size, newest first."""
        return [i for i in self._items() if self._accepts(i, self.rank)]

    def choose(self, shared_step: int, device: torch.device, multi: bool) -> store.CkptInfo | None:
        """The item to restore: the newest step every rank holds, if not older than the shared
        tier's newest (``shared_step``, -1: none). With more than one rank, see
        :meth:`_choose_with_copies`; one process chooses among its own items."""
        self.wait()
        if multi:
            return self._choose_with_copies(shared_step, device)
        best = tiers.choose([[(0, i.step) for i in self.usable()]], 1, shared_step).step
        self._say_unloaded(max(best, shared_step))
        if best < 0:
            return None
        return next(i for i in self.usable() if i.step == best)

    def _say_incomplete(self, table: list[list[tuple[int, int]]], restored: int) -> None:
        """Rank 0: a newer step some ranks hold and others do not (a save at a failure that could
        not be made for every rank: the dead rank's keeper died with it, a full directory), in one
        line, with the step the restart goes back to."""
        held: dict[int, set[int]] = {}
        for pairs in table:
            for r, s in pairs:
                held.setdefault(s, set()).add(r)
        newer = [s for s in held if s > restored]
        if self.rank != 0 or not newer:
            return
        s = max(newer)
        missing = sorted(set(range(self.world)) - held[s])
        back = f"step {restored}" if restored >= 0 else "step 0 (nothing saved before)"
        log.warning("local checkpoint tier: step %d is held for %s but not for rank%s %s; the restart loads %s",
                    s, "rank " + ", ".join(map(str, sorted(held[s]))), "s" if len(missing) > 1 else "",
                    ", ".join(map(str, missing)), back)

    def _say_unloaded(self, restored: int) -> None:
        """Rank 0, once at a restore: its own items of this run newer than the step restored
        that no restart loads (saved under another config or world size), so that a rerun with
        changed arguments does not fall back to an older step in silence."""
        if self.rank != 0:
            return
        unloaded = [(i.step, why) for i in self._items() if i.complete and i.step > restored
                    and i.record.get("run_dir") == self.ident.run_dir and (why := tiers.foreign(i.record, self.ident))]
        if unloaded:
            log.warning("local checkpoint tier: %d newer item(s) of this run (up to step %d) are not loaded: %s; a "
                        "restart loads only items saved by the same config at the same world size",
                        len(unloaded), max(s for s, _ in unloaded), unloaded[0][1])

    def _choose_with_copies(self, shared_step: int, device: torch.device) -> store.CkptInfo | None:
        """Every rank lists what its node holds, for any rank (after a lost node the ranks may sit
        on other nodes than before; on one node, a copy saved at a failure); the newest step held
        for every rank wins, and a rank whose node lacks its item receives it from a node that
        holds it (:meth:`peer.Peers.transfer`; without copies, none can, and the load falls back).
        A fetch that fails returns an incomplete item: the caller's load then fails on that rank,
        and every rank falls back together, with one warning."""
        mine: dict[tuple[int, int], Path] = {}
        for h in sorted(tiers.on_node(self.node), key=lambda h: h.copy):   # the node's own item before a copy
            if h.slot is not None and self._accepts(h.info, h.slot):
                mine.setdefault((h.slot, h.info.step), h.info.path)
        pairs = sorted(mine, key=lambda rs: -rs[1])
        n = torch.tensor([len(pairs)], dtype=torch.int64, device=device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        buf = torch.full((max(1, int(n.item())), 2), -1, dtype=torch.int64, device=device)
        if pairs:
            buf[:len(pairs)] = torch.tensor(pairs, dtype=torch.int64)
        every = [torch.empty_like(buf) for _ in range(dist.get_world_size())]
        dist.all_gather(every, buf)
        table = [[(int(r), int(s)) for r, s in b.cpu().tolist() if r >= 0] for b in every]
        chosen = tiers.choose(table, self.world, shared_step)
        best, fetches = chosen.step, list(chosen.fetches)
        self._say_unloaded(max(best, shared_step))
        self._say_incomplete(table, max(best, shared_step))
        if best < 0:
            return None
        if fetches and self.peers is None:   # ranks on nodes without copies: nothing can fetch
            return store.CkptInfo(best, self.dir / f"step-{best}", False,
                                  f"step {best} is not on every rank's node, and copies are off")
        problem, got = None, mine.get((self.rank, best))
        if fetches:
            if any(r == self.rank for r, _ in fetches) and not self._made and self.off is None:
                self._made = True   # a spare node: nothing here yet
                self._turn_off(self._setup())
            dest = self.dir if self.off is None else None
            fetched, problem = self.peers.transfer(best, fetches, {r: p for (r, s), p in mine.items() if s == best},
                                                   dest)
            got = fetched or got
        if got is None:
            return store.CkptInfo(best, self.dir / f"step-{best}", False,
                                  problem or f"no item of step {best} for rank {self.rank}")
        return store.inspect(got)

    def restored(self, step: int) -> None:
        """After a restore from ``step`` (either tier): this rank's items newer than it are a future
        the run goes back from, and are removed; the timer starts again."""
        for info in self._items():
            if info.step > step:
                shutil.rmtree(info.path, ignore_errors=True)
        self._kept = None   # read again at the next save: the restore may have fetched an item here
        if self.peers is not None:
            self.peers.restored(step)
        elif (kept := self._kept_copies()) is not None:   # a copy saved at a failure on this node
            for s, p in tiers.numbered(kept, "step-"):
                if s > step:
                    shutil.rmtree(p, ignore_errors=True)
        self.last_t, self.last_step = time.monotonic(), step

    # -- end -----------------------------------------------------------------------------------
    def close(self, remove: bool = False) -> None:
        """Finish the save in flight. ``remove``: the run finished or stopped, so nothing here
        can serve again (an in-place restart follows only a failure): this rank's directory goes,
        and the node's, the run's and the job's with it once empty."""
        self.wait()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if remove:
            if not self._made and os.path.isdir(self.node):
                # A restart that loaded an item here and saved none since: this process holds
                # the job's directory too, so that the last one out removes it (remove_empty).
                self._made = True
                with contextlib.suppress(OSError):
                    config_local.enter(self.node)
            shutil.rmtree(self.dir, ignore_errors=True)
            if self.peers is not None:
                self.peers.remove()
            elif (kept := self._kept_copies()) is not None:
                shutil.rmtree(kept, ignore_errors=True)
                with contextlib.suppress(OSError):
                    (self.node / config_local.COPIES).rmdir()
            config_local.remove_empty(self.node)

    def _kept_copies(self) -> Path | None:
        """Where this rank saves, at a failure, the item of the rank whose state it keeps; None
        where a link stands in its way (never written, listed or removed through)."""
        source = keeper_of(self.rank, self.world, self.peers.ring if self.peers is not None else None)[1]
        return tiers.under(self.node, config_local.COPIES, f"rank-{source}")
