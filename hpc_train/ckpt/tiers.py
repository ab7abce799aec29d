"""Which step a restart loads, from which tier: the one answer, without torch.

The restore (:meth:`hpc_train.ckpt.local.tier.LocalTier.choose`, after one all-gather of what each
rank's node holds), ``status``, ``ckpt list`` and the requeue hook's progress check all ask
:func:`choose`, each over what it can see, and judge each item with :func:`foreign`, as the
restore does: an item serves only its own run (the run directory's real path, the config's
digest), job (the tier's ID) and world size, whatever else lies in the same directory.

What this machine sees of the tier (:func:`local_items`): the nodes whose directories it can see
(the dev cluster's nodes share one disk; on a real cluster, where the run's nodes are: a login
node sees none). Items are judged by their commit records; the checksums are checked when a
restore loads one, and a damaged one there falls back as a missing one would.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_train import config_local, rundir
from hpc_train.ckpt import store

if TYPE_CHECKING:
    from hpc_train.config import Config

TIER = "local"   # the commit record's "tier" (hpc_train.ckpt.local.tier writes it)


def node_here(local_dir: str, run_dir: Path | str) -> Path:
    """This process's node directory of ``run_dir``'s local tier (:mod:`hpc_train.config_local`),
    with the ``run`` launcher's ID when this process descends from one."""
    return config_local.this_process(local_dir, run_dir, os.environ.get(rundir.LOCAL_ID_ENV))


@dataclass(frozen=True)
class Identity:
    """What makes a local item this run's. None: any (what the asker cannot know: ``status``
    does not know the ID of a job it did not submit)."""
    run_dir: str                      # the run directory's real path
    config_hash: str | None = None    # the config's digest (hpc_train.config.Config.digest)
    world_size: int | None = None     # the world the restart runs at
    job: str | None = None            # the tier's ID (``hpc_train-ID``)

    @classmethod
    def of(cls, run_dir: Path | str, config_hash: str | None = None, world_size: int | None = None,
           job: str | None = None) -> Identity:
        return cls(str(Path(run_dir).resolve()), config_hash, world_size, job)


def foreign(record: Mapping[str, object], ident: Identity, job: str | None = None) -> str | None:
    """Why an item with this commit record (under the tier's ID ``job``, None: not known) is not
    ``ident``'s, else None."""
    if record.get("tier") != TIER or record.get("run_dir") != ident.run_dir:
        return "another run's"
    if ident.job is not None and job is not None and job != ident.job:
        return f"job {job}'s, not {ident.job}'s"
    w, r = record.get("world_size"), record.get("rank")
    if not (isinstance(w, int) and isinstance(r, int)) or isinstance(w, bool) or isinstance(r, bool) or not 0 <= r < w:
        return "without a valid rank and world size"
    if ident.world_size is not None and w != ident.world_size:
        return f"saved at world size {w}, not {ident.world_size}"
    if ident.config_hash is not None and record.get("config_hash") != ident.config_hash:
        return "saved under another config"
    return None


@dataclass(frozen=True)
class Choice:
    """A restart's answer: ``step`` (-1: none at or above the floor: the shared tier's), the
    world size it was saved at, and the transfers ``(rank, from)`` for the ranks whose node does
    not hold their own item (the holders' indices as the asker numbered them); with no step,
    ``damaged`` says when one was held for every rank but an item the restore would load fails
    its checksums (the restore then goes to the shared tier, as here)."""
    step: int = -1
    world_size: int | None = None
    fetches: tuple[tuple[int, int], ...] = ()
    damaged: str = ""   # why the newest step held for every rank does not serve: an item it loads fails its checks

    @property
    def local(self) -> bool:
        return self.step >= 0


def choose(table: Sequence[Iterable[tuple[int, int]]], world: int, floor: int) -> Choice:
    """From what each holder has (``table[q]``: the (rank, step) pairs of the items holder q's
    node holds, this run's and complete): the newest step, not older than ``floor`` (the shared
    tier's newest; -1: none), held somewhere for every rank of ``world``, and the transfers, each
    from the lowest holder, for the ranks that do not hold their own. Every rank computes the
    same from the same table."""
    holders: dict[tuple[int, int], set[int]] = {}
    for q, pairs in enumerate(table):
        for r, s in pairs:
            holders.setdefault((r, s), set()).add(q)
    ok = [s for s in {s for _, s in holders} if s >= floor and all((r, s) in holders for r in range(world))]
    if not ok:
        return Choice()
    best = max(ok)
    return Choice(best, world, tuple((r, min(holders[(r, best)])) for r in range(world)
                                     if r not in holders[(r, best)]))


