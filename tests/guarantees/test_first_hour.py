"""Issue 20: a researcher's first hour. What the defaults, the dry run and the messages promise
must be what happens.

Real processes throughout: `python -m hpc_train run --nproc 2` killed with a real SIGKILL of one
worker, `submit --dry-run` as a user types it (no cluster: a dry run needs none), real script runs.
The Slurm side (a real submit writing submission.sh, `hpc_train.submit(fn, nodes=2).result()`) is in
tests/slurm/test_first_hour_slurm.py.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import REPO, clean_env, hpc, show

from hpc_train.ckpt import store

DIGITS = str(REPO / "jobs" / "digits.yaml")
SNAPSHOT = str(REPO / "jobs" / "ddp_snapshot.py")
QUIET = ("--set", "log.tensorboard=false", "--set", "log.progress=lines")


def _wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _worker_pid(run_dir: Path, rank: int) -> int:
    hb = run_dir / "logs" / ".heartbeat" / f"rank-{rank}"

    def written() -> bool:
        try:
            return "pid" in json.loads(hb.read_text())
        except (OSError, ValueError):
            return False
    _wait_for(written, 120, f"rank {rank}'s heartbeat")
    return json.loads(hb.read_text())["pid"]


def _logged_step(run_dir: Path) -> int:
    """The last training step rank 0 logged to metrics.jsonl (0 before the first)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    found = 0
    for x in lines:
        try:
            rec = json.loads(x)
        except ValueError:      # the line being written
            continue
        found = rec["step"] if "loss" in rec else found
    return found


def _start(tmp_path: Path, *args) -> subprocess.Popen:
    """``python -m hpc_train ARGS`` in the background, its output to a file (a pipe nobody reads
    while it trains would fill and block the workers)."""
    out = open(tmp_path / "console.txt", "w")
    return subprocess.Popen([sys.executable, "-m", "hpc_train", *map(str, args)], cwd=REPO, env=clean_env(),
                            stdout=out, stderr=subprocess.STDOUT, text=True)


def _kill_one_worker_mid_run(tmp_path: Path, rd: Path, args: tuple, rank: int, after_step: int,
                             then_s: float = 0.0) -> float:
    """Start ``run ARGS``, SIGKILL worker ``rank`` once ``after_step`` is logged and ``then_s`` more
    seconds have passed; wait for the launcher to end. Returns the time of the kill."""
    p = _start(tmp_path, *args)
    try:
        victim = _worker_pid(rd, rank)
        _wait_for(lambda: _logged_step(rd) >= after_step, 120, "training to start")
        time.sleep(then_s)
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    console = (tmp_path / "console.txt").read_text()
    assert p.returncode != 0, console[-4000:]
    return killed_at


def _status(run_dir: Path) -> str:
    p = hpc("status", run_dir)
    assert p.returncode == 0, show(p)
    return p.stdout


# -- 1. periodic checkpoints by default ----------------------------------------------------

def test_the_default_checkpoints_every_ten_minutes_of_training_and_says_so():
    p = hpc("config", DIGITS)
    assert p.returncode == 0, show(p)
    ck = yaml.safe_load(p.stdout)["checkpoint"]
    assert ck["every_seconds"] == 600 and ck["every_steps"] == 0
    line = next(x for x in p.stdout.splitlines() if x.strip().startswith("every_seconds:"))
    assert "#" in line and "10 minutes" in line and "stop" in line, line   # what the value means, beside it


@pytest.mark.procs
def test_a_rank_killed_at_random_resumes_from_a_recent_checkpoint(tmp_path):
    """Defaults but for a 2 s timer instead of 10 minutes: kill -9 one worker at a random moment of
    a long run; the rerun resumes from a checkpoint at most about 2 s older than the kill, and
    `status` said so beforehand."""
    every = 2
    rd = tmp_path / "run"
    args = ("run", DIGITS, "--nproc", "2", "--run-dir", rd, "--set", f"checkpoint.every_seconds={every}", *QUIET)
    killed_at = _kill_one_worker_mid_run(tmp_path, rd, (*args, "--set", "train.max_steps=1000000"),
                                         rank=random.choice((0, 1)), after_step=10,
                                         then_s=3 * every + random.uniform(0, 2 * every))
    newest = store.newest_complete(rd)
    assert newest is not None, f"nothing saved in {3 * every}+ s of training with a {every} s timer"
    age = killed_at - newest.record["time"]
    # One timer period, plus the step in flight and the save's own write (a bound on slowness under
    # load, not a speed claim): the point is that minutes of work are not lost.
    assert age <= every + 30, f"the newest checkpoint (step {newest.step}) was {age:.1f} s old at the kill"
    st = _status(rd)
    assert re.search(rf"resumes from step {newest.step} \(checkpoint \d+ s old\)", st), st
    again = hpc(*args, "--set", f"train.max_steps={newest.step + 2}")
    assert again.returncode == 0, show(again)
    assert f"resuming from step {newest.step} " in again.stderr, show(again)


