"""Issue 19 (round 3), the login side and the run directory's records: batch scripts rendered in
one pass, no write through a symlinked record, damaged records set aside instead of crashing a
resume or `status`, and an explicit `--resume PATH` that is honoured.

Real processes and files throughout: the real CLI in a subprocess, the rendered script run by a
real bash (with `srun`/`scontrol` as shell functions, as TorchX's tests do), tiny real runs.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
from ckpt_helpers import hpc, show, write_config

# -- 1. batch scripts: one pass, no value scanned again ---------------------------------------

# A job name holding other placeholders' names: filled one after another, the config's YAML
# (whose values would run if they reached bash unquoted) landed in the script's comment line.
HOSTILE_NAME = "a{{config_yaml}}b{{run_dir}}c{{setup}}$(touch {m}name)"


def _prelude(script: str) -> str:
    """The script up to the training step: directives, config heredoc, setup, exports."""
    head, sep, _ = script.partition("\nstatus=0\n")
    assert sep, script
    return head + "\n"


def _run_bash(text: str, cwd: Path) -> subprocess.CompletedProcess:
    # srun/scontrol as shell functions: nothing in the prelude may reach them anyway.
    stubs = "srun() { :; }\nscontrol() { echo node1; }\n"
    return subprocess.run(["bash", "-c", stubs + text], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ["PATH"], "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node1"})


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_sbatch_script_is_rendered_in_one_pass_and_runs_nothing_it_was_given(tmp_path, launcher):
    m = tmp_path / "pwned-"
    rd = tmp_path / "run dir"
    out = tmp_path / "job.sbatch"
    name = HOSTILE_NAME.replace("{m}", str(m))
    root = f"$(touch {m}root)`touch {m}tick`"
    p = hpc("sbatch", "jobs/digits.yaml", "--launcher", launcher, "--run-dir", rd, "-o", out,
            "--set", f"job.name={name}", "--set", f"data.root={root}", "--set", "job.partition={{eof}}")
    assert p.returncode == 0, show(p)
    script = out.read_text()
    ran = _run_bash(_prelude(script), tmp_path)
    assert not list(tmp_path.glob("pwned-*")), (sorted(tmp_path.glob("pwned-*")), script)
    assert ran.returncode == 0, ran.stderr
    # The job name is one quoted word on its line, with the placeholder text still in it.
    line = next(ln for ln in script.splitlines() if ln.startswith("#SBATCH --job-name="))
    assert shlex.split(line.split("=", 1)[1]) == [name]
    # The config travelled through the heredoc unchanged.
    import yaml
    written = yaml.safe_load((rd / "config.yaml").read_text())
    assert written["job"]["name"] == name and written["data"]["root"] == root


def test_submit_dry_run_quotes_what_it_was_given(tmp_path):
    """submitit renders the submit script; hostile values stay data there too."""
    m = tmp_path / "pwned-"
    rd = tmp_path / f"run $(touch {m}rd)"
    p = hpc("submit", "jobs/digits.yaml", "--dry-run", "--run-dir", rd, "--set",
            f"job.name={HOSTILE_NAME.replace('{m}', str(m))}", "--set", f"job.partition=p$(touch {m}part)",
            "--set", f"data.root=$(touch {m}root)")
    assert p.returncode == 0, show(p)
    head = p.stdout.split("\n# command\n")[0]
    ran = _run_bash(head, tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert not list(tmp_path.glob("pwned-*")), p.stdout