@dataclass(frozen=True)
class LocalItem:
    info: store.CkptInfo
    node: str           # the node directory's name (the Slurm node name)
    copy: bool          # a peer's copy (hpc_train.ckpt.local.peer), not the node's own item
    job: str | None = None   # the tier's ID (``hpc_train-ID``)
    slot: int | None = None  # R of the ``rank-R`` directory it lies in (its record must say the same)

    @property
    def rank(self) -> int | None:
        r = self.info.record.get("rank")
        return r if isinstance(r, int) and not isinstance(r, bool) else None

    @property
    def world(self) -> int | None:
        w = self.info.record.get("world_size")
        return w if isinstance(w, int) and not isinstance(w, bool) else None

    def why_not(self, ident: Identity) -> str | None:
        """Why this complete item would not serve a restart of ``ident`` (:func:`foreign`, or it lies
        in another rank's directory than its record names, which the restore never loads), else None."""
        why = foreign(self.info.record, ident, self.job)
        if why is None and self.slot is not None and self.slot != self.rank:
            why = f"in rank-{self.slot}'s directory, saved by rank {self.rank}"
        return why


def numbered(parent: Path, prefix: str) -> list[tuple[int, Path]]:
    """(N, path) of ``parent``'s entries named ``PREFIX-N`` that are not symlinks; none when
    ``parent`` is a symlink itself or cannot be listed (whatever else it holds: any name, any
    file type)."""
    try:
        if parent.is_symlink():
            return []
        return [(n, p) for p in parent.iterdir()
                if (n := rundir.name_number(p.name, prefix)) is not None and not p.is_symlink()]
    except OSError:
        return []


def under(node: Path, *names: str) -> Path | None:
    """``node / names...``, or None where one of the names is a symlink: what is listed or removed
    below a node's directory is never reached through a link (its target is someone else's)."""
    path = node
    for name in names:
        path = path / name
        if path.is_symlink():
            return None
    return path


def on_node(node: Path, job: str | None = None) -> list[LocalItem]:
    """Every item under one node directory of a run (``rank-R/step-N``, and the copies it keeps,
    ``copies/rank-R/step-N``), complete or not, never through a symlink: the one lister of the
    tier's items (the restore's, ``status``'s and ``ckpt list``'s)."""
    out: list[LocalItem] = []
    for parent, is_copy in ((node, False), (node / config_local.COPIES, True)):
        for r, rank_dir in numbered(parent, "rank-"):
            for _, path in numbered(rank_dir, "step-"):
                out.append(LocalItem(store.inspect(path), node.name, is_copy, job, r))
    return out


def local_items(run_dir: Path, local_dir: str, env: Mapping[str, str] | None = None) -> list[LocalItem]:
    """Every item under ``run_dir``'s node directories of the bases this machine can see, newest
    first, whatever their commit records say (:func:`restart` judges them); never through a
    symlinked directory."""
    key = config_local.run_key(run_dir)
    out: list[LocalItem] = []
    for base in config_local.visible_bases(local_dir, os.environ if env is None else env):
        for job_dir in _subdirs(base, config_local.PREFIX):
            for run in _subdirs(job_dir, key):
                job = job_dir.name.removeprefix(config_local.PREFIX)
                for node in _subdirs(run):
                    out.extend(on_node(node, job))
    return sorted(out, key=lambda i: (-i.info.step, str(i.info.path)))


def _subdirs(parent: Path, prefix: str = "") -> list[Path]:
    """``parent``'s directories (not symlinks) whose names start with ``prefix``."""
    try:
        return sorted(p for p in parent.iterdir() if p.name.startswith(prefix) and not p.is_symlink() and p.is_dir())
    except OSError:
        return []


