"""``result.json``: a finished run. It never trains again (every path checks :func:`finished`
before anything else). No torch here.

Its values are the run's own (the trainer's final loss and accuracy, a script's exit code, a
function's return value), so they are free-form; the reader checks that it is an object and
that ``steps``, when present, is a step number. A damaged ``result.json`` still means
finished: only a finished run writes it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from hpc_train import rundir
from hpc_train.records import io
from hpc_train.records import fields
from hpc_train.records.fields import Bad

NAME = "result.json"


def path(run_dir: Path) -> Path:
    return Path(run_dir) / NAME


def finished(run_dir: Path) -> bool:
    p = path(run_dir)
    return p.exists() or p.is_symlink()


def written_since(run_dir: Path, since: float) -> bool:
    """The run finished in a launch that started at ``since`` (or later)."""
    try:
        return path(run_dir).stat().st_mtime >= since
    except OSError:
        return False


def read(run_dir: Path) -> tuple[dict[str, object] | None, str | None]:
    """The result: (values, None); (None, None) when the run is not finished; ({}, what is wrong)
    when it is finished but its record is damaged."""
    raw, problem = io.read_json(path(run_dir))
    if raw is None:
        return ({}, problem) if problem is not None else (None, None)
    try:
        fields.opt_count(raw, "steps")
    except Bad as e:
        return {k: v for k, v in raw.items() if k != "steps"}, str(e)
    return raw, None


def steps(result: Mapping[str, object]) -> int | None:
    try:
        return fields.opt_count(result, "steps")
    except Bad:
        return None


def write(run_dir: Path, result: dict[str, object]) -> None:
    rundir.write_atomic(path(run_dir), json.dumps(result, indent=2, default=str))


def move_aside(run_dir: Path, stamp: str) -> None:
    """``--resume none`` over a finished run: the marker is kept as ``result.old-<stamp>.json``."""
    path(run_dir).rename(Path(run_dir) / f"result.old-{stamp}.json")
