"""``keeper.json``: this run's checkpoints are kept by the user's framework, not by hpc_train
(a Hugging Face ``Trainer``'s ``output_dir``, through :mod:`hpc_train.huggingface`). Written by
rank 0 when training begins; read by ``status`` and ``ckpt list`` to name the step a rerun
really resumes from, and by :func:`hpc_train.huggingface.checkpoint_to_resume`. No torch here.

Also the one reader of such a directory's checkpoints (:func:`trainer_checkpoints`): the
Trainer writes ``checkpoint-N/`` with its weights, every rank's RNG state
(``rng_state_R.pth``, or ``rng_state.pth`` for one process) and, last on rank 0,
``trainer_state.json``. A checkpoint is complete when that record says step N and every rank's
RNG file is there; a directory a kill left half-written is skipped, as a rerun must skip it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hpc_train import rundir
from hpc_train.records import fields, io
from hpc_train.records.fields import Bad

NAME = "keeper.json"
TRAINER = "transformers.Trainer"
PREFIX = "checkpoint-"
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
           "adapter_model.safetensors", "adapter_model.bin")


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
    if keeper.model_only:
        return None
    rng = ["rng_state.pth"] if keeper.world_size == 1 else [f"rng_state_{r}.pth" for r in range(keeper.world_size)]
    missing = [n for n in rng if not _is_file(p / n)]
    return f"no {missing[0]} (saved at another world size, or cut off)" if missing else None


def _is_file(p: Path) -> bool:
    return not p.is_symlink() and p.is_file()
