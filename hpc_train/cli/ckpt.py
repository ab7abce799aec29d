"""``python -m hpc_train ckpt list|verify|export``."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_train import config_local, rundir
from hpc_train.ckpt import store, tiers
from hpc_train.errors import UsageError

if TYPE_CHECKING:
    from hpc_train.records.keeper import Keeper


def _kept(keeper: Keeper) -> int:
    """``ckpt list`` of a run whose framework keeps its checkpoints (``keeper.json``, read by
    :func:`_run_dir`: a Trainer's output_dir): those, newest last, each complete or why not."""
    from hpc_train.records import keeper as keeper_record
    kept = keeper_record.trainer_checkpoints(keeper)
    print(f"the Trainer's checkpoints in {keeper.directory} (hpc_train keeps none for this run; a rerun "
          f"resumes from the newest complete one):")
    if not kept:
        print("  none")
    for k in kept:
        print(f"{k.step:>8}  {k.path.name}  {'complete' if k.complete else f'INCOMPLETE: {k.problem}'}")
    return 0


def _run_dir(arg: str, local_too: bool = False, kept_too: bool = False) -> tuple[Path, Keeper | None]:
    """The run directory of a ``ckpt`` command, and its keeper (``keeper.json``) when that is
    where its checkpoints are, else None; ``local_too``: one whose only checkpoints are
    node-local items (``ckpt list``) is one too; ``kept_too``: so is one whose framework keeps
    them, and then the keeper, read once here, is what ``ckpt list`` shows."""
    p = Path(arg)
    if not p.is_dir():
        raise UsageError(f"ckpt: {p} is not a directory (give a run directory, e.g. runs/digits)")
    if store.ckpt_root(p).is_dir():
        return p, None
    from hpc_train.records import keeper as keeper_record
    keeper = keeper_record.read(p)[0]
    if keeper is not None and kept_too:
        return p, keeper
    if local_too and _local_view(p)[0]:
        return p, None
    if keeper is not None:
        raise UsageError(f"ckpt: {p} has no hpc_train checkpoints: its Trainer keeps them in {keeper.directory} "
                         f"(`ckpt list` shows them)")
    from hpc_train import config
    if config.runs_own_code(p):
        raise UsageError(f"ckpt: {p} has no hpc_train checkpoints (no checkpoints/ directory): hpc_train saves "
                         f"here only for code that calls hpc_train.init(); a script's own checkpoints are "
                         f"wherever it writes them")
    raise UsageError(f"ckpt: {p} has no checkpoints/ directory")


def _du(root: Path) -> int:
    """Bytes in files under ``root`` (a run may be pruning while we walk: vanished files count 0)."""
    total = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
            except OSError:
                pass
    return total


def _keep_skipped(run_dir: Path) -> int:
    """The run's checkpoint.keep_skipped (its config.yaml), else the default."""
    from hpc_train import config
    try:
        return config.load(run_dir / rundir.CONFIG).checkpoint.keep_skipped
    except (UsageError, OSError):
        return config.CheckpointSection().keep_skipped


def cmd_list(run_dir: Path, keeper: Keeper | None = None) -> int:
    if keeper is not None:
        return _kept(keeper)
    keep_skipped = _keep_skipped(run_dir)
    infos = store.scan(run_dir)
    print(f"{'step':>8}  {'saved at':19}  {'size':>10}  {'world':>5}  status")
    for i in infos:
        print(f"{i.step:>8}  {_when(i)}  {i.size / 1e6:>8.2f}MB  {i.record.get('world_size', '-'):>5}  "
              f"{'complete' if i.complete else f'INCOMPLETE: {i.problem}'}")
    aside = store.moved_aside(run_dir)
    if aside:
        print(f"moved aside by a resume, as incomplete or damaged: {len(aside)} (kept for you to look at; "
              f"the newest {keep_skipped} are kept, older ones removed: checkpoint.keep_skipped)")
    for a in aside:
        print(f"  {a.name}  {_du(a) / 1e6:.2f}MB")
    print(f"disk use of {store.ckpt_root(run_dir)}: {_du(store.ckpt_root(run_dir)) / 1e6:.2f}MB")
    _list_local(run_dir)
    return 0


def _when(i: store.CkptInfo) -> str:
    t = i.record.get("time")
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t)) if isinstance(t, (int, float)) else '-':19}"


