"""Whether a run's checkpoints can be resumed under a changed config (torch-free).

Checked before any worker starts (``run``, ``submit``), so a refused change costs no allocation.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_train import config, rundir
from hpc_train.advice import FLAGS, Advice
from hpc_train.ckpt import store
from hpc_train.config import Config
from hpc_train.errors import UsageError

# Resuming with a changed config. These cannot apply to a saved state: the weights or the
# optimizer state would not fit. (Which code trains, train.script or train.fn, is compared by
# code_change: a script by its file name, not by the text of the field.)
_FIXED_ON_RESUME = ("model.name", "model.hidden", "optim.name", "dist.strategy",
                    "train.precision",   # fp16 adds the scaler's state; opt_level is written as precision
                    "data.name", "data.batch_size")   # (the data: a loader resumes mid-epoch by position)
_CODE = ("train.script", "train.fn")
# These describe where and how the job runs, not what it learns: they change freely.
_FREE_ON_RESUME = ("job.", "run_dir", "log.", "dist.backend", "dist.timeout_s", "dist.init_timeout_s",
                   "dist.threads_per_rank", "checkpoint.", "train.script_signal")


def changes_on_resume(old: Mapping[str, object], new: Config) -> tuple[list[str], list[str]]:
    """(refused, applied): ``section.key: old -> new`` for each field a resume would change.

    Refused changes make the checkpoint unloadable (another model, optimizer or strategy).
    Everything else applies from the resumed step on (what users expect when they edit a
    config and resume: a lower lr, more steps); the built-in trainer re-applies the optimizer's
    hyperparameters after loading, since the checkpoint carries the old ones.
    """
    def flat(d: Mapping[str, object], prefix: str = "") -> dict[str, object]:
        out: dict[str, object] = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out
    # A key the old config lacks (a field added since it was written) had its default then.
    before, after = {**flat(Config().to_dict()), **flat(old)}, flat(new.to_dict())
    refused: list[str] = []
    applied: list[str] = []
    for key in sorted(set(before) | set(after)):
        if before.get(key) == after.get(key) or key.startswith(_FREE_ON_RESUME) or _same_code(key, before, after):
            continue
        line = f"{key}: {before.get(key)!r} -> {after.get(key)!r}"
        (refused if key in _FIXED_ON_RESUME else applied).append(line)
    return refused, applied


def _same_code(key: str, before: Mapping[str, object], after: Mapping[str, object]) -> bool:
    """Whether ``key`` (flat) names the code, whose changes :func:`code_change` judges: only a
    script moved to another directory is left to show as a change (it applies)."""
    if key not in _CODE:
        return False
    old, new = before.get(key) or "", after.get(key) or ""
    return key == "train.fn" or not (old and new) or os.path.realpath(str(old)) == os.path.realpath(str(new))


def _section(d: Mapping[str, object], name: str) -> Mapping[str, object]:
    """A section of a config read back from YAML; {} when absent or not a mapping (hand-edited)."""
    section = d.get(name)
    return section if isinstance(section, dict) else {}


def _code(d: Mapping[str, object], signature: Mapping[str, object] | None, is_new: bool) -> tuple[str, str] | None:
    """(kind, what) of the code a config trains with: a script by its file, a function by its
    import path, the built-in trainer by its model. None: an old run directory that names no
    code and whose checkpoints carry no model signature (an own program of an hpc_train that did
    not record the script): nothing to compare."""
    train, model = _section(d, "train"), _section(d, "model")
    if train.get("script"):
        return "script", str(train["script"])
    if train.get("fn"):
        return "fn", str(train["fn"])
    if is_new:
        return "builtin", str(model.get("name", Config().model.name))
    return ("builtin", str(signature.get("name"))) if signature else None


def _describe(code: tuple[str, str]) -> str:
    kind, what = code
    return {"script": "the script", "fn": "the function", "builtin": "the built-in trainer"}[kind] + (
        f" (model {what})" if kind == "builtin" else f" {what}")


def code_change(old: Mapping[str, object], new: Mapping[str, object],
                old_signature: Mapping[str, object] | None) -> tuple[str, str] | None:
    """(old, new) descriptions when ``new`` trains with other code than the run directory's
    config ``old`` (``old_signature``: the model its checkpoints record, if any), else None.
    A script is the same script under the same file name: a project directory copied or moved
    with its runs (to scratch, to another machine) is still the same run; a script edited
    between runs is too (its content is never compared)."""
    before, after = _code(old, old_signature, is_new=False), _code(new, None, is_new=True)
    if before is None or after is None:
        return None
    if before[0] == after[0] == "script":
        same = Path(before[1]).name == Path(after[1]).name
    else:
        same = before[0] == after[0] and (before[0] == "builtin" or before[1] == after[1])
    return None if same else (_describe(before), _describe(after))


def _ways_out(run_dir: Path, advice: Advice) -> str:
    """What to do instead, in the words of the path the user took."""
    return (f"give {advice.other_run_dir()} (add {advice.resume(str(run_dir))} to start from its checkpoints), or "
            f"{advice.resume('none')} to start over here (its checkpoints are moved aside)")


def _saved_signature(run_dir: Path) -> dict[str, Any] | None:
    """The model signature the run directory's checkpoints record (the built-in trainer's)."""
    for info in store.scan(run_dir):
        if isinstance(info.record.get("model"), dict):
            return info.record["model"]
    return None


def _old_config(run_dir: Path) -> dict[str, object] | None:
    old, _ = config.read_saved(Path(run_dir))
    return old   # None when unreadable: nothing to compare with; resume's own checks still apply


def check_resume_changes(run_dir: Path, new: Config, warn, advice: Advice = FLAGS) -> None:
    """Before any worker starts: compare with the config the run's checkpoints were made with.
    ``advice``: how the user speaks to hpc_train (a refusal's way out says it their way)."""
    if not any((Path(run_dir) / rundir.CHECKPOINTS).glob(f"step-*/{rundir.COMMIT}")):
        return
    old = _old_config(run_dir)
    if old is None:
        return
    change = code_change(old, new.to_dict(), _saved_signature(run_dir))
    if change:
        again = "its own config" if change[0].startswith("the built-in") else change[0]
        raise UsageError(f"{run_dir} holds checkpoints of {change[0]}; this run is {change[1]}: continue it with "
                         f"{again}, or {_ways_out(run_dir, advice)}")
    refused, applied = changes_on_resume(old, new)
    if refused:
        tail = f"Use the original values, or {advice.other_run_dir()} (or {advice.resume('none')})"
        raise UsageError(f"{run_dir} was trained with another config, which its checkpoints cannot load into: "
                         f"{'; '.join(refused)}. {tail}")
    for line in applied:
        warn(f"resuming with a changed config: {line} (applies from the resumed step on)")


def check_finished(run_dir: Path, new: Config, advice: Advice = FLAGS) -> None:
    """A finished run is never trained again; a rerun that asks for something else (another
    script, or the same script with other arguments) is refused, naming the difference, rather
    than answered with "nothing to do" as though it had been run."""
    old = _old_config(run_dir)
    if old is None:
        return
    how = f"use {advice.resume('none')} to start over, or {advice.other_run_dir()}"
    change = code_change(old, new.to_dict(), _saved_signature(run_dir))
    if change:
        raise UsageError(f"{run_dir} holds a finished run of {change[0]}; this run is {change[1]}: {how}")
    train = _section(old, "train")
    args = train.get("args")
    before, after = [str(a) for a in args] if isinstance(args, list) else [], list(new.train.args)
    if train.get("script") and new.train.script and before != after:
        raise UsageError(f"{run_dir} holds a finished run of {Path(new.train.script).name} with arguments "
                         f"[{shlex.join(before)}]; these are [{shlex.join(after)}]: {how}")
