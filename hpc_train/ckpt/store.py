"""Which checkpoint to resume from: the on-disk layout and its validity, without torch.

Layout: ``RUN_DIR/checkpoints/step-N/`` holds DCP's files (``.metadata`` written last by DCP),
one ``rank-R.pt`` per rank (RNG and loader position), and ``commit.json``, written last of
all by hpc_train. A step directory is *complete* only when ``commit.json`` parses, has the
expected fields with the expected types, and every file it lists exists with the recorded size
(cheap: a stat per file). Anything else is skipped with a warning naming it.

``commit.json`` also records checksums (``checksums``; see :mod:`hpc_train.ckpt.checksum`).
Sizes cannot see a same-size bit flip; the checksums can, at the cost of reading every byte.
A resume checks them as it loads (each rank, the bytes it reads); the launcher's :func:`plan`
and ``ckpt verify`` read whole files up front. Only regular files count: a file of a step
directory that is a symlink, a FIFO or a device makes the checkpoint incomplete.

Resume policy (``--resume``):

``latest`` (default)
    the newest complete checkpoint in the run directory; none there means a fresh start,
    but checkpoints that exist and are all invalid are an error: never silently restart over them.
``none``
    start from scratch. Existing checkpoints are moved aside to ``checkpoints.old-<time>/``,
    never deleted or overwritten.
``PATH``
    that checkpoint directory (must be complete and intact, else refused), or a run directory's
    newest. It is loaded even when the run directory has newer checkpoints of its own (going
    back: the newer ones are moved aside, never deleted, once this run saves). Only a *requeued*
    job (Slurm's restart count above 0, where the batch script still names PATH) resumes from
    its own newest checkpoint instead, so that a requeue never goes back to PATH.

This module must stay free of torch: the CLI uses it before launching anything.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from hpc_train import rundir
from hpc_train.ckpt import checksum
from hpc_train.ckpt.checksum import file_checksum  # noqa: F401 - part of this module's API
from hpc_train.errors import UsageError
from hpc_train.records import result

COMMIT = rundir.COMMIT
METADATA = ".metadata"
BUFFERS = "buffers"   # a local item's "layout" (hpc_train.ckpt.local.flat): raw files and a rank-R.pt, no DCP files
CHECKSUM = checksum.CRC32C  # the algorithm write_commit records; see hpc_train.ckpt.checksum
def step_of(name: str) -> int | None:
    """N of a step directory's name ``step-N`` (see :func:`hpc_train.rundir.name_number`)."""
    return rundir.name_number(name, "step-")


class NoneComplete(UsageError):
    """The shared tier holds checkpoints but none is complete and intact: a ``latest`` resume
    refuses to start over them (the node-local tier may still serve: ckpt/prelaunch.py)."""

    def __init__(self, what: str, refusal: str) -> None:
        super().__init__(what + refusal)
        self.what = what    # the finding alone, without the refusal and its way out

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

    @property
    def label(self) -> str:
        return label(self.path)


def label(path: Path) -> str:
    """How every message names a checkpoint: ``step N (PATH)``, N as ``ckpt list`` shows it (a
    directory not named ``step-N``: its path)."""
    n = step_of(Path(path).name)
    return f"step {n} ({path})" if n is not None else str(path)


def ckpt_root(run_dir: Path) -> Path:
    return Path(run_dir) / rundir.CHECKPOINTS


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)   # json true is an int to isinstance


def _record_problem(record: object, step: int) -> str | None:
    """What is wrong with a parsed commit record's fields, if anything. Every field used later
    is checked here, so a hand-edited or rotted record is skipped, never a traceback."""
    if not isinstance(record, dict):
        return "is not an object"
    if not _is_int(record.get("step")):
        return f"step is {record.get('step')!r}, not an integer"
    if record["step"] != step:
        return f"says step {record['step']} in the directory of step {step}"
    files = record.get("files")
    if not isinstance(files, dict) or not files:
        return "files is not a non-empty mapping"
    for name, size in files.items():
        if not _is_int(size) or size < 0:
            return f"the size of {name} is {size!r}, not a byte count"
        if "/" in name or name in ("", ".", ".."):
            return f"lists {name!r}, which is not a file of this directory"
    if "world_size" in record and not (_is_int(record["world_size"]) and record["world_size"] > 0):
        return f"world_size is {record['world_size']!r}"
    if "layout" in record and not isinstance(record["layout"], str):
        return f"layout is {record['layout']!r}, not a name"
    if "state" in record and not isinstance(record["state"], dict):
        return "state is not a mapping"
    differs = record.get("differs_by_rank", [])
    if not isinstance(differs, list) or not all(isinstance(k, str) for k in differs):
        return "differs_by_rank is not a list of state keys"
    if "checksums" in record:    # absent: a checkpoint from before checksums; sizes only
        return checksum.record_problem(record["checksums"], files)
    return None


