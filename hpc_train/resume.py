"""Which checkpoint to resume from: the on-disk layout and its validity, without torch.

Layout: ``RUN_DIR/checkpoints/step-N/`` holds DCP's files (``.metadata`` written last by DCP),
one ``rank-R.pt`` per rank (RNG and loader position), and ``commit.json``, written last of
all by hpc_train. A step directory is *complete* only when ``commit.json`` parses and every
file it lists exists with the recorded size. Anything else is skipped with a warning naming it.

Resume policy (``--resume``):

``latest`` (default)
    the newest complete checkpoint in the run directory; none there means a fresh start,
    but checkpoints that exist and are all invalid are an error: never silently restart over them.
``none``
    start from scratch. Existing checkpoints are moved aside to ``checkpoints.old-<time>/``,
    never deleted or overwritten.
``PATH``
    that checkpoint directory (must be complete). Once the run directory has its own
    complete checkpoint, a requeued run resumes from that instead.

This module must stay free of torch: the CLI uses it before launching anything.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_train.errors import UsageError

COMMIT = "commit.json"
METADATA = ".metadata"
_STEP_RE = re.compile(r"^step-(\d+)$")


@dataclass
class CkptInfo:
    step: int
    path: Path
    complete: bool
    problem: str | None = None
    record: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return sum(int(v) for v in self.record.get("files", {}).values())


def ckpt_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def inspect(path: Path) -> CkptInfo:
    """Check one step directory against its commit record (sizes; see ``ckpt verify`` for more)."""
    m = _STEP_RE.match(path.name)
    step = int(m.group(1)) if m else -1
    commit = path / COMMIT
    try:
        text = commit.read_text()
    except FileNotFoundError:
        return CkptInfo(step, path, False, "no commit record (the save never finished)")
    try:
        record = json.loads(text)
        files = record["files"]
        if not isinstance(files, dict) or record["step"] != step:
            raise ValueError("bad fields")
    except (ValueError, KeyError, TypeError) as e:
        return CkptInfo(step, path, False, f"commit record is unreadable ({type(e).__name__})")
    if METADATA not in files:
        return CkptInfo(step, path, False, "commit record lists no DCP .metadata", record)
    for name, size in files.items():
        try:
            actual = (path / name).stat().st_size
        except OSError:    # missing, or removed under us (a run pruning while `ckpt list` reads)
            return CkptInfo(step, path, False, f"{name} is missing", record)
        if actual != int(size):
            return CkptInfo(step, path, False, f"{name} has {actual} bytes, the record says {size}", record)
    return CkptInfo(step, path, True, None, record)


def scan(run_dir: Path) -> list[CkptInfo]:
    """Every step directory, newest first."""
    root = ckpt_root(run_dir)
    if not root.is_dir():
        return []
    infos = [inspect(p) for p in root.iterdir() if p.is_dir() and _STEP_RE.match(p.name)]
    return sorted(infos, key=lambda i: i.step, reverse=True)


def newest_complete(run_dir: Path, warn=None) -> CkptInfo | None:
    for info in scan(run_dir):
        if info.complete:
            return info
        if warn:
            warn(f"skipping incomplete checkpoint {info.path}: {info.problem}")
    return None


def is_finished(run_dir: Path) -> bool:
    return (Path(run_dir) / "result.json").exists()


@dataclass
class ResumePlan:
    source: CkptInfo | None        # what to load; None = fresh start
    finished: bool = False
    moved_aside: Path | None = None

    def describe(self) -> str:
        if self.source is None:
            return "starting fresh"
        return f"resuming from step {self.source.step} ({self.source.path})"

    def env_value(self) -> str:
        """Passed to workers as HPC_TRAIN_RESUME: the checkpoint path, or 'latest' (which finds
        nothing after a fresh plan; a requeued run then finds its own saves)."""
        return str(self.source.path) if self.source else "latest"


def plan(run_dir: Path, mode: str, cfg: Any = None, warn=None) -> ResumePlan:
    """Decide what to resume from. Raises :class:`UsageError` before anything is changed."""
    run_dir = Path(run_dir)
    if is_finished(run_dir) and mode != "none":
        return ResumePlan(None, finished=True)
    infos = scan(run_dir)
    if mode == "none":
        if not infos and not is_finished(run_dir):
            return ResumePlan(None)
        # Nothing is deleted: the old checkpoints (and the finished marker) are moved aside.
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = run_dir / f"checkpoints.old-{stamp}"
        if infos:
            ckpt_root(run_dir).rename(aside)
        if is_finished(run_dir):
            (run_dir / "result.json").rename(run_dir / f"result.old-{stamp}.json")
        return ResumePlan(None, moved_aside=aside if infos else None)
    if mode != "latest":
        path = Path(mode)
        if not path.exists():
            raise UsageError(f"--resume {mode}: no such checkpoint directory (use latest, none, or a "
                             f"RUN_DIR/checkpoints/step-N path; `python -m hpc_train ckpt list RUN_DIR` lists them)")
        if path.is_dir() and ckpt_root(path).is_dir():   # a run directory was given
            found = newest_complete(path, warn)
            if found is None:
                raise UsageError(f"--resume {mode}: that run directory has no complete checkpoint")
            path = found.path
        own = newest_complete(run_dir, warn)
        if own is not None:          # a requeued run continues from its own newest save
            if cfg is not None:
                check_compatible(own, cfg)
            return ResumePlan(own)
        info = inspect(path)
        if not info.complete:
            raise UsageError(f"--resume {mode}: checkpoint is not complete: {info.problem}")
        if cfg is not None:
            check_compatible(info, cfg)
        return ResumePlan(info)
    found = newest_complete(run_dir)
    if found is not None and warn:   # when none is complete, the error below names them all
        for skipped in (i for i in infos if i.step > found.step):
            warn(f"skipping incomplete checkpoint {skipped.path}: {skipped.problem}")
    if found is None and infos:
        listing = "; ".join(f"{i.path.name}: {i.problem}" for i in infos[:5])
        raise UsageError(f"{ckpt_root(run_dir)} holds checkpoints but none is complete ({listing}); refusing to "
                         f"restart from scratch over them. Use --resume none to move them aside and start over, "
                         f"or --resume PATH")
    if found is not None and cfg is not None:
        check_compatible(found, cfg)
    return ResumePlan(found)


def check_compatible(info: CkptInfo, cfg: Any) -> None:
    """Refuse, before loading, a checkpoint whose model config differs (shapes would not fit)."""
    saved = info.record.get("model")
    if saved is not None and saved != model_signature(cfg):
        raise UsageError(f"checkpoint {info.path} was saved with model config {saved}, but this config has "
                         f"{model_signature(cfg)}; the weights would not fit. Use the original config, or a new "
                         f"--run-dir")


def model_signature(cfg: Any) -> dict[str, Any]:
    return {"name": cfg.model.name, "hidden": cfg.model.hidden}


def write_commit(path: Path, record: dict[str, Any]) -> None:
    """Write ``commit.json`` last, atomically and durably: tmp, fsync, rename, fsync the directory."""
    record = dict(record)
    record["files"] = {p.name: p.stat().st_size for p in sorted(path.iterdir())
                       if p.is_file() and p.name != COMMIT and not p.name.endswith(".tmp")}
    tmp = path / (COMMIT + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / COMMIT)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