@pytest.mark.procs
def test_status_of_a_run_with_no_checkpoint_says_a_rerun_starts_from_step_0(tmp_path):
    """Default settings, killed long before the 10-minute timer: nothing was saved, and status says
    so instead of promising a resume."""
    rd = tmp_path / "run"
    _kill_one_worker_mid_run(tmp_path, rd, ("run", DIGITS, "--nproc", "2", "--run-dir", rd,
                                            "--set", "train.max_steps=1000000", *QUIET), rank=1, after_step=20)
    assert store.newest_complete(rd) is None
    st = _status(rd)
    assert "no checkpoint: a rerun starts from step 0" in st, st
    assert "resumes it" not in st, st


# -- 2. a dry run that shows what runs ---------------------------------------------------------

def _header(text: str) -> list[str]:
    """The dry run's lines before submitit's '# Parameters' (hpc_train's header)."""
    lines = text.splitlines()
    return lines[:lines.index("# Parameters")]


def _config_block(header: list[str]) -> dict:
    start = next(i for i, x in enumerate(header) if x.startswith("# config"))
    return yaml.safe_load("\n".join(x[4:] for x in header[start + 1:] if x.startswith("#   ")))


def test_dry_run_shows_the_script_with_its_arguments_the_run_directory_and_the_config(tmp_path):
    from hpc_train import config
    script = tmp_path / "my train.py"
    script.write_text("print('ran')\n")
    rd = tmp_path / "run"
    p = hpc("submit", "--script", script, "--nodes", "2", "--run-dir", rd, "--set", "optim.lr=0.25", "--dry-run",
            "--", "a", "b c", "--lr=0.1")
    assert p.returncode == 0, show(p)
    head = _header(p.stdout)
    assert head[0] == "#!/bin/bash" and all(x.startswith("#") for x in head if x), head
    runs = next(x for x in head if x.startswith("# runs: "))
    assert runs.startswith(f"# runs: python {shlex.quote(str(script))} a 'b c' --lr=0.1,"), runs
    assert f"# run directory: {rd} " in p.stdout
    shown = _config_block(head)
    assert shown["job"]["nodes"] == 2 and shown["run_dir"] == str(rd) and shown["optim"] == {"lr": 0.25}
    assert shown["train"]["script"] == str(script) and shown["train"]["args"] == ["a", "b c", "--lr=0.1"]
    assert "data" not in shown and "model" not in shown          # a script run's sections (point 5)
    loaded = config.load(None, [], shown)
    assert loaded.train.args == ["a", "b c", "--lr=0.1"] and loaded.checkpoint.every_seconds == 600
    assert not rd.exists()                                        # a dry run writes nothing


def test_dry_run_names_the_built_in_trainer_or_the_function(tmp_path):
    p = hpc("submit", DIGITS, "--nodes", "2", "--run-dir", tmp_path / "a", "--dry-run")
    assert p.returncode == 0, show(p)
    head = _header(p.stdout)
    assert "# runs: hpc_train's built-in trainer (model convnet, data digits), in every task" in head, head
    assert _config_block(head)["optim"]["lr"] == 0.003               # jobs/digits.yaml's value
    p = hpc("submit", "--fn", "tests.plugins_for_tests:world_report", "--run-dir", tmp_path / "b", "--dry-run")
    assert p.returncode == 0, show(p)
    assert "# runs: tests.plugins_for_tests:world_report(), in every task, inside its hpc_train Run" \
        in _header(p.stdout), p.stdout