def inspect(path: Path) -> CkptInfo:
    """Check one step directory against its commit record: fields and sizes (checksums:
    :func:`verify_checksums`)."""
    n = step_of(path.name)
    step = n if n is not None else -1
    commit = path / COMMIT
    # Bounded, never blocking on a FIFO, a directory in its place said as such.
    text, problem = rundir.read_text(commit)
    if text is None:
        return CkptInfo(step, path, False, f"commit record is unreadable: it {problem}" if problem
                        else "no commit record (the save never finished)")
    try:
        record = json.loads(text)
    except (ValueError, RecursionError) as e:
        return CkptInfo(step, path, False, f"commit record is unreadable ({type(e).__name__})")
    why = _record_problem(record, step)
    if why is not None:
        return CkptInfo(step, path, False, f"commit record is unreadable: {why}")
    files = record["files"]
    if record.get("layout") == BUFFERS:
        if not any(rundir.name_number(name, "rank-", ".pt") is not None for name in files):
            return CkptInfo(step, path, False, "commit record lists no rank-R.pt, which holds the item's layout",
                            record)
    elif METADATA not in files:
        return CkptInfo(step, path, False, "commit record lists no DCP .metadata", record)
    for name, size in files.items():
        try:
            # lstat: a symlink is judged as itself, never followed (see checksum.open_regular).
            actual = os.lstat(path / name).st_size
            odd = checksum.regular_problem(path / name)
        except OSError:    # missing, or removed under us (a run pruning while `ckpt list` reads)
            return CkptInfo(step, path, False, f"{name} is missing", record)
        if odd is not None:
            return CkptInfo(step, path, False, f"{name} {odd}", record)
        if actual != size:
            return CkptInfo(step, path, False, f"{name} has {actual} bytes, the record says {size}", record)
    return CkptInfo(step, path, True, None, record)


def verify_checksums(info: CkptInfo) -> str | None:
    """Reads every file of a complete checkpoint: the first whose checksum differs, else None.
    A record without checksums (saved before they existed) passes on sizes alone."""
    if not info.complete:
        return info.problem
    sums = info.record.get("checksums")
    if sums is None:
        return None
    algorithm = sums["algorithm"]
    for name, want in sums["files"].items():
        try:
            got = file_checksum(info.path / name, algorithm)
        except OSError as e:
            return f"{name} cannot be read ({e.strerror or type(e).__name__})"
        if got != want:
            return f"{name} fails its {algorithm} check (recorded {want}, now {got})"
    return None


def modules(record: dict[str, Any]) -> list[str]:
    """The state keys a commit record says hold a module (``state``: key -> kind, see
    :mod:`hpc_train.ckpt.state`); a record from before kinds were recorded: the built-in
    trainer's ``model``."""
    kinds = record.get("state")
    if not isinstance(kinds, dict):
        return ["model"]
    return sorted(k for k, kind in kinds.items() if kind == "module")


def _step_dirs(run_dir: Path) -> list[Path]:
    """Every step directory, newest first, not yet inspected."""
    root = ckpt_root(run_dir)
    if not root.is_dir():
        return []
    found = [(n, p) for p in root.iterdir() if (n := step_of(p.name)) is not None and p.is_dir()]
    return [p for _, p in sorted(found, key=lambda sp: sp[0], reverse=True)]


def scan(run_dir: Path) -> list[CkptInfo]:
    """Every step directory, newest first."""
    return [inspect(p) for p in _step_dirs(run_dir)]


