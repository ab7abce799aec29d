"""Issue 29.4: hpc_train's own flags, met as a user types them (the real CLI in a subprocess).

* a typo of an own flag gets did-you-mean, before any advice about a script's arguments, and the
  suggested command keeps the arguments typed after ``--``;
* no prefix abbreviations on any parser (``--np 2`` was silently ``--nproc 2``);
* another command's flag is named as such (``--nodes`` on ``run``, ``--nproc`` on ``submit``);
* a ``.py`` given as a config is sent to ``--script``.

Each is one line on stderr, exit 2, no traceback, nothing run or written. No torch is imported:
nothing here trains.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers import hpc, show


def _one_line(p: subprocess.CompletedProcess) -> str:
    """The single line of a usage error (exit 2, nothing else on stderr or stdout)."""
    assert p.returncode == 2 and "Traceback" not in p.stderr, show(p)
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and p.stdout == "", show(p)
    return lines[0]


@pytest.fixture
def script(tmp_path: Path) -> Path:
    s = tmp_path / "main.py"
    s.write_text("print('ran')\n")
    return s


def test_a_typo_of_an_own_flag_is_did_you_mean_and_the_command_keeps_the_script_arguments(tmp_path, script):
    rd = tmp_path / "run"
    line = _one_line(hpc("run", "--script", script, "--nprocs", "2", "--run-dir", rd, "--", "--epochs", "3"))
    assert line == (f"python -m hpc_train run: unrecognized option --nprocs; did you mean --nproc? "
                    f"python -m hpc_train run --script {script} --nproc 2 --run-dir {rd} -- --epochs 3"), line
    assert not rd.exists()


@pytest.mark.parametrize("typed", [["--np", "2"], ["--np=2"]])
def test_no_prefix_abbreviations(tmp_path, script, typed):
    """`--np 2` was taken as `--nproc 2` (argparse's allow_abbrev): now it is refused, named."""
    rd = tmp_path / "run"
    line = _one_line(hpc("run", "--script", script, *typed, "--run-dir", rd))
    assert "unrecognized option --np; did you mean --nproc?" in line, line
    assert not rd.exists()


def test_no_prefix_abbreviations_on_any_parser(tmp_path):
    p = hpc("config", "jobs/digits.yaml", "--se", "optim.lr=0.5")
    assert "unrecognized option --se; did you mean --set?" in _one_line(p)
    p = hpc("ckpt", "export", tmp_path, tmp_path / "out.pt", "--ste", "3")
    assert "unrecognized option --ste; did you mean --step?" in _one_line(p)


@pytest.mark.parametrize("flag", ["--nodes", "--time", "--partition"])
def test_a_scheduler_flag_on_run_says_where_it_belongs(tmp_path, script, flag):
    rd = tmp_path / "run"
    line = _one_line(hpc("run", "--script", script, flag, "2", "--run-dir", rd, "--", "x"))
    assert line == (f"python -m hpc_train run: {flag} is a submit/sbatch option; `run` trains on this machine "
                    f"with --nproc N"), line
    assert not rd.exists()


def test_nproc_on_submit_says_where_it_belongs(tmp_path, script):
    line = _one_line(hpc("submit", "--script", script, "--nproc", "2", "--run-dir", tmp_path / "run", "--dry-run"))
    assert line == ("python -m hpc_train submit: --nproc is a run option; a Slurm job's processes are "
                    "--nodes x --tasks-per-node"), line


def test_script_arguments_before_the_separator_join_those_after_it(tmp_path, script):
    line = _one_line(hpc("run", "--script", script, "--lr", "0.1", "--run-dir", tmp_path / "run", "--", "--epochs", "3"))
    assert line.endswith(f"--script {script} -- --lr 0.1 --epochs 3"), line


@pytest.mark.parametrize("command", ["run", "submit", "sbatch"])
def test_a_python_file_given_as_a_config_is_sent_to_script(tmp_path, script, command):
    rd = tmp_path / "run"
    line = _one_line(hpc(command, script, "--run-dir", rd, "--", "--epochs", "3"))
    assert line == (f"hpc_train: error: {script} is a Python script, not a job config; run it with --script: "
                    f"python -m hpc_train {command} --script {script} -- --epochs 3"), line
    assert not rd.exists()


def test_config_of_a_python_file_says_what_it_is(script):
    line = _one_line(hpc("config", script))
    assert line == (f"hpc_train: error: {script} is a Python script, not a job config; run it with --script: "
                    f"python -m hpc_train run --script {script}"), line