def test_dry_run_keeps_every_value_inside_its_comment(tmp_path):
    """A newline in a value would end the comment and start a command: refused by the config; a
    line or paragraph separator (not a line break to bash) is written as its escape all the same."""
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    p = hpc("submit", "--script", script, "--run-dir", tmp_path / "r", "--dry-run", "--", "x\nrm -rf ~")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "train.args" in p.stderr, show(p)
    assert p.stdout == ""
    p = hpc("submit", "--script", script, "--run-dir", tmp_path / "r", "--dry-run", "--", "x\u2028y", "\x85z")
    assert p.returncode == 0, show(p)
    head = _header(p.stdout)
    assert all((not x or x.startswith("#")) and "\u2028" not in x and "\x85" not in x for x in head), head
    assert any(x.startswith("# runs: python ") and "'x\\u2028y' '\\x85z'" in x for x in head), head


@pytest.mark.procs
def test_dry_run_says_a_real_submit_would_refuse_a_finished_or_busy_run_directory(tmp_path):
    from helpers import snapshot
    rd = tmp_path / "run"
    done = hpc("run", DIGITS, "--run-dir", rd, "--set", "train.max_steps=2", "--set", "data.batch_size=8", *QUIET)
    assert done.returncode == 0, show(done)
    before = snapshot(rd)
    lock = (rd / ".lock").read_bytes()
    p = hpc("submit", DIGITS, "--run-dir", rd, "--dry-run")
    assert p.returncode == 2 and "#SBATCH" in p.stdout, show(p)
    assert p.stderr.count("\n") == 1, show(p)
    assert "a real submit would refuse this: " in p.stderr and "holds a finished run (result.json)" in p.stderr
    assert snapshot(rd) == before and (rd / ".lock").read_bytes() == lock     # looked, changed nothing
    assert hpc("submit", DIGITS, "--run-dir", rd, "--dry-run", "--resume", "none").returncode == 0

    busy = tmp_path / "busy"
    live = _start(tmp_path, "run", DIGITS, "--nproc", "2", "--run-dir", busy, "--set", "train.max_steps=1000000",
                  *QUIET)
    try:
        _wait_for(lambda: _logged_step(busy) >= 1, 120, "the run to train")
        p = hpc("submit", DIGITS, "--run-dir", busy, "--dry-run")
        assert p.returncode == 2, show(p)
        assert f"a real submit would refuse this: {busy} is in use by `python -m hpc_train run` (2 processes) " \
               f"(pid {live.pid} " in p.stderr, show(p)
        assert live.poll() is None
    finally:
        live.send_signal(signal.SIGTERM)
        live.wait(timeout=120)


# -- 4. true messages ------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["run", "submit"])
def test_resume_none_help_says_checkpoints_are_moved_aside(command):
    p = hpc(command, "--help")
    assert p.returncode == 0, show(p)
    text = " ".join(p.stdout.split())       # argparse wraps the help
    assert "refused if checkpoints exist" not in text
    assert "none: start from scratch (checkpoints already there are moved aside to checkpoints.old-<time>/, " \
           "never deleted)" in text, text


@pytest.mark.parametrize("typed, stray", [(["2"], "2"), (["--epochs", "2"], "--epochs 2"),
                                          (["a", "b c"], "a 'b c'")])
def test_script_arguments_without_the_separator_say_where_they_go(tmp_path, typed, stray):
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    rd = tmp_path / "run"
    for command in (["run"], ["submit", "--dry-run"]):
        p = hpc(*command, "--script", script, *typed, "--run-dir", rd)
        assert p.returncode == 2, show(p)
        assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr and "ran" not in p.stdout, show(p)
        assert f"unrecognized arguments: {stray}; a script's arguments go after `--`: " in p.stderr, show(p)
        assert p.stderr.rstrip().endswith(f"--script {script} -- {stray}"), show(p)
        assert not rd.exists()


def test_a_script_run_does_not_claim_to_start_fresh(tmp_path):
    """hpc_train cannot know what a script restores by itself (jobs/ddp_snapshot.py loads its own
    snapshot): without a checkpoint of hpc_train's, the console says so instead of 'starting fresh'."""
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    p = hpc("run", "--script", script, "--run-dir", tmp_path / "run", *QUIET)
    assert p.returncode == 0, show(p)
    assert "starting fresh" not in p.stderr, show(p)
    # Nor that it resumes from its own (issue 29: a fresh script on hpc_train.init() was told so):
    # what each kind of script does.
    assert ("no hpc_train checkpoint to resume: the script starts from step 0 if it steps through "
            "hpc_train.init(), or from its own checkpoints if it loads them itself") in p.stderr, show(p)


# -- 5. a script run's config.yaml -----------------------------------------------------------

