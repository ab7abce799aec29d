"""``python -m hpc_train ckpt list|verify|export``."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from hpc_train import resume
from hpc_train.errors import UsageError


def _run_dir(arg: str) -> Path:
    p = Path(arg)
    if not p.is_dir():
        raise UsageError(f"ckpt: {p} is not a directory (give a run directory, e.g. runs/digits)")
    if not resume.ckpt_root(p).is_dir():
        raise UsageError(f"ckpt: {p} has no checkpoints/ directory")
    return p


def cmd_list(run_dir: Path) -> int:
    infos = resume.scan(run_dir)
    print(f"{'step':>8}  {'saved at':19}  {'size':>10}  {'world':>5}  status")
    for i in infos:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.record["time"])) if "time" in i.record else "-"
        status = "complete" if i.complete else f"INCOMPLETE: {i.problem}"
        print(f"{i.step:>8}  {when:19}  {i.size / 1e6:>8.2f}MB  {i.record.get('world_size', '-'):>5}  {status}")
    return 0


def verify_one(info: resume.CkptInfo) -> str | None:
    """Beyond sizes: DCP's metadata loads safely and every item lies inside its file."""
    if not info.complete:
        return info.problem
    from hpc_train.checkpoint import SafeReader
    try:
        meta = SafeReader(str(info.path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any failure here means the metadata is unusable
        return f".metadata does not load: {e}"
    sizes = {name: int(n) for name, n in info.record["files"].items()}
    for index, storage in (meta.storage_data or {}).items():
        name = str(storage.relative_path)
        if name not in sizes:
            return f"{index.fqn} points into {name}, which the commit record does not list"
        if storage.offset + storage.length > sizes[name]:
            return f"{index.fqn} lies past the end of {name}"
    return None


def cmd_verify(run_dir: Path) -> int:
    infos = resume.scan(run_dir)
    bad = 0
    for info in infos:
        problem = verify_one(info)
        bad += problem is not None
        print(f"step-{info.step}: {'ok' if problem is None else 'BAD: ' + problem}")
    if not infos:
        print("no checkpoints")
    return 1 if bad else 0


def cmd_export(run_dir: Path, out: str, step: int | None) -> int:
    if step is None:
        info = resume.newest_complete(run_dir)
        if info is None:
            raise UsageError(f"ckpt export: {run_dir} has no complete checkpoint")
    else:
        info = resume.inspect(resume.ckpt_root(run_dir) / f"step-{step}")
        if not info.path.exists():
            steps = ", ".join(str(i.step) for i in resume.scan(run_dir))
            raise UsageError(f"ckpt export: no checkpoint at step {step} (have: {steps or 'none'})")
        if not info.complete:
            raise UsageError(f"ckpt export: step {step} is not complete: {info.problem}")
    from hpc_train.checkpoint import CheckpointError, export
    try:
        n = export(info.path, Path(out))
    except CheckpointError as e:   # e.g. unsafe or unreadable .metadata: one line, exit 2
        raise UsageError(f"ckpt export: {e}") from None
    print(f"exported {n} tensors from step {info.step} to {out} (torch.load(..., weights_only=True))")
    return 0


def cmd_ckpt(args: argparse.Namespace) -> int:
    run_dir = _run_dir(args.run_dir)
    if args.ckpt_command == "list":
        return cmd_list(run_dir)
    if args.ckpt_command == "verify":
        return cmd_verify(run_dir)
    return cmd_export(run_dir, args.out, args.step)
