"""Shared fixtures: run the real CLI in a subprocess, with a controlled environment.

Kept small and general on purpose; anything specific to one test file lives in that file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def clean_env(**extra: str) -> dict[str, str]:
    """A minimal environment: no Slurm, torchrun or launcher variables leak in from the caller
    (the tests may well run inside a Slurm job). ``tests.plugins_for_tests`` is importable."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR") if k in os.environ}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 180,
            cwd: str | os.PathLike = ROOT) -> subprocess.CompletedProcess:
    """``python -m hpc_train ARGS`` to completion; stdout and stderr captured as text."""
    return subprocess.run([PY, "-m", "hpc_train", *map(str, args)], env=clean_env() if env is None else env,
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)


# Train something tiny: the smoke-test model and data, a few steps, no progress bar.
SMOKE = ("--set", "model.name=linear", "--set", "data.name=synthetic", "--set", "data.synthetic_size=256",
         "--set", "data.batch_size=16", "--set", "train.max_steps=4", "--set", "log.progress=lines")


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``make test TEST_WORKERS=2``'s workers (pytest-xdist, ``--dist loadfile``) take whole files, so a module
    fixture (a reference run that several tests compare with) runs once; and all of tests/slurm/ is
    one unit, so one worker starts the one local cluster and runs every Slurm test on it."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling
    assert hasattr(LoadScopeScheduling, "_split_scope"), "pytest-xdist changed how it splits scopes"

    class FilesAndSlurm(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/slurm/" if path.startswith("tests/slurm/") else path

    return FilesAndSlurm(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """tests/slurm/ first, the rest in their order: under ``make test``'s workers the cluster's tests
    are one long unit on one worker, which must start at once while the other worker takes the
    local files (started last, it would run alone at the end for most of its length)."""
    items.sort(key=lambda item: not item.nodeid.startswith("tests/slurm/"))


_LOCKS = pytest.StashKey[tuple]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Under pytest-xdist, a test marked ``quiet`` has the machine's CPUs to itself: it waits for
    the other worker's current test to end, and that worker waits for it. Its setup and teardown
    (a module fixture's too: they run inside the first and last test's protocol) are covered.
    Without workers, every test already runs alone."""
    config = item.config
    if not hasattr(config, "workerinput") or getattr(config, "cache", None) is None:
        return (yield)
    if _LOCKS not in config.stash:
        where = config.cache.mkdir("hpc_train-turns")
        config.stash[_LOCKS] = (open(where / "gate", "a"), open(where / "main", "a"))  # held for the session
    with _turn(*config.stash[_LOCKS], alone=item.get_closest_marker("quiet") is not None):
        return (yield)


@contextlib.contextmanager
def _turn(gate, main, alone: bool):
    """Two locks shared by the workers (files in pytest's cache directory): every test holds
    ``main`` shared, a quiet test holds it alone. A test first passes ``gate``, which a quiet
    test keeps until it ends, so no other worker's test starts while it waits or runs: a
    writer-first lock out of flock(2), which has no priority of its own."""
    fcntl.flock(gate, fcntl.LOCK_EX)
    try:
        fcntl.flock(main, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
    except BaseException:
        fcntl.flock(gate, fcntl.LOCK_UN)
        raise
    if not alone:
        fcntl.flock(gate, fcntl.LOCK_UN)
    try:
        yield
    finally:
        fcntl.flock(main, fcntl.LOCK_UN)
        if alone:
            fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.fixture
def py() -> str:
    """The interpreter the suite runs under (the project's venv)."""
    return PY


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run directory that does not exist yet."""
    return tmp_path / "run"


@pytest.fixture(name="run_cli")
def run_cli_fixture():
    return run_cli


@pytest.fixture
def smoke() -> tuple[str, ...]:
    """``--set`` flags for a tiny training run (see :data:`SMOKE`)."""
    return SMOKE


@pytest.fixture(name="clean_env")
def clean_env_fixture():
    return clean_env
