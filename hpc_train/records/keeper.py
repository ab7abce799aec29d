"""``keeper.json``: this run's checkpoints are kept by the user's framework, not by hpc_train
(a Hugging Face ``Trainer``'s ``output_dir``, through :mod:`hpc_train.huggingface`). Written by
rank 0 when training begins; read by ``status`` and ``ckpt list`` to name the step a rerun
really resumes from, and by :func:`hpc_train.huggingface.checkpoint_to_resume`. No torch here.

Also the one reader of such a directory's checkpoints (:func:`trainer_checkpoints`): the
Trainer writes ``checkpoint-N/`` with its weights, every rank's RNG state
(``rng_state_R.pth``, or ``rng_state.pth`` for one process) and, last on rank 0,
``trainer_state.json``. A checkpoint is complete when that record says step N, every rank's
RNG file is there, and no file of it is cut off (:func:`_torn`); a directory a kill left
half-written is skipped, as a rerun must skip it.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from hpc_train import rundir
from hpc_train.records import fields, io
from hpc_train.records.fields import Bad

NAME = "keeper.json"
TRAINER = "transformers.Trainer"
PREFIX = "checkpoint-"
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
           "adapter_model.safetensors", "adapter_model.bin")
ARCHIVES = (".pth", ".pt", ".bin")   # torch.save's files: the RNG states, optimizer, scheduler, scaler, .bin weights
MAX_HEADER = 100 << 20               # a .safetensors header longer than this is not one


@dataclass(frozen=True)
class Keeper:
    """Who keeps the run's checkpoints, where, and for how many ranks."""
    framework: str
    directory: Path
    world_size: int
    model_only: bool = False   # TrainingArguments.save_only_model: no RNG states to check


@dataclass(frozen=True)
class Kept:
    """One ``checkpoint-N`` of the keeper's directory; ``problem`` is None when it is complete."""
    step: int
    path: Path
    problem: str | None

    @property
    def complete(self) -> bool:
        return self.problem is None


def path(run_dir: Path) -> Path:
    return Path(run_dir) / NAME


def write(run_dir: Path, keeper: Keeper) -> None:
    io.write_json(path(run_dir), {"framework": keeper.framework, "directory": str(keeper.directory),
                                  "world_size": keeper.world_size, "model_only": keeper.model_only})


def read(run_dir: Path) -> tuple[Keeper | None, str | None]:
    """(the keeper, None); (None, None) when the run's code keeps no checkpoints of a known
    framework; (None, what is wrong) for a damaged record."""
    raw, problem = io.read_json(path(run_dir))
    if raw is None:
        return None, problem and f"{NAME} {problem}"
    try:
        directory = fields.text(raw, "directory")
        if "\0" in directory or not directory:
            raise Bad("'directory' is not a path")
        return Keeper(fields.text(raw, "framework", choices=(TRAINER,)), Path(directory),
                      fields.count(raw, "world_size", lo=1), fields.flag(raw, "model_only")), None
    except Bad as e:
        return None, f"{NAME}: {e}"


def trainer_checkpoints(keeper: Keeper) -> list[Kept]:
    """The Trainer's ``checkpoint-N`` directories in ``keeper.directory``, oldest first, each
    with what makes it incomplete (None: complete). Any names, bytes and file types: a link or a
    file in a checkpoint's place is incomplete, never followed."""
    try:
        names = os.listdir(keeper.directory)
    except (OSError, ValueError):
        return []
    found = []
    for name in names:
        step = rundir.name_number(name, PREFIX)
        if step is not None:
            p = keeper.directory / name
            found.append(Kept(step, p, _problem(p, step, keeper)))
    return sorted(found, key=lambda k: k.step)


def newest_complete(keeper: Keeper) -> Kept | None:
    """The checkpoint a rerun resumes from: the newest complete one (the Trainer's own
    ``get_last_checkpoint`` would take the newest directory, complete or not)."""
    complete = [k for k in trainer_checkpoints(keeper) if k.complete]
    return complete[-1] if complete else None


def _problem(p: Path, step: int, keeper: Keeper) -> str | None:
    if p.is_symlink() or not p.is_dir():
        return "not a directory"
    state, problem = io.read_json(p / "trainer_state.json")
    if state is None:
        return f"trainer_state.json {problem or 'is missing'} (the Trainer writes it last)"
    if state.get("global_step") != step:
        return f"trainer_state.json says step {state.get('global_step')!r}, not {step}"
    if not any(_is_file(p / w) for w in WEIGHTS):
        return "no model weights"
    if not keeper.model_only:
        rng = ["rng_state.pth"] if keeper.world_size == 1 else [f"rng_state_{r}.pth" for r in range(keeper.world_size)]
        missing = [n for n in rng if not _is_file(p / n)]
        if missing:
            return f"no {missing[0]} (saved at another world size, or cut off)"
    return _torn(p)


def _torn(ck: Path) -> str | None:
    """The first file of ``ck`` that reads as cut off mid-write, else None. The Trainer writes
    its files in place, so a rank killed while writing (its RNG state, say) leaves a file that
    is there but unreadable, and a resume from it fails or is not exact. A torch.save archive
    (``.pth``, ``.pt``, ``.bin`` that starts as a zip) ends with its zip directory; a
    ``.safetensors`` file is exactly its header and the data the header places. Reads a header
    or a tail of each file, never the tensors; any bytes give an answer."""
    try:
        names = sorted(os.listdir(ck))
    except OSError as e:
        return f"cannot be listed ({e.strerror or type(e).__name__})"
    for name in names:
        suffix = os.path.splitext(name)[1]
        if suffix not in ARCHIVES and suffix != ".safetensors":
            continue
        f, problem = rundir.open_read(ck / name)
        if f is None:
            if problem is None:
                continue   # gone since the listing (the Trainer's rotation)
            return f"{name} {problem}"
        with f:
            whole = _archive_whole(f) if suffix in ARCHIVES else _safetensors_whole(f)
        if not whole:
            return f"{name} is cut off (written only in part: a kill during the save)"
    return None


def _archive_whole(f: BinaryIO) -> bool:
    head = f.read(4)
    if head != b"PK\x03\x04":
        return len(head) == 4   # torch.save's legacy format (not a zip): not judged; empty or a stub is cut off
    return zipfile.is_zipfile(f)   # the end-of-directory record, which torch.save writes last


def _safetensors_whole(f: BinaryIO) -> bool:
    raw = f.read(8)
    n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
    if not 0 < n <= MAX_HEADER:
        return False
    try:
        header = json.loads(f.read(n))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        return os.fstat(f.fileno()).st_size == 8 + n + max(ends, default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
        return False


def _is_file(p: Path) -> bool:
    return not p.is_symlink() and p.is_file()
