"""What the node-local tier holds for a run, as seen from this machine, without torch.

``ckpt list`` and ``status`` read it here, so they name the same items and the same step. Only
the nodes whose directories this machine can see count (the dev cluster's nodes share one
disk; on a real cluster, where the run's nodes are: a login node sees none), and the items are
judged by their commit records alone, as :func:`hpc_train.ckpt.store.inspect` judges any item:
the checksums are checked when a restore loads one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hpc_train import config_local, rundir
from hpc_train.ckpt import store

TIER = "local"   # the commit record's "tier" (hpc_train.ckpt.local writes it)


def node_here(local_dir: str, run_dir: Path | str) -> Path:
    """This process's node directory of ``run_dir``'s local tier (:mod:`hpc_train.config_local`),
    with the ``run`` launcher's ID when this process descends from one."""
    return config_local.this_process(local_dir, run_dir, os.environ.get(rundir.LOCAL_ID_ENV))


@dataclass(frozen=True)
class LocalItem:
    info: store.CkptInfo
    node: str     # the node directory's name (the Slurm node name)
    copy: bool    # a peer's copy (hpc_train.ckpt.peer), not the node's own item

    @property
    def rank(self) -> int | None:
        r = self.info.record.get("rank")
        return r if isinstance(r, int) and not isinstance(r, bool) else None


def local_items(run_dir: Path, local_dir: str, env: Mapping[str, str] | None = None) -> list[LocalItem]:
    """Every complete-or-not local item of ``run_dir`` under the bases this machine can see,
    newest first; never through a symlinked directory."""
    mine = str(Path(run_dir).resolve())
    key = config_local.run_key(mine)
    out: list[LocalItem] = []
    for base in config_local.visible_bases(local_dir, os.environ if env is None else env):
        for path in sorted([*base.glob(f"{config_local.PREFIX}*/{key}/*/rank-*/step-*"),
                            *base.glob(f"{config_local.PREFIX}*/{key}/*/{config_local.COPIES}/rank-*/step-*")]):
            rel = path.relative_to(base)
            if any((base / q).is_symlink() for q in (rel, *rel.parents[:-1])):
                continue
            info = store.inspect(path)
            if info.record.get("tier") != TIER or info.record.get("run_dir") != mine:
                continue
            copy = path.parent.parent.name == config_local.COPIES
            node = (path.parent.parent.parent if copy else path.parent.parent).name
            out.append(LocalItem(info, node, copy))
    return sorted(out, key=lambda i: (-i.info.step, str(i.info.path)))


def restart_step(items: list[LocalItem]) -> tuple[int, int] | None:
    """(step, world size): the newest step that the visible items hold, own or copied, for every
    rank of the world size it was saved at (the step an in-place restart at that size loads),
    or None."""
    held: dict[tuple[int, int], set[int]] = {}
    for i in items:
        w = i.info.record.get("world_size")
        if i.info.complete and i.rank is not None and isinstance(w, int) and 0 <= i.rank < w:
            held.setdefault((i.info.step, w), set()).add(i.rank)
    full = [(s, w) for (s, w), ranks in held.items() if len(ranks) == w]
    return max(full) if full else None


def newest_step(items: list[LocalItem]) -> int | None:
    """The newest step of any complete visible item, any rank's, own or a copy: how far training
    got on this tier, whether or not every rank holds it (the requeue hook's progress)."""
    return max((i.info.step for i in items if i.info.complete), default=None)