def newest_complete(run_dir: Path, warn=None, verify: bool = False, below: int | None = None) -> CkptInfo | None:
    """The newest complete checkpoint (with ``verify``: whose checksums also match) with a step
    under ``below`` if given; warns about each newer one it passes over. Inspects newest first and
    stops at the one it returns: an inspection stats every file (two per rank)."""
    for p in _step_dirs(run_dir):
        if below is not None and (n := step_of(p.name)) is not None and n >= below:   # n: always
            continue
        info = inspect(p)
        problem = verify_checksums(info) if verify else info.problem
        if problem is None:
            return info
        if warn:
            kind = "incomplete" if not info.complete else "damaged"
            warn(f"skipping {kind} checkpoint {info.label}: {problem}")
    return None


def older_candidate(failed: CkptInfo, warn=None, verify: bool = False) -> CkptInfo | None:
    """After ``failed`` would not load: the next older checkpoint beside it that is complete
    (``verify``: and whose checksums match; the loader checks what it reads anyway), else None."""
    root = failed.path.parent
    return newest_complete(root.parent, warn, verify=verify, below=failed.step) if root.name == "checkpoints" else None


_ASIDE_RE = re.compile(rf"step-({rundir.NAME_NUMBER})\.skipped-([0-9]{{1,18}})(?:-([0-9]{{1,9}}))?")


def moved_aside(run_dir: Path) -> list[Path]:
    """Moved-aside step directories (``step-N.skipped-<time>[-k]``), newest move first."""
    root = ckpt_root(run_dir)
    if not root.is_dir():
        return []
    found = [(m, p) for p in root.iterdir() if (m := _ASIDE_RE.fullmatch(p.name)) and p.is_dir()]
    return [p for m, p in sorted(found, key=lambda mp: (int(mp[0].group(2)), int(mp[0].group(3) or 0),
                                                          int(mp[0].group(1))), reverse=True)]


def is_finished(run_dir: Path) -> bool:
    return result.finished(Path(run_dir))


@dataclass
class ResumePlan:
    source: CkptInfo | None        # what to load; None = fresh start
    finished: bool = False
    moved_aside: Path | None = None
    fresh: bool = False            # --resume none: code that keeps its own checkpoints starts over too

    def describe(self, own_code: str = "") -> str:
        """One line for the console. ``own_code`` names a script or function: hpc_train cannot see
        what such code restores by itself, so without a checkpoint of hpc_train's it says what
        each kind of code does."""
        if self.source is None:
            if own_code:
                return (f"no hpc_train checkpoint to resume: {own_code} starts from step 0 if it steps through "
                        f"hpc_train.init(), or from its own checkpoints if it loads them itself (a Trainer "
                        f"script: hpc_train.huggingface, docs/huggingface.md)")
            return "starting fresh"
        return f"resuming from {self.source.label}"

    def env_value(self) -> str:
        """Passed to workers as HPC_TRAIN_RESUME: the checkpoint path, 'none' after ``--resume
        none`` (a script's own resume, hpc_train.huggingface's, starts over; hpc_train's restore
        finds nothing either way), else 'latest'. A requeue or an in-place restart is passed
        'latest' by its batch script: the run then finds its own saves."""
        return str(self.source.path) if self.source else "none" if self.fresh else "latest"


def _given(run_dir: Path, mode: str, signature: dict[str, Any] | None, warn, verify: bool,
           requeued: bool) -> ResumePlan:
    """:func:`plan` for ``--resume PATH`` (a step directory or another run directory)."""
    path = Path(mode)
    if not path.exists():
        raise UsageError(f"--resume {mode}: no such checkpoint directory (use latest, none, or a "
                         f"RUN_DIR/checkpoints/step-N path; `python -m hpc_train ckpt list RUN_DIR` lists them)")
    if path.is_dir() and ckpt_root(path).is_dir():   # a run directory was given
        found = newest_complete(path, warn, verify)
        if found is None:
            raise UsageError(f"--resume {mode}: that run directory has no complete checkpoint")
        path = found.path
    own = newest_complete(run_dir, warn, verify) if requeued else None
    if own is not None:          # a requeued run continues from its own newest save
        check_compatible(own, signature)
        return ResumePlan(own)
    if not path.is_dir():
        raise UsageError(f"--resume {mode}: not a directory (give a RUN_DIR/checkpoints/step-N directory or a "
                         f"run directory)")
    info = inspect(path)
    if not info.complete:
        raise UsageError(f"--resume {mode}: checkpoint is not complete: {info.problem}")
    problem = verify_checksums(info) if verify else None
    if problem is not None:
        raise UsageError(f"--resume {mode}: checkpoint is damaged: {problem}")
    check_compatible(info, signature)
    return ResumePlan(info)


