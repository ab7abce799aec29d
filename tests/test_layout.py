"""The package's shape, checked on its source: modules of at most 400 lines; every run-directory
file name and ``HPC_TRAIN_*`` variable spelled in ``hpc_train/rundir.py`` alone, except each
record's name, spelled in its owner alone (code elsewhere uses their constants, so a renamed
file cannot drift apart between a writer and its readers); and each record's JSON read and
written by its owner alone. The import layers are checked by import-linter (``lint-imports``,
in ``make test``), which also keeps ``hpc_train.records.io`` out of reach of non-owners."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from hpc_train import goodput, rundir
from hpc_train.records import jobs, ranks, requeue, result, stop

PKG = Path(rundir.__file__).resolve().parent
MODULES = sorted(p for p in PKG.rglob("*.py"))
# Each record's name, and the one module that owns it.
OWNED = {requeue.NAME: requeue, requeue.PENDING: requeue, ranks.DIR: ranks, stop.NAME: stop, result.NAME: result,
         jobs.NAME: jobs, goodput.FILE: goodput}
# Every name rundir.py defines for a file, a folder or a variable of a run directory, and the records'.
NAMES = {v for k, v in vars(rundir).items() if k.isupper() and isinstance(v, str) and v} | set(OWNED)


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
    assert {"result.json", "stopped.json", "requeue.json", "requeue.pending", "job.json", "goodput.json",
            "config.yaml", "HPC_TRAIN_RESUME", "HPC_TRAIN_RUN_DIR", "HPC_TRAIN_ATTEMPT"} <= NAMES
    assert len(MODULES) > 30


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_module_is_at_most_400_lines(path):
    assert len(path.read_text().splitlines()) <= 400


@pytest.mark.parametrize("path", [p for p in MODULES if p.name != "rundir.py"], ids=lambda p: str(p.relative_to(PKG)))
def test_run_directory_names_live_in_rundir_or_their_owner(path):
    found = [(line, v) for line, v in _literals(path) if Path(OWNED[v].__file__).resolve() != path.resolve()
             ] if path.resolve() in OWNERS else _literals(path)
    assert not found, f"spelled outside rundir.py and the record's owner (use their constants): {found}"


OWNERS = {Path(m.__file__).resolve() for m in OWNED.values()}
JSON_IO = ("read_json", "write_json", "json.loads", "json.load", "json.dump")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_a_record_is_read_and_written_by_its_owner_alone(path):
    """Outside the records' owners, no code names a record's file and no code that reads or
    writes JSON names one either: a module that needs a record asks its owner."""
    if path.resolve() in OWNERS or path.parent.name == "records":
        return
    text = path.read_text()
    named = [name for name in OWNED if f'"{name}"' in text or f"'{name}'" in text]
    assert not named, f"{path.name} spells the record name(s) {named}; use the owner's functions"
    for mod in OWNED.values():
        stem = mod.__name__.rsplit(".", 1)[-1]
        assert f"{stem}.NAME)" not in text.replace(" ", "") or not any(k in text for k in JSON_IO), (
            f"{path.name} reads or writes JSON and builds the path of {mod.__name__}'s record itself")


def test_every_record_has_one_reader_and_one_writer():
    """grep, as the issue asks: a record's JSON is parsed (io.read_json) and written
    (io.write_json or write_atomic) only in its owner module."""
    import re
    for mod in {*OWNED.values()}:
        src = Path(mod.__file__).read_text()
        assert re.search(r"read_json\(", src), f"{mod.__name__} has no reader"
        assert re.search(r"write_json\(|write_atomic\(", src), f"{mod.__name__} has no writer"


def _top_level_names(path: Path) -> set[str]:
    """What a module defines or imports at its top level (``if TYPE_CHECKING:`` blocks excluded:
    nothing there exists at run time)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _resolve(ref: str) -> str | None:
    """None when ``hpc_train.a.b[.name...]`` is a module of the package, or a name at the top of
    the longest module it starts with; else what is missing."""
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        base = PKG.parent.joinpath(*parts[:i])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            rest = parts[i:]
            if rest and rest[0] not in _top_level_names(module):
                return f"{module.relative_to(PKG.parent)} has no {rest[0]}"
            return None
    return "no such module"


REFS = sorted({(p, m[0].rstrip(".")) for p in PKG.rglob("*") if p.suffix in (".py", ".sbatch")
               for m in re.finditer(r"hpc_train(\.[A-Za-z_]\w*)+", p.read_text())})


def test_every_dotted_name_in_the_package_resolves():
    """Docstrings and comments that name ``hpc_train.X`` (``:mod:`` links and plain mentions)
    name a module that exists, or a name defined at the top of one."""
    assert len(REFS) > 100
    wrong = [f"{p.relative_to(PKG)}: {ref} ({why})" for p, ref in REFS if (why := _resolve(ref))]
    assert not wrong, "\n".join(wrong)