def _local_view(run_dir: Path) -> tuple[list[tiers.LocalItem], tiers.Identity]:
    """The node-local tier's items of this run that this machine can see, and the identity a
    restart would judge them by (hpc_train.ckpt.tiers.view): those of its own node(s) when ``ckpt
    list`` runs where the run does; a login node sees none."""
    from hpc_train import config
    try:
        cfg = config.load(run_dir / rundir.CONFIG)
    except (UsageError, OSError):
        cfg = None
    return tiers.view(run_dir, cfg)


def _list_local(run_dir: Path) -> None:
    """The local items (a login node, or a run without the tier: nothing to say); each that a
    restart of this run would not load says why (another config's, a world size's, a record
    that is not this run's). Then what a restart in place loads, as the restore decides it."""
    seen, ident = _local_view(run_dir)
    why = {id(item): reason for item, reason in tiers.not_this_runs(seen, ident)}
    if seen:
        print("local tier (node-local, one item per rank; the newest step every rank holds is restored first):")
    for item in seen:
        i = item.info
        where = _where(item)
        status = "" if i.complete else f"  INCOMPLETE: {i.problem}"
        status += f"  NOT LOADED: {why[id(item)]}" if id(item) in why else ""
        print(f"{i.step:>8}  {_when(i)}  {i.size / 1e6:>8.2f}MB  {i.record.get('world_size', '-'):>5}  "
              f"{'copy ' if item.copy else 'local'} {where}  {i.path}{status}")
    _restart_line(run_dir, seen, ident)


def _where(item: tiers.LocalItem) -> str:
    return f"{item.node}/{config_local.COPIES + '/' if item.copy else ''}rank-{item.info.record.get('rank')}"


def _restart_line(run_dir: Path, seen: list[tiers.LocalItem], ident: tiers.Identity,
                  verify: Callable[[store.CkptInfo], str | None] = store.verify_checksums) -> None:
    """What a restart in place loads, as the restore decides it (hpc_train.ckpt.tiers), when this
    machine sees items of the run's node-local tier (from elsewhere, ``status`` says what it can).
    ``verify``: how an item's checksums are read back (``ckpt verify`` hands in what it found)."""
    if not seen:
        return
    shared = store.newest_complete(run_dir)
    chosen = tiers.restart(seen, ident, verify=verify)
    print(f"a restart in place loads {tiers.loads(chosen, shared.step if shared else None)}")


