"""The package's shape, checked on its source: no function over 60 lines (modules are split by
idea, not by size; a named table is the exception); every run-directory file name and
``HPC_TRAIN_*`` variable spelled in ``hpc_train/rundir.py`` alone, except each record's name,
spelled in its owner alone (code elsewhere uses their constants, so a renamed file cannot drift
apart between a writer and its readers); each record's JSON read and written by its owner alone;
and import-linter's hand-kept lists derived from the import graph (every torch-free module is in
the torch-free contract; every torch module of ``hpc_train.ckpt`` is forbidden to the login side).
The import layers themselves are checked by import-linter (``lint-imports``, in ``make test``),
which also keeps ``hpc_train.records.io`` out of reach of non-owners."""

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
    a dot, or any name joined onto a path with ``/``) or hold an ``HPC_TRAIN_*`` variable's name
    (alone, in a longer string, in an f-string), and of keyword arguments named after one.
    Docstrings are left out (they document); so is a bare word such as the ``logs`` command's name."""
    tree = ast.parse(path.read_text())
    joined = {id(n.right) for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)}
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    found = [(n.lineno, n.value) for n in ast.walk(tree)
             if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
             and (ENV_NAME.search(n.value) or n.value in NAMES and ("." in n.value or id(n) in joined))]
    # A variable's name can also be spelled as a keyword (``dict(HPC_TRAIN_X=...)``).
    return found + [(n.value.lineno, n.arg) for n in ast.walk(tree)
                    if isinstance(n, ast.keyword) and n.arg and ENV_NAME.search(n.arg)]


# An HPC_TRAIN_* variable's name anywhere in a string (an f-string's parts too, or a shell line).
ENV_NAME = re.compile(r"HPC_TRAIN_[A-Z]")


