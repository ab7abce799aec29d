"""JSON for the records' owners: read whatever bytes are there, write atomically. No torch here.

Only the owners of the run directory's records (the modules of :mod:`hpc_train.records`, and
:mod:`hpc_train.goodput` for its ledger) read and write JSON records through here; an
import-linter contract keeps everything else out (``pyproject.toml``), so no other module parses
or edits a record's JSON itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar, overload

from hpc_train.rundir import read_text, write_atomic

T = TypeVar("T")


def write_json(path: Path, obj: object) -> None:
    write_atomic(Path(path), json.dumps(obj, indent=2, default=str))


_TYPE_NAMES: dict[type, str] = {dict: "an object", list: "a list", str: "a string", int: "an integer",
                                float: "a number", bool: "true/false", type(None): "null"}


@overload
def read_json(path: Path) -> tuple[dict[str, object] | None, str | None]: ...
@overload
def read_json(path: Path, expect: type[T]) -> tuple[T | None, str | None]: ...


def read_json(path: Path, expect: type = dict) -> tuple[object, str | None]:
    """A JSON record of the run directory, taking whatever bytes are there: (value, None) when it
    parses and is an ``expect``; (None, None) when it does not exist; else (None, what is wrong:
    empty, not JSON, the wrong type, a directory in its place...). Every reader of a run
    directory's records goes through here, so none of them can raise on a damaged one; each
    checks its own fields."""
    text, problem = read_text(Path(path))
    if text is None:
        return None, problem
    if not text.strip():
        return None, "is empty"
    try:
        value = json.loads(text)
    except ValueError:
        return None, "is not valid JSON"
    except RecursionError:   # nesting deeper than the parser's stack: no record is written so
        return None, "is nested too deeply for a record"
    if not isinstance(value, expect) or (expect is not bool and isinstance(value, bool)):
        return None, f"holds {_TYPE_NAMES.get(type(value), type(value).__name__)}, not {_TYPE_NAMES.get(expect, expect.__name__)}"
    return value, None
