"""Copies of each rank's local items on peer nodes, and the restore's fetch from them (issue 30, item 2).

After each local save (:mod:`hpc_train.ckpt.local.tier`) every rank sends its new item to its buddy,
the same local rank on the next node (node index + d mod nodes, d = 1..``local_replicas``), so a
copy lives in another failure domain; and it receives the item of the rank whose buddy it is.
The buddy writes it under its own node's directory, ``NODE/copies/rank-R/step-N/``, checksumming
the bytes as it writes them against the sender's commit record, and commits it with a commit
record and checksums of its own: a copy is complete only with them, like any item.

The transfer runs on the local tier's writer thread, over a gloo group of its own (never a
group that training or the shared tier's DCP uses: collectives of two threads on one group
interleave and deadlock). Every rank takes part in every exchange, a rank whose tier is off
too (it sends nothing and drops what it receives): a rank that skipped one would leave its
peers waiting in a receive until ``dist.timeout_s``.

The wire (plain bytes, checksummed on arrival): :mod:`hpc_train.ckpt.local.wire`.

Restore (:func:`hpc_train.ckpt.tiers.choose`, :meth:`Peers.transfer`): every rank lists what its node holds
for any rank (its own items, and copies), one all-gather shares the lists, and the newest step
that some node holds for every rank is used; a rank whose node lacks its item receives it from
the lowest rank that holds it (a spare node that replaced a lost one holds nothing). Every rank
computes the same plan and runs the transfers in the same order, so blocking sends and
receives cannot deadlock (the earliest unfinished transfer always has both ends waiting on it).
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hpc_train.ckpt import store, tiers
from hpc_train.ckpt.local.wire import Outgoing, swap
from hpc_train import config_local
from hpc_train.config_local import COPIES

log = logging.getLogger("hpc_train")


@dataclass(frozen=True)
class Ring:
    """Where this rank's copies go and whose it holds. Ranks are numbered node by node
    (``rank = node * per_node + local``), as under srun's block distribution and torchrun."""
    rank: int
    local_rank: int
    per_node: int
    node: int
    nodes: int
    replicas: int

    def buddy(self, d: int) -> int:
        return ((self.node + d) % self.nodes) * self.per_node + self.local_rank

    def source(self, d: int) -> int:
        return ((self.node - d) % self.nodes) * self.per_node + self.local_rank


def ring(env: Any, world: int, replicas: int) -> tuple[Ring | None, str | None]:
    """The ring of copies for a NodeEnv-like ``env``, or (None, why copies are off). Every
    rank decides the same: it depends only on the config and the job's shape."""
    if replicas <= 0:
        return None, None
    if env is None or world <= 1:
        return None, "copies on a peer node are off: a single process has no peer"
    nodes, per = int(env.num_nodes), int(env.local_world_size)
    if nodes <= 1:
        return None, "copies on a peer node are off: the run has one node (checkpoint.local_replicas needs two or more)"
    if nodes * per != world or env.rank != env.node_rank * per + env.local_rank:
        return None, (f"copies on a peer node are off: ranks are not numbered node by node ({world} ranks, "
                      f"{nodes} nodes of {per})")
    return Ring(env.rank, env.local_rank, per, env.node_rank, nodes, min(replicas, nodes - 1)), None