def verify_one(info: store.CkptInfo) -> str | None:
    """Beyond sizes: DCP's metadata loads safely, every item lies inside its file, and every
    file matches its recorded checksum."""
    if not info.complete:
        return info.problem
    from hpc_train.ckpt.safe import SafeReader
    try:
        meta = SafeReader(str(info.path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any failure here means the metadata is unusable
        return f".metadata does not load: {e}"
    sizes = {name: int(n) for name, n in info.record["files"].items()}
    # A damaged .metadata can unpickle into objects that lack a field or hold the wrong type
    # (a flipped bit in a field's name): read every field defensively.
    storage_data = getattr(meta, "storage_data", None)
    if not isinstance(storage_data, dict):
        return f".metadata is malformed: its storage_data is {type(storage_data).__name__}, not a dict"
    for index, storage in storage_data.items():
        fqn = getattr(index, "fqn", index)
        name, offset, length = (getattr(storage, k, None) for k in ("relative_path", "offset", "length"))
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
            return f".metadata is malformed: the entry for {fqn} has offset {offset!r}, length {length!r}"
        if str(name) not in sizes:
            return f"{fqn} points into {name}, which the commit record does not list"
        if offset + length > sizes[str(name)]:
            return f"{fqn} lies past the end of {name}"
    return store.verify_checksums(info)


def cmd_verify(run_dir: Path) -> int:
    """Every shared checkpoint, and every node-local item of this run this machine sees, read back
    against its checksums; then what a restart in place loads. Exit 1 when one is damaged."""
    infos = store.scan(run_dir)
    bad = 0
    for info in infos:
        problem = verify_one(info)
        bad += problem is not None
        print(f"step {info.step}: {'ok' if problem is None else 'BAD: ' + problem}")
    seen, ident = _local_view(run_dir)
    mine = [i for i in seen if not i.info.complete or i.why_not(ident) is None]
    found: dict[int, str | None] = {}     # each item read back once: the restart line reuses it
    for item in mine:
        problem = item.info.problem if not item.info.complete else store.verify_checksums(item.info)
        found[id(item.info)] = problem
        bad += problem is not None
        print(f"local step {item.info.step} ({_where(item)}): {'ok' if problem is None else 'BAD: ' + problem}")
    if not infos and not mine:
        print("no checkpoints")
    _restart_line(run_dir, seen, ident,
                  lambda info: found[id(info)] if id(info) in found else store.verify_checksums(info))
    return 1 if bad else 0


def _check_out(run_dir: Path, out: Path, force: bool) -> None:
    """Refuse, before reading anything, an OUT that export must not write."""
    if out.is_dir():
        raise UsageError(f"ckpt export: {out} is a directory; give a file name, e.g. {out / 'model.pt'}")
    parent = out.parent.resolve()
    if not parent.is_dir():
        raise UsageError(f"ckpt export: {out.parent} does not exist; create it first")
    root = store.ckpt_root(run_dir).resolve()
    if parent == root or root in parent.parents:
        raise UsageError(f"ckpt export: {out} is inside {root}, which holds the run's checkpoints; write it elsewhere")
    if (out.exists() or out.is_symlink()) and not force:
        raise UsageError(f"ckpt export: {out} exists; pass --force to replace it")


def _module_key(info: store.CkptInfo, key: str | None) -> str:
    """Which module of the checkpoint to export: ``key``, else the only one it holds."""
    mods = store.modules(info.record)
    if key is None and len(mods) == 1:
        return mods[0]
    if key is not None and key in mods:
        return key
    if key is not None:
        raise UsageError(f"ckpt export: --key {key}: step {info.step} holds no module of that name "
                         f"(its modules: {', '.join(mods) or 'none'})")
    if not mods:
        kinds = ", ".join(f"{k} ({v})" for k, v in info.record["state"].items())
        raise UsageError(f"ckpt export: step {info.step} holds no module to export (its state: {kinds})")
    raise UsageError(f"ckpt export: step {info.step} holds {len(mods)} modules ({', '.join(mods)}); "
                     f"pick one with --key NAME")


def cmd_export(run_dir: Path, out: str, step: int | None, force: bool = False, key: str | None = None) -> int:
    _check_out(run_dir, Path(out), force)
    if step is None:
        info = store.newest_complete(run_dir)
        if info is None:
            raise UsageError(f"ckpt export: {run_dir} has no complete checkpoint")
    else:
        info = store.inspect(store.ckpt_root(run_dir) / f"step-{step}")
        if not info.path.exists():
            steps = ", ".join(str(i.step) for i in store.scan(run_dir))
            raise UsageError(f"ckpt export: no checkpoint at step {step} (have: {steps or 'none'})")
        if not info.complete:
            raise UsageError(f"ckpt export: step {step} is not complete: {info.problem}")
    key = _module_key(info, key)
    from hpc_train.ckpt.shared.export import CheckpointError, export
    try:
        n = export(info.path, Path(out), key)
    except CheckpointError as e:   # e.g. unsafe or unreadable .metadata: one line, exit 2
        raise UsageError(f"ckpt export: {e}") from None
    print(f"exported {n} tensors of state[{key!r}] from step {info.step} to {out} "
          f"(torch.load(..., weights_only=True))")
    return 0


def cmd_ckpt(args: argparse.Namespace) -> int:
    run_dir, keeper = _run_dir(args.run_dir, local_too=args.ckpt_command in ("list", "verify"),
                               kept_too=args.ckpt_command == "list")
    if args.ckpt_command == "list":
        return cmd_list(run_dir, keeper)
    if args.ckpt_command == "verify":
        return cmd_verify(run_dir)
    return cmd_export(run_dir, args.out, args.step, getattr(args, "force", False), getattr(args, "key", None))
