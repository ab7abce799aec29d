"""Whether a run's checkpoints can be resumed under a changed config (torch-free).

Checked before any worker starts (``run``, ``submit``), so a refused change costs no allocation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from hpc_train import rundir
from hpc_train.config import Config
from hpc_train.errors import UsageError

# Resuming with a changed config. These cannot apply to a saved state: the weights or the
# optimizer state would not fit, or the code that trains is another one.
_FIXED_ON_RESUME = ("model.name", "model.hidden", "optim.name", "dist.strategy", "train.fn", "train.script",
                    "train.precision",   # fp16 adds the scaler's state; opt_level is written as precision
                    "data.name", "data.batch_size")   # (the data: a loader resumes mid-epoch by position)
# These describe where and how the job runs, not what it learns: they change freely.
_FREE_ON_RESUME = ("job.", "run_dir", "log.", "dist.backend", "dist.timeout_s", "dist.init_timeout_s",
                   "dist.threads_per_rank", "checkpoint.", "train.script_signal")


def changes_on_resume(old: dict[str, Any], new: Config) -> tuple[list[str], list[str]]:
    """(refused, applied): ``section.key: old -> new`` for each field a resume would change.

    Refused changes make the checkpoint unloadable (another model, optimizer or strategy).
    Everything else applies from the resumed step on (what users expect when they edit a
    config and resume: a lower lr, more steps); the built-in trainer re-applies the optimizer's
    hyperparameters after loading, since the checkpoint carries the old ones.
    """
    def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out
    # A key the old config lacks (a field added since it was written) had its default then.
    before, after = {**flat(Config().to_dict()), **flat(old)}, flat(new.to_dict())
    refused, applied = [], []
    for key in sorted(set(before) | set(after)):
        if before.get(key) == after.get(key) or key.startswith(_FREE_ON_RESUME):
            continue
        line = f"{key}: {before.get(key)!r} -> {after.get(key)!r}"
        (refused if key in _FIXED_ON_RESUME else applied).append(line)
    return refused, applied


def check_resume_changes(run_dir: Path, new: Config, warn) -> None:
    """Before any worker starts: compare with the config the run's checkpoints were made with."""
    old_path = Path(run_dir) / rundir.CONFIG
    if not old_path.is_file() or not any((Path(run_dir) / rundir.CHECKPOINTS).glob(f"step-*/{rundir.COMMIT}")):
        return
    try:
        old = yaml.safe_load(old_path.read_text()) or {}
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return   # unreadable: nothing to compare with; resume's own checks still apply
    if not isinstance(old, dict):
        return
    refused, applied = changes_on_resume(old, new)
    if refused:
        raise UsageError(f"{run_dir} was trained with another config, which its checkpoints cannot load into: "
                         f"{'; '.join(refused)}. Use the original values, or a new --run-dir (or --resume none)")
    for line in applied:
        warn(f"resuming with a changed config: {line} (applies from the resumed step on)")