def restart(items: Sequence[LocalItem], ident: Identity, floor: int = -1,
            verify: Callable[[store.CkptInfo], str | None] | None = None) -> Choice:
    """What an in-place restart would load of ``items`` (each node directory one holder): the
    newest step held for every rank, at ``ident``'s world size and job, or, where the asker does
    not know them, of the job and world size of the newest such step (never a mix of two).
    ``verify`` (:func:`hpc_train.ckpt.store.verify_checksums`): the items that step's restore
    would load are checked as the restore checks them; a damaged one makes the answer the shared
    tier's, as it does the restore's."""
    groups: dict[tuple[str | None, int], list[LocalItem]] = {}
    for i in items:
        if i.info.complete and i.why_not(ident) is None:
            groups.setdefault((i.job, int(str(i.world))), []).append(i)   # an int: foreign checked
    best, held = Choice(), []
    for (job, world), members in sorted(groups.items(), key=lambda g: (g[0][1], str(g[0][0]))):
        nodes: dict[str, list[tuple[int, int]]] = {}
        for i in members:
            nodes.setdefault(i.node, []).append((int(str(i.rank)), i.info.step))
        c = choose(list(nodes.values()), world, floor)
        if c.local and c.step >= best.step:
            best, held = c, [i for i in members if i.info.step == c.step]
    return best if verify is None or not best.local else _checked(best, held, verify)


def _checked(choice: Choice, held: Sequence[LocalItem], verify: Callable[[store.CkptInfo], str | None]) -> Choice:
    """``choice``, unless an item its restore loads fails ``verify``: for each rank, its own
    node's item, else the copy on the first node holding one (the restore's order)."""
    loaded: dict[int, LocalItem] = {}
    for i in sorted(held, key=lambda i: (i.copy, i.node)):
        loaded.setdefault(int(str(i.rank)), i)
    from concurrent.futures import ThreadPoolExecutor
    ranks = sorted(loaded)
    # The items read side by side: reading and summing release the GIL, and the hook's
    # decision waits on this before the restart starts.
    with ThreadPoolExecutor(max_workers=max(1, min(len(ranks), os.cpu_count() or 1))) as pool:
        problems = list(pool.map(lambda r: verify(loaded[r].info), ranks))
    for r, problem in zip(ranks, problems):
        if problem is not None:
            return Choice(damaged=f"step {choice.step} of rank {r} ({loaded[r].info.path}): {problem}")
    return choice


def loads(choice: Choice, shared: int | None) -> str:
    """What an in-place restart loads, in words (``status`` and ``ckpt list`` say it alike):
    ``choice`` from :func:`restart`, ``shared`` the shared tier's newest complete step (None: none)."""
    if choice.local and (shared is None or choice.step >= shared):
        return f"step {choice.step} from the node-local tier (every rank of {choice.world_size} held)"
    on_shared = f"the shared tier's step {shared}" if shared is not None else "step 0 (no shared checkpoint yet)"
    if choice.local:
        return f"{on_shared} (the node-local tier's newest, step {choice.step}, is older)"
    return f"{on_shared} (the node-local tier's {choice.damaged})" if choice.damaged else on_shared


def view(run_dir: Path, cfg: Config | None, job: str | None = None) -> tuple[list[LocalItem], Identity]:
    """The items of ``run_dir``'s node-local tier this machine sees, and the identity a restart of
    the run judges them by: the run directory, its config's digest (``cfg``: its config.yaml; None:
    unreadable, any), and its last start's world size and tier ID as rank 0's record says them,
    or ``job``, the asker's own (the requeue hook's job)."""
    from hpc_train.records import ranks
    last, _ = ranks.read(run_dir, 0)
    ident = Identity.of(run_dir, cfg.digest() if cfg is not None else None,
                        last.world_size if last is not None else None,
                        job or (last.tier_id if last is not None else "") or None)
    return local_items(run_dir, cfg.checkpoint.local_dir if cfg is not None else ""), ident


def not_this_runs(items: Sequence[LocalItem], ident: Identity) -> list[tuple[LocalItem, str]]:
    """The complete items under the run's directories that a restart of ``ident`` would not load,
    and why: another job's, world size's or config's leftovers."""
    out = []
    for i in items:
        why = i.why_not(ident) if i.info.complete else None
        if why:
            out.append((i, why))
    return out
