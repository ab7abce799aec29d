"""Commands that do not train must not import torch (``srun python -m hpc_train env`` on hundreds
of tasks, ``--help`` on a login node): each runs as ``python -m hpc_train`` in a fresh interpreter
that reports, at exit, which torch modules it had loaded.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import probe

@pytest.fixture
def ckpt_run_dir(tmp_path: Path) -> Path:
    """A run directory with one (incomplete) checkpoint, for `ckpt list`."""
    d = tmp_path / "rd"
    (d / "checkpoints" / "step-5").mkdir(parents=True)
    return d


COMMANDS = {
    "no-command": ([], 2),
    "--help": (["--help"], 0),
    "env": (["env"], 0),
    "env --json": (["env", "--json"], 0),
    "config": (["config", "jobs/digits.yaml"], 0),
    "config --set": (["config", "jobs/digits.yaml", "--set", "optim.lr=0.1", "--set", "seed=4"], 0),
    "config error": (["config", "jobs/digits.yaml", "--set", "optim.lrr=0.1"], 2),
    "run --help": (["run", "--help"], 0),
    "submit --help": (["submit", "--help"], 0),
    "sbatch --help": (["sbatch", "--help"], 0),
    "status --help": (["status", "--help"], 0),
    "logs --help": (["logs", "--help"], 0),
    "cancel --help": (["cancel", "--help"], 0),
    "ckpt --help": (["ckpt", "--help"], 0),
    "ckpt list --help": (["ckpt", "list", "--help"], 0),
    "ckpt list RUN_DIR": (["ckpt", "list", "{ckpt_run_dir}"], 0),
    "ckpt list /nonexistent": (["ckpt", "list", "/nonexistent/run"], 2),
    "sweep summary --help": (["sweep", "summary", "--help"], 0),
    "submit --sweep --dry-run": (["submit", "jobs/digits.yaml", "--sweep", "optim.lr=0.1,0.2", "--dry-run",
                                  "--run-dir", "{ckpt_run_dir}/sweep"], 0),
    "sweep summary (not a sweep)": (["sweep", "summary", "{ckpt_run_dir}"], 2),
}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_command_does_not_import_torch(py, clean_env, tmp_path, ckpt_run_dir, name):
    args, code = COMMANDS[name]
    args = [a.format(ckpt_run_dir=ckpt_run_dir) for a in args]
    res = probe(py, clean_env(), tmp_path, args)
    assert res["code"] == code, res["stderr"]
    assert res["heavy"] == [], f"`python -m hpc_train {' '.join(args)}` imported {res['heavy'][:5]}"
    if name == "env --json":
        assert json.loads(res["stdout"])["source"] == "single"
    if name == "config --set":
        assert "lr: 0.1" in res["stdout"] and "seed: 4" in res["stdout"]


def test_probe_detects_torch(py, clean_env, tmp_path):
    """The control: the same probe, with torch imported first, must report it."""
    res = probe(py, clean_env(), tmp_path, ["env", "--json"], preload="torch")
    assert res["code"] == 0 and "torch" in res["heavy"]


def test_importing_the_package_is_light(py, clean_env):
    code = ("import sys, hpc_train, hpc_train.cli.main, hpc_train.config, hpc_train.node.environment, hpc_train.ckpt.store; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'tensorboard', 'torchdata')]; "
            "assert not bad, bad")
    r = subprocess.run([py, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
