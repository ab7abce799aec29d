"""The package's shape, checked on its source: modules of at most 400 lines, and every run-directory
file name and ``HPC_TRAIN_*`` variable spelled in ``hpc_train/rundir.py`` alone (code elsewhere
uses its constants, so a renamed file cannot drift apart between a writer and its readers).
The import layers are checked by import-linter (``lint-imports``, in ``make test``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hpc_train import rundir

PKG = Path(rundir.__file__).resolve().parent
MODULES = sorted(p for p in PKG.rglob("*.py"))
# Every name rundir.py defines for a file, a folder or a variable of a run directory.
NAMES = {v for k, v in vars(rundir).items() if k.isupper() and isinstance(v, str) and v}


def _literals(path: Path) -> list[tuple[int, str]]:
    """(line, value) of the string constants in code that name a run directory's file (a name with
    a dot, or any name joined onto a path with ``/``) or an ``HPC_TRAIN_*`` variable. Docstrings
    are left out (they document); so is a bare word such as the ``logs`` command's name."""
    tree = ast.parse(path.read_text())
    joined = {id(n.right) for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)}
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
            and (n.value.startswith("HPC_TRAIN_") or n.value in NAMES and ("." in n.value or id(n) in joined))]


def test_the_check_sees_the_names():
    assert {"result.json", "stopped.json", "config.yaml", "HPC_TRAIN_RESUME", "HPC_TRAIN_RUN_DIR"} <= NAMES
    assert len(MODULES) > 30


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_module_is_at_most_400_lines(path):
    assert len(path.read_text().splitlines()) <= 400


@pytest.mark.parametrize("path", [p for p in MODULES if p.name != "rundir.py"], ids=lambda p: str(p.relative_to(PKG)))
def test_run_directory_names_live_in_rundir(path):
    found = _literals(path)
    assert not found, f"spelled outside rundir.py (use its constants): {found}"
