"""Issue 29.4: messages about a run, met as a user meets them (real processes).

* a resume hint comes only from the process that owns the command line, never from a script
  that hpc_train's launcher supervises;
* a script's run directory is one run whether it was started by ``python main.py`` or by
  ``run --script main.py``: the compatibility check compares the script file, and a refusal
  names what differs and what to do; new script arguments on a finished run are refused, named.

Usage errors are one line on stderr, exit 2, no traceback, nothing written.
"""

from __future__ import annotations

import pytest

import json
import os
import shutil
import signal
import subprocess
import sys
import time

from helpers import REPO, clean_env, hpc, show, snapshot

OWN_LOOP = str(REPO / "tests" / "scripts" / "own_loop.py")
QUIET = ("--set", "log.tensorboard=false", "--set", "log.progress=lines")


def _one_line(p: subprocess.CompletedProcess) -> str:
    """The single line of a usage error (exit 2, nothing else on stderr or stdout)."""
    assert p.returncode == 2 and "Traceback" not in p.stderr, show(p)
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and p.stdout == "", show(p)
    return lines[0]


# -- the resume hint -------------------------------------------------------------------------

@pytest.mark.procs
def test_a_supervised_script_prints_no_resume_hint_of_its_own(tmp_path):
    """SIGTERM to `run --script`: the launcher says how to resume; the script's own init(),
    whose command line (`python -u own_loop.py ...`) the user never typed, says nothing of it."""
    rd = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "hpc_train", "run", "--script", OWN_LOOP, "--run-dir", str(rd),
                          *QUIET, "--", "6000", "0.05"], cwd=REPO, env=clean_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    log = rd / "logs" / "rank-0.log"
    try:
        deadline = time.monotonic() + 120
        while not (log.is_file() and " step 10 " in log.read_text()):   # the script is in its loop
            assert p.poll() is None, p.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no step logged in 120 s"
            time.sleep(0.1)
        os.kill(p.pid, signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert json.loads((rd / "stopped.json").read_text())["checkpoint"] is True, err[-3000:]
    assert "resume with:" not in err, err[-3000:]
    assert "; run the same command to resume" in err, err[-3000:]


# -- a script's run directory: one run, whichever way it was started -------------------------

MAIN = """\
import sys

import torch

import hpc_train

run = hpc_train.init()
model = run.wrap(torch.nn.Linear(2, 1))
optim = torch.optim.SGD(model.parameters(), lr=0.1)
state = {"model": model, "optim": optim, "step": 0}
print("started at step", run.restore(state), flush=True)
stop_at = int(sys.argv[1])
while state["step"] < 4:
    optim.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    optim.step()
    state["step"] += 1
    if state["step"] == stop_at:
        run.request_stop()   # a stop saves a checkpoint at this step
    if run.step_end(state):
        sys.exit(run.exit_code)
run.finish({"steps": state["step"]})
"""


@pytest.mark.procs
def test_a_script_started_by_python_continues_under_run_script_and_refusals_name_the_difference(tmp_path):
    main = tmp_path / "main.py"
    main.write_text(MAIN)
    shutil.copy(main, tmp_path / "other.py")
    rd = tmp_path / "runs" / "main"     # where a plain `python main.py` puts its run
    first = subprocess.run([sys.executable, str(main), "2"], cwd=tmp_path, env=clean_env(), capture_output=True,
                           text=True, timeout=180)
    assert first.returncode == 3 and (rd / "checkpoints" / "step-2" / "commit.json").is_file(), show(first)

    # another script into that run directory: refused, naming both files and the ways out
    before = snapshot(rd)
    line = _one_line(hpc("run", "--script", tmp_path / "other.py", "--run-dir", rd, *QUIET, "--", "2"))
    assert line == (f"hpc_train: error: {rd} holds checkpoints of the script {main}; this run is the script "
                    f"{tmp_path / 'other.py'}: continue it with the script {main}, or give another --run-dir (add "
                    f"--resume {rd} to start from its checkpoints), or --resume none to start over here (its "
                    f"checkpoints are moved aside)"), line
    assert snapshot(rd) == before

    # the same file under `run --script`: the same run, resumed
    p = hpc("run", "--script", main, "--run-dir", rd, *QUIET, "--", "2")
    assert p.returncode == 0, show(p)
    assert "resuming from step 2" in p.stderr and "started at step 2" in p.stdout, show(p)
    assert json.loads((rd / "result.json").read_text())["steps"] == 4

    # new arguments on the finished run: refused, naming both; nothing changes
    before = snapshot(rd)
    line = _one_line(hpc("run", "--script", main, "--run-dir", rd, *QUIET, "--", "3", "--epochs 5"))
    assert line == (f"hpc_train: error: {rd} holds a finished run of main.py with arguments [2]; these are "
                    f"[3 '--epochs 5']: use --resume none to start over, or another --run-dir"), line
    assert snapshot(rd) == before
    # the same arguments: finished, nothing to do
    p = hpc("run", "--script", main, "--run-dir", rd, *QUIET, "--", "2")
    assert p.returncode == 0 and "nothing to do" in p.stderr, show(p)
    assert snapshot(rd) == before


def test_the_code_a_run_directory_was_trained_by_is_compared_by_what_it_names():
    """The rule, as a table: a script by its file name, a function by its import path, the
    built-in trainer by its model; a run directory that names none (an own program from before
    the script was recorded) is not refused for want of a record."""
    from hpc_train.ckpt.compat import code_change
    builtin = {"train": {"script": "", "fn": ""}}
    script = {"train": {"script": "/w/main.py", "fn": ""}}
    same_via_dots = {"train": {"script": "/w/sub/../main.py", "fn": ""}}
    moved = {"train": {"script": "/scratch/copy/main.py", "fn": ""}}
    other = {"train": {"script": "/w/other.py", "fn": ""}}
    fn = {"train": {"script": "", "fn": "pkg.mod:main"}}
    sig = {"name": "convnet", "hidden": 50}
    assert code_change(script, script, None) is None
    assert code_change(script, same_via_dots, None) is None
    assert code_change(script, moved, None) is None            # a project copied with its runs
    assert code_change(fn, fn, None) is None
    assert code_change(builtin, builtin, sig) is None
    assert code_change(builtin, script, None) is None          # an own program, unrecorded
    assert code_change(script, other, None) == ("the script /w/main.py", "the script /w/other.py")
    assert code_change(builtin, script, sig) == ("the built-in trainer (model convnet)", "the script /w/main.py")
    assert code_change(script, fn, None) == ("the script /w/main.py", "the function pkg.mod:main")
    assert code_change(fn, builtin, None) == ("the function pkg.mod:main", "the built-in trainer (model convnet)")


def test_new_arguments_on_a_finished_run_of_a_script_without_hpc_train_are_refused(tmp_path):
    """The issue's case: a torchrun-style script that knows nothing of hpc_train, finished, rerun
    with other arguments. They were silently ignored ("nothing to do", exit 0)."""
    main = tmp_path / "main.py"
    main.write_text("import sys\nprint('args', sys.argv[1:])\n")
    rd = tmp_path / "run"
    p = hpc("run", "--script", main, "--run-dir", rd, *QUIET, "--", "--epochs", "3")
    assert p.returncode == 0 and (rd / "result.json").is_file(), show(p)
    before = snapshot(rd)
    line = _one_line(hpc("run", "--script", main, "--run-dir", rd, "--", "--epochs", "5"))
    assert line == (f"hpc_train: error: {rd} holds a finished run of main.py with arguments [--epochs 3]; these "
                    f"are [--epochs 5]: use --resume none to start over, or another --run-dir"), line
    p = hpc("run", "--script", main, "--run-dir", rd, "--", "--epochs", "3")
    assert p.returncode == 0 and "nothing to do" in p.stderr and "args" not in p.stdout, show(p)
    assert snapshot(rd) == before