def plan(run_dir: Path, mode: str, signature: dict[str, Any] | None = None, warn=None,
         verify: bool = True, requeued: bool = False) -> ResumePlan:
    """Decide what to resume from. Raises :class:`UsageError` before anything is changed.
    ``verify``: also check the checksums of what is chosen (reads it whole), passing over
    damaged ones to the next older. ``signature``: the model signature the code that will load
    it records (the built-in trainer's: :mod:`hpc_train.trainer.signature`), checked before
    loading. ``requeued``: this is a requeued job's restart (an explicit PATH then yields to the
    run directory's own newest checkpoint)."""
    run_dir = Path(run_dir)
    if is_finished(run_dir) and mode != "none":
        return ResumePlan(None, finished=True)
    infos = scan(run_dir)
    if mode == "none":
        if not infos and not is_finished(run_dir):
            return ResumePlan(None, fresh=True)
        # Nothing is deleted: the old checkpoints (and the finished marker) are moved aside.
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = run_dir / f"checkpoints.old-{stamp}"
        if infos:
            ckpt_root(run_dir).rename(aside)
        if is_finished(run_dir):
            result.move_aside(run_dir, stamp)
        return ResumePlan(None, moved_aside=aside if infos else None, fresh=True)
    if mode != "latest":
        return _given(run_dir, mode, signature, warn, verify, requeued)
    # Warnings are collected, not printed: when none is usable, the error below names them all.
    skipped: list[str] = []
    found = newest_complete(run_dir, skipped.append, verify)
    if found is not None and warn:
        for line in skipped:
            warn(line)
    if found is None and infos:
        problems = {i.step: (verify_checksums(i) if verify else i.problem) for i in infos[:5]}
        listing = "; ".join(f"step {i.step}: {problems[i.step]}" for i in infos[:5])
        raise NoneComplete(f"{ckpt_root(run_dir)} holds checkpoints but none is complete and intact ({listing})",
                           "; refusing to restart from scratch over them. Use --resume none to move them aside and "
                           "start over, or --resume PATH")
    if found is not None:
        check_compatible(found, signature)
    return ResumePlan(found)


def check_compatible(info: CkptInfo, signature: dict[str, Any] | None) -> None:
    """Refuse, before loading, a checkpoint whose model signature differs (shapes would not fit)."""
    saved = info.record.get("model")
    if signature is not None and saved is not None and saved != signature:
        raise UsageError(f"checkpoint {info.label} was saved with model config {saved}, but this config has "
                         f"{signature}; the weights would not fit. Use the original config, or a new --run-dir")


def write_commit(path: Path, record: dict[str, Any], sums: dict[str, Any] | None = None,
                 checksums: bool = True, warn=None, durable: bool = True) -> None:
    """Write ``commit.json`` last, atomically and durably: tmp, fsync, rename, fsync the directory.
    ``sums``: the checksums computed as the files were written (``{"files": {name: crc},
    "items": {name: rows}}``, CRC32C); a file they do not cover is read back, with a warning.
    ``checksums``: ``False`` records none (only to measure their cost). ``durable=False``: atomic
    (tmp, rename) but not fsync'd, for the node-local tier (see :mod:`hpc_train.ckpt.local.tier`)."""
    record = dict(record)
    names = [p for p in sorted(path.iterdir()) if p.is_file() and p.name != COMMIT and not p.name.endswith(".tmp")]
    record["files"] = {p.name: p.stat().st_size for p in names}
    if checksums:
        given = dict((sums or {}).get("files", {}))
        unsummed = [p.name for p in names if p.name not in given]
        if unsummed and sums is not None and warn:
            warn(f"{path}: no checksum was computed while writing {', '.join(unsummed)}; reading it back")
        files = {p.name: given[p.name] if p.name in given else file_checksum(p) for p in names}
        items = {n: rows for n, rows in (sums or {}).get("items", {}).items() if n in files}
        record["checksums"] = {"algorithm": CHECKSUM, "files": files, **({"items": items} if items else {})}
    tmp = path / (COMMIT + ".tmp")
    from hpc_train.rundir import open_nofollow
    with os.fdopen(open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as f:   # not through a link
        json.dump(record, f, indent=2)
        f.flush()
        if durable:
            os.fsync(f.fileno())
    os.replace(tmp, path / COMMIT)
    if not durable:
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