class Peers:
    """One rank's side of the copies: the ring, the gloo group (made lazily, at the same point
    on every rank: the first local save or restore), and the copies dirs of this node."""

    def __init__(self, ring_: Ring, node: Path, timeout_s: float) -> None:
        self.ring, self.node, self.timeout_s = ring_, node, timeout_s
        self.node_name = node.name
        self._pg = None
        self.stats: list[dict[str, float]] = []

    def group(self):
        if self._pg is None:
            self._pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        return self._pg

    def copies_dir(self, rank: int) -> Path | None:
        """Where rank ``rank``'s copies are received: made this user's alone, or None where
        something else stands there (a link: never written through; the copy is then dropped)."""
        parent = self.node / COPIES / f"rank-{rank}"
        try:
            return None if config_local.private_dirs(self.node / COPIES, parent) else parent
        except OSError:
            return None

    def exchange(self, path: Path | None, step: int, keep: int, receive: bool) -> list[Path]:
        """Send this rank's item of ``step`` (None: nothing) to each buddy and take in the items
        of the ranks this one is buddy to (``receive`` False: drop them). Runs on the writer thread."""
        got: list[Path] = []
        pg = self.group()
        for d in range(1, self.ring.replicas + 1):
            t0 = time.perf_counter()
            out = Outgoing(path, self.node_name) if path is not None else None
            src = self.ring.source(d)
            inc = swap(pg, out, self.ring.buddy(d), src,
                       lambda m, s=src: self.copies_dir(s) if receive and m["record"].get("rank") == s else None)
            if inc is not None:
                try:
                    where = inc.finish({"copy_of": inc.node, "held_by": self.node_name})
                except OSError as e:   # the stream was drained: the next exchange is in step
                    log.warning("the copy of rank %d's step %d from %s is refused: %s", src, step, inc.node, e)
                    where = None
                if where is not None:
                    got.append(where)
                    self._prune(where.parent, keep)
            if not self.stats:   # once per run and rank: what a copy costs (on the writer thread)
                log.info("local checkpoint copies: step %d sent to rank %d (%.1f MB) and rank %d's received, "
                         "%.3fs in the background", step, self.ring.buddy(d), (out.nbytes if out else 0) / 1e6, src,
                         time.perf_counter() - t0)
            self.stats.append({"step": step, "copy_s": time.perf_counter() - t0,
                               "sent_bytes": out.nbytes if out is not None else 0})
        return got

    def _prune(self, parent: Path, keep: int) -> None:
        items = sorted((store.inspect(p) for _, p in tiers.numbered(parent, "step-")), key=lambda i: -i.step)
        complete = [i for i in items if i.complete]
        newest = complete[0].step if complete else -1
        keep_steps = {i.step for i in complete[:keep]}
        for i in items:
            if i.step not in keep_steps and i.step < newest:
                shutil.rmtree(i.path, ignore_errors=True)

    def transfer(self, step: int, fetches: list[tuple[int, int]], mine: dict[int, Path],
                 dest_parent: Path | None) -> tuple[Path | None, str | None]:
        """Run the restore's transfers (rank, from), in order, on every rank: send what this rank
        holds for others, receive its own item into ``dest_parent``. Returns (the received path
        or None, why this rank's fetch failed or None)."""
        pg, me = self.group(), self.ring.rank
        got, problem = None, None
        for r, h in fetches:
            if me == h:
                swap(pg, Outgoing(mine.get(r), self.node_name), r, None, None)
            elif me == r:
                t0 = time.perf_counter()
                try:
                    inc = swap(pg, None, None, h, lambda m: dest_parent if m["record"].get("rank") == me else None)
                    if inc is None:
                        problem = f"rank {h} sent nothing for step {step}"
                        continue
                    got = inc.finish({"fetched_from": inc.node})
                    if got is None:
                        problem = f"the item of step {step} from rank {h} cannot be stored: the local tier is off here"
                        continue
                    mb = sum(s for _, s in inc.files) / 1e6
                    held = "its copy" if "copy_of" in inc.record else "its own item: the ranks moved"
                    log.info("fetched step %d of rank %d from %s (rank %d, %s): %.1f MB in %.2fs, checksums match",
                             step, me, inc.node, h, held, mb, time.perf_counter() - t0)
                except (OSError, ValueError, KeyError) as e:
                    problem = f"the fetch of step {step} from rank {h} failed: {e}"
        return got, problem

    def restored(self, step: int) -> None:
        """Copies newer than the step restored are a future the run goes back from."""
        for s in (self.ring.source(d) for d in range(1, self.ring.replicas + 1)):
            parent = tiers.under(self.node, COPIES, f"rank-{s}")
            for n, p in tiers.numbered(parent, "step-") if parent is not None else []:
                if n > step:
                    shutil.rmtree(p, ignore_errors=True)

    def remove(self) -> None:
        """At the run's end: this rank's copies, and what no rank now on this node owns (the items
        of ranks that sat here before a restart gave the ranks out anew): nothing is left behind."""
        r = self.ring
        here = {r.node * r.per_node + k for k in range(r.per_node)}
        sources = {((r.node - d) % r.nodes) * r.per_node + k for d in range(1, r.replicas + 1) for k in range(r.per_node)}
        for d in range(1, r.replicas + 1):
            if (mine := tiers.under(self.node, COPIES, f"rank-{r.source(d)}")) is not None:
                shutil.rmtree(mine, ignore_errors=True)
        for parent, owned in ((self.node, here), (self.node / COPIES, sources)):
            for n, p in tiers.numbered(parent, "rank-"):
                if n not in owned:
                    shutil.rmtree(p, ignore_errors=True)
        try:
            (self.node / COPIES).rmdir()
        except OSError:
            pass