READS_ITS_CONFIG = """\
import sys
import hpc_train
run = hpc_train.init()
c = run.config
print("config seen:", c.optim.lr, c.data.name, c.model.name, c.checkpoint.every_seconds, sys.argv[1:], flush=True)
"""


@pytest.mark.procs
def test_a_script_runs_config_holds_only_the_sections_that_apply(tmp_path):
    from hpc_train import config
    from hpc_train.ckpt import compat
    script = tmp_path / "train.py"
    script.write_text(READS_ITS_CONFIG)
    rd = tmp_path / "run"
    p = hpc("run", "--script", script, "--run-dir", rd, "--set", "optim.lr=0.5", *QUIET, "--", "a")
    assert p.returncode == 0, show(p)
    written = yaml.safe_load((rd / "config.yaml").read_text())
    # The built-in trainer's sections are gone, but for what the user set.
    assert set(written) == {"seed", "run_dir", "job", "dist", "optim", "train", "checkpoint", "log"}, written
    assert written["optim"] == {"lr": 0.5}
    assert written["train"]["script"] == str(script) and written["train"]["args"] == ["a"]
    # Of the train section, only what a script is given or its init() reads (issue 29): the
    # built-in trainer's epochs and eval, and train.fn, are left out; the threads are applied.
    assert set(written["train"]) == {"max_steps", "log_every", "script", "args", "script_signal", "precision",
                                     "opt_level"}, written["train"]
    assert written["dist"]["threads_per_rank"] == 1
    # Read back, whatever is left out takes its default: by config.load, by the script's
    # hpc_train.init() (through HPC_TRAIN_CONFIG), and by the resume check.
    back = config.load(rd / "config.yaml")
    assert back.optim.lr == 0.5 and back.data == config.DataSection() and back.model == config.ModelSection()
    assert "config seen: 0.5 digits convnet 600.0 ['a']" in p.stdout, show(p)
    assert compat.changes_on_resume(written, back) == ([], [])


def test_a_function_runs_config_leaves_out_the_trainer_sections_and_the_default_run_keeps_them():
    from hpc_train import config
    fn = config.load(None, ["train.fn=tests.plugins_for_tests:world_report", "model.hidden=7"])
    d = yaml.safe_load(fn.to_yaml())
    assert "data" not in d and "optim" not in d and d["model"] == {"hidden": 7}, d
    assert set(d["train"]) == {"max_steps", "log_every", "fn", "precision", "opt_level"}, d["train"]
    kept = yaml.safe_load(config.load(None, ["train.script=x.py", "train.epochs=3"]).to_yaml())["train"]
    assert kept["epochs"] == 3 and "eval" not in kept      # a key set away from its default stays
    assert config.from_dict(d).to_dict() == fn.to_dict()
    builtin = yaml.safe_load(config.load(DIGITS).to_yaml())
    assert {"data", "model", "optim"} <= set(builtin)


# -- 7. hpc_train.submit(main, nodes=2).result() --------------------------------------------------

def test_a_job_of_several_tasks_gives_rank_0s_result_and_still_every_tasks_results(tmp_path):
    """The job class hpc_train's executor makes. No cluster here: each task's result file is
    written as submitit's own task runner writes it when the callable returns
    (submitit/core/submission.py); tests/slurm/test_first_hour_slurm.py runs it for real."""
    from submitit.core import utils

    from hpc_train.config import load
    from hpc_train.login.submission import make_executor
    ex = make_executor(load(None, ["job.nodes=2"]), tmp_path, dry_run=True)
    job = ex.job_class(folder=ex.folder, job_id="4242", tasks=list(range(ex._num_tasks())))
    assert job.num_tasks == 2
    for task, value in ((0, {"rank": 0}), (1, {"rank": 1})):
        paths = utils.JobPaths(ex.folder, job_id="4242", task_id=task)
        paths.folder.mkdir(parents=True, exist_ok=True)
        with utils.temporary_save_path(paths.result_pickle) as tmp:
            utils.cloudpickle_dump(("success", value), tmp)
    assert job.done() and job.job_id == "4242"
    assert job.result() == {"rank": 0}
    assert job.results() == [{"rank": 0}, {"rank": 1}]
    again = pickle.loads(pickle.dumps(job))          # a Job is kept and reloaded between sessions
    assert type(again) is type(job) and again.job_id == "4242" and again.result() == {"rank": 0}
    assert job.task(1).result() == {"rank": 1}
