"""Shared fixtures: run the real CLI in a subprocess, with a controlled environment.

Kept small and general on purpose; anything specific to one test file lives in that file.
"""

from __future__ import annotations

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