def test_the_check_sees_a_name_in_an_f_string_and_as_a_keyword(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('x = 1\nline = f"export HPC_TRAIN_RESUME={x}"\nenv = dict(HPC_TRAIN_ATTEMPT="2")\n')
    assert [line for line, _ in _literals(f)] == [2, 3]


def test_the_check_sees_the_names():
    assert {"result.json", "stopped.json", "requeue.json", "requeue.pending", "job.json", "goodput.json",
            "config.yaml", "HPC_TRAIN_RESUME", "HPC_TRAIN_RUN_DIR", "HPC_TRAIN_ATTEMPT"} <= NAMES
    assert len(MODULES) > 30


# The function budget's named exceptions, each with its reason.
LONG_FUNCTIONS = {
    "cli/main.py:build_parser": "a table: every command and its flags, read top to bottom",
}
MAX_FUNCTION_LINES = 60


def function_lengths(path: Path, root: Path = PKG) -> dict[str, int]:
    """Each function's length in lines (``FILE:NAME``, FILE relative to ``root``), from its
    ``def`` to its last line, its docstring not counted (a reason written down is not length);
    a nested function counts on its own and inside its parent."""
    out: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                n -= first.end_lineno - first.lineno + 1
            name = f"{path.relative_to(root)}:{node.name}"
            out[name] = max(n, out.get(name, 0))
    return out


def test_the_function_budget_counts_code_not_docstrings(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (tmp_path / "m.py").write_text(f'def long():\n    """Doc\n    string."""\n{body}\n\ndef short():\n    pass\n')
    assert function_lengths(tmp_path / "m.py", tmp_path) == {"m.py:long": 62, "m.py:short": 2}
    assert {name.split(":")[0] for name in LONG_FUNCTIONS} <= {str(p.relative_to(PKG)) for p in MODULES}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_no_function_is_over_60_lines(path):
    long = {name: n for name, n in function_lengths(path).items()
            if n > MAX_FUNCTION_LINES and name not in LONG_FUNCTIONS}
    assert not long, (f"over {MAX_FUNCTION_LINES} lines (docstring not counted): {long}; split by idea, "
                      f"or name a table in LONG_FUNCTIONS with its reason")


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


def _contract(name_starts: str) -> dict:
    """The import-linter contract whose name starts so, from pyproject.toml."""
    import tomllib
    contracts = tomllib.loads((PKG.parent / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    [found] = [c for c in contracts if c["name"].startswith(name_starts)]
    return found


@pytest.fixture(scope="module")
def graph():
    """The package's import graph as import-linter sees it (grimp: every import statement,
    those inside functions too)."""
    import grimp
    return grimp.build_graph("hpc_train", include_external_packages=True, cache_dir=None)


def _reaches_torch(graph, module: str) -> bool:
    return any(x in graph.modules and graph.find_shortest_chain(importer=module, imported=x)
               for x in ("torch", "torchdata"))


def test_every_torch_free_module_is_in_the_torch_free_contract(graph):
    """The contract's list is derived, not hand-kept: a module that imports no torch, directly or
    through another, is listed, so the contract keeps it so."""
    contract = _contract("Torch-free modules stay torch-free")
    listed = set(contract["source_modules"])
    free = {m for m in graph.modules if m.startswith("hpc_train") and not _reaches_torch(graph, m)}
    assert len(free) > 40
    assert not free - listed, f"torch-free but not in the contract's source_modules: {sorted(free - listed)}"


def test_the_login_side_is_forbidden_every_torch_module_of_ckpt(graph):
    contract = _contract("The login side is torch-free")
    torch_ckpt = {m for m in graph.modules if m.startswith("hpc_train.ckpt.") and _reaches_torch(graph, m)}
    assert {"hpc_train.ckpt.shared.save", "hpc_train.ckpt.local.tier"} <= torch_ckpt
    missing = torch_ckpt - set(contract["forbidden_modules"])
    assert not missing, f"ckpt modules with torch that the login contract does not forbid: {sorted(missing)}"


SLURM_COMMANDS = {"squeue", "sinfo", "sacct", "scontrol", "scancel", "sbatch", "srun", "sstat", "sattach"}


def _slurm_commands(path: Path) -> list[tuple[int, str]]:
    """(line, name) of each Slurm command this module could run itself: a string constant that is
    exactly a command's name, in a module that imports ``subprocess``, or as the argument of a
    ``which`` call anywhere. A CLI subcommand or a launcher choice named ``sbatch``/``srun`` in a
    module that starts no process is not a call; neither is the batch script's shell text."""
    tree = ast.parse(path.read_text())
    runs = any(isinstance(n, (ast.Import, ast.ImportFrom)) and "subprocess" in
               ([a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]) for n in ast.walk(tree))
    which = {id(a) for n in ast.walk(tree) if isinstance(n, ast.Call)
             and (getattr(n.func, "attr", None) or getattr(n.func, "id", None)) == "which" for a in n.args}
    return sorted((n.lineno, n.value) for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in SLURM_COMMANDS
                  and (runs or id(n) in which))


def test_the_slurm_command_check_sees_an_argv_and_a_which(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('import subprocess\nsubprocess.run(["sacct", "-j", "1"])\n'
                 'line = "timeout 60 srun --nodes=1"\n')
    assert _slurm_commands(f) == [(2, "sacct")]
    f.write_text('import shutil\nshutil.which("squeue")\nchoices = ("srun", "torchrun")\n')
    assert _slurm_commands(f) == [(2, "squeue")]


@pytest.mark.parametrize("path", [p for p in MODULES if p.name != "slurm.py" or p.parent != PKG],
                         ids=lambda p: str(p.relative_to(PKG)))
def test_slurm_is_called_from_one_module(path):
    """Every squeue, sinfo, sacct, scontrol and scancel goes through hpc_train/slurm.py: one
    timeout, one failure convention (a failure or an empty answer where one is needed is unknown)."""
    assert not _slurm_commands(path), f"calls Slurm itself (use hpc_train.slurm): {_slurm_commands(path)}"


# The yes/no flags that used to steer a rank's life from five modules (issue 48); each is now a
# field of the entry point's ExitPolicy (hpc_train/node/policy.py) and read off it.
LIFE_FLAGS = {"own_process", "escalate", "launched", "leaving", "prelaunch", "owns_group", "_leave_group",
              "restore_at_finish", "hold", "handlers_back", "resume_hint", "beat_files", "beats_itself"}
LIFE_MODULES = sorted([*(PKG / "launch").glob("*.py"), *(PKG / "node").glob("*.py"), PKG / "lifecycle.py",
                       PKG / "run.py"])


def _life_flags(path: Path) -> list[tuple[int, str]]:
    """(line, name) of each lifecycle flag this module steers by itself: a parameter, a keyword
    argument, an assigned name or an attribute of anything but a policy (``policy.leaving``,
    ``s.policy.leaving``) or an imported module (``session.prelaunch`` is a function)."""
    tree = ast.parse(path.read_text())
    modules = {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
               for a in n.names}

    def on_policy(value: ast.expr) -> bool:
        return (isinstance(value, ast.Name) and (value.id in modules or "policy" in value.id or value.id == "chosen")
                or isinstance(value, ast.Attribute) and value.attr == "policy"
                or isinstance(value, ast.Call) and getattr(value.func, "id", None) == "policy")
    found = [(n.lineno, n.arg) for n in ast.walk(tree) if isinstance(n, ast.arg) and n.arg in LIFE_FLAGS]
    found += [(n.value.lineno, n.arg) for n in ast.walk(tree) if isinstance(n, ast.keyword) and n.arg in LIFE_FLAGS]
    found += [(n.lineno, n.id) for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in LIFE_FLAGS]
    found += [(n.lineno, n.attr) for n in ast.walk(tree)
              if isinstance(n, ast.Attribute) and n.attr in LIFE_FLAGS and not on_policy(n.value)]
    return sorted(found)


def test_the_flag_check_sees_a_parameter_a_keyword_and_an_attribute(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from hpc_train.node import session\n"
                 "def f(leaving=False):\n    run._leave_group = leaving\n    g(escalate=True)\n"
                 "    session.prelaunch(s)\n    if s.policy.leaving or chosen.owns_group:\n        pass\n")
    assert _life_flags(f) == [(2, "leaving"), (3, "_leave_group"), (3, "leaving"), (4, "escalate")]


@pytest.mark.parametrize("path", LIFE_MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_lifecycle_flags_live_only_in_the_policy_table(path):
    """What differs between the worker, the supervisor and ``init()`` (who runs the pre-launch,
    whether stops escalate, whether the handlers come back, whether the group is destroyed, who
    ends the process) is one table keyed by entry point; no module of a rank's life carries a
    flag of its own for it. (The login side's ``prelaunch(hold=...)``, whether ``run`` keeps the
    lock it checked, is not a rank's.)"""
    if path.name == "policy.py":
        return
    assert not _life_flags(path), f"steers a rank's life by a flag of its own (use its ExitPolicy): {_life_flags(path)}"


@pytest.mark.parametrize("path,name", [(PKG / "launch" / "worker.py", "run_worker"), (PKG / "lifecycle.py", "init")],
                         ids=["run_worker", "init"])
def test_a_rank_s_entry_points_read_as_their_phases(path, name):
    """The worker's and ``init()``'s sequences fit on a screen (at most 25 lines, docstring
    excluded): their phases are functions of their own, what differs between them is the policy."""
    fn = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == name)
    doc = fn.body[0] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else None
    lines = (fn.end_lineno - fn.lineno + 1) - ((doc.end_lineno - doc.lineno + 1) if doc else 0)
    assert lines <= 25, f"{name} is {lines} lines"


# The one teardown (lifecycle.end) and the one way out (lifecycle.exit_now). Besides them, only
# what closes itself (Run.close closes its session) and the watchers that end a failing rank
# from a thread (a frozen peer named, a hung step; a standby never given its go) leave a process.
TEARDOWN_CALLS = {"leaving_finished": "a program's finished exit", "ignore_further": "a worker's work done",
                  "close": "a Run's or a session's close", "_exit": "os._exit"}
TEARDOWN_ELSEWHERE = {("run.py", "close"), ("run.py", "__exit__"), ("node/watchdog.py", "watch_slurm_job"),
                      ("node/hang.py", "_end"), ("launch/standby.py", "_leave"),
                      # the moments a supervisor's script ended (or never started): a late signal is no stop
                      ("launch/supervise.py", "supervise"), ("launch/supervise.py", "_conclude")}


def _teardowns(path: Path) -> list[tuple[str, int, str]]:
    """(the enclosing functions, line, call) of each teardown call: ``x.leaving_finished()``,
    ``x.ignore_further()``, ``os._exit()``, and ``run.close()`` or ``s.close()``/``session.close()``."""
    tree = ast.parse(path.read_text())
    found: dict[int, tuple[set[str], str]] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for n in ast.walk(fn):
            if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in TEARDOWN_CALLS):
                continue
            owner = n.func.value
            name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
            if n.func.attr != "close" or name in ("run", "s", "session", "_session"):
                found.setdefault(n.lineno, (set(), n.func.attr))[0].add(fn.name)   # every enclosing function
    return [(fns, line, call) for line, (fns, call) in sorted(found.items())]


def test_the_teardown_check_sees_each_kind_of_call(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\ndef f(run, s, fh):\n    s.stop.leaving_finished()\n    run.close(failed=True)\n"
                 "    fh.close()\n    os._exit(1)\n")
    assert [(line, call) for _, line, call in _teardowns(f)] == [(3, "leaving_finished"), (4, "close"), (6, "_exit")]


@pytest.mark.parametrize("path", LIFE_MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_a_rank_s_life_has_one_teardown_and_one_way_out(path):
    """A rank's teardown (the stop handlers' end, the Run's close, the session's) is
    ``lifecycle.end``, and a process of hpc_train's leaves through ``lifecycle.exit_now``
    (``exit_done`` runs the exit handlers first): no entry point ends itself its own way."""
    rel = str(path.relative_to(PKG))
    own = {("lifecycle.py", "end"), ("lifecycle.py", "exit_now"), ("lifecycle.py", "exit_done"), *TEARDOWN_ELSEWHERE}
    stray = [(sorted(fns), line, call) for fns, line, call in _teardowns(path) if not {(rel, fn) for fn in fns} & own]
    assert not stray, f"{rel} tears down or leaves outside lifecycle.end/exit_now: {stray}"


# Below the lifecycle a module takes the config section it uses (issue 48.7). The exceptions hold
# the config as a whole because the whole is their subject: the lifecycle's session (it hands the
# sections out), the pre-launch sequence (it writes config.yaml), the compatibility check (it
# compares one run's config with another's) and the tiers' chooser (a local item serves only the
# config whose digest its record carries: the digest of the whole).
WHOLE_CONFIG = {"node/session.py", "ckpt/prelaunch.py", "ckpt/compat.py", "ckpt/tiers.py"}


@pytest.mark.parametrize("path", sorted([*(PKG / "node").glob("*.py"), *(PKG / "ckpt").glob("*.py")]),
                         ids=lambda p: str(p.relative_to(PKG)))
def test_below_the_lifecycle_code_takes_the_config_section_it_uses(path):
    if str(path.relative_to(PKG)) in WHOLE_CONFIG:
        return
    tree = ast.parse(path.read_text())
    whole = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "hpc_train.config"
             and any(a.name == "Config" for a in n.names)]
    assert not whole, f"imports the whole Config (line {whole}); take the section it uses"


# Issue 50.1: bytes from outside (a run directory, a node's local tier, a peer) are read through one
# small set of functions: rundir.open_read / read_text (bounded, never blocking on a FIFO, never
# following a link, regular files only), records.io.read_json, and the parsers fed by them. Every
# other place in the package that opens something to read it, or parses bytes, is listed here with
# why it may: a new one fails the test below until it goes through those functions or is listed.
OWN_READS = {
    ("rundir.py", "os.open"): "the one reader (open_read), the lock, the atomic writer (O_NOFOLLOW)",
    ("rundir.py", "os.fdopen"): "the same files' descriptors",
    ("rundir.py", "json.loads"): "the lock holder's line, text from read_text",
    ("records/io.py", "json.loads"): "the records' one JSON parser, text from read_text",
    ("ckpt/store.py", "json.loads"): "a checkpoint's commit.json, text from read_text",
    ("config_local.py", "os.open"): "a tier directory's .alive, opened to hold or take its flock (O_NOFOLLOW), never read",
    ("config_local.py", "open"): "/proc/PID/stat: a process's state letter (process_state: a zombie, a stopped rank)",
    ("records/keeper.py", "json.loads"): "a Trainer checkpoint's .safetensors header, length-bounded, from open_read",
    ("ckpt/store.py", "os.open"): "the commit's directory fsync",
    ("ckpt/store.py", "os.fdopen"): "the commit record's atomic write",
    ("ckpt/checksum.py", "os.open"): "a checkpoint file read for its CRC (O_NOFOLLOW, O_NONBLOCK, regular only)",
    ("ckpt/checksum.py", "os.fdopen"): "the same file",
    ("ckpt/safe.py", "torch.load"): "weights_only=True: no arbitrary object is unpickled",
    ("ckpt/local/wire.py", "json.loads"): "a peer's manifest (wire.manifest: any bytes, one OSError)",
    ("ckpt/local/keep.py", "torch.load"): "a peer's own state from the wire, in memory (weights_only; any bytes refused)",
    ("ckpt/local/wire.py", "os.open"): "a received item's files, written (O_EXCL, O_NOFOLLOW)",
    ("ckpt/local/flat.py", "os.open"): "a local item's files, written (O_NOFOLLOW)",
    ("ckpt/common.py", "open"): "a checkpoint file written",
    ("ckpt/shared/export.py", "open"): "the export written (O_EXCL through 'xb')",
    ("logs.py", "json.loads"): "metrics.jsonl's one line parser, lines from open_read",
    ("config_yaml.py", "yaml.load"): "the bounded loaders (nesting, aliases, duplicate keys)",
    ("config_yaml.py", "p.read_bytes"): "the user's config file: a regular file, size-bounded first",
    ("trainer/data.py", "path.read_bytes"): "the user's dataset",
    ("trainer/data.py", "gzip.open"): "the user's dataset, compressed",
    ("login/sbatch.py", "read_text"): "the package's own batch templates",
    ("cli/main.py", "os.open"): "/dev/null",
    ("launch/supervise.py", "os.open"): "/dev/null",
    ("node/beats.py", "os.open"): "a beat file created (O_NOFOLLOW)",
    ("node/tb_events.py", "os.fdopen"): "TensorBoard's event file, written",
    ("goodput.py", "read_text"): "/proc/self/stat and /proc/uptime",
    ("lifecycle.py", "read_bytes"): "/proc/PPID/cmdline",
    ("launch/joined.py", "open"): "/proc/PID/task/*/children and /proc/PID/net/*",
    ("node/watchdog.py", "open"): "/proc/PID/status",
    ("node/watchdog.py", "read_text"): "/proc/self/cgroup and the cgroup's memory files",
}
_READ_ATTRS = {"read_text", "read_bytes", "safe_load", "fdopen"}


def _reads(path: Path) -> set[str]:
    """Every call in ``path`` that opens something to read or parses bytes, as 'receiver.method'
    (rundir's readers, the discipline itself, are not counted)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        f = node.func if isinstance(node, ast.Call) else None
        if isinstance(f, ast.Name) and f.id == "open":
            found.add("open")
        elif isinstance(f, ast.Attribute):
            base = f.value.id if isinstance(f.value, ast.Name) else ""
            what = f"{base}.{f.attr}" if base else f.attr
            if base == "rundir":
                continue
            if f.attr in _READ_ATTRS or f.attr == "open" or (f.attr in ("loads", "load") and base in
                                                             ("json", "yaml", "torch", "pickle", "marshal")):
                found.add(what)
    return found


def test_the_read_check_sees_a_bare_read_of_a_record(tmp_path):
    m = tmp_path / "m.py"
    m.write_text("import json\nfrom pathlib import Path\n"
                 "def f(rd):\n    return json.loads((Path(rd) / 'requeue.json').read_text()), open(rd).read()\n")
    assert _reads(m) == {"json.loads", "read_text", "open"}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_outside_bytes_are_read_through_the_one_discipline(path):
    rel = str(path.relative_to(PKG))
    stray = sorted(w for w in _reads(path) if (rel, w) not in OWN_READS)
    assert not stray, (f"{rel} reads with {stray}: read run-directory files through rundir.open_read/read_text "
                       f"or records.io.read_json (bounded, no FIFO block, no link followed), or list it in "
                       f"OWN_READS with why")


def test_every_listed_read_still_exists():
    for rel, what in OWN_READS:
        assert what in _reads(PKG / rel), f"OWN_READS lists {rel}: {what}, which is gone: remove the entry"
