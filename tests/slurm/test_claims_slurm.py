"""Issue 23: README claims that only a real Slurm cluster can show, with no test before.

- a spent ``job.requeue_preemption`` budget: the preempted job stops, saves, and is not requeued;
- ``submit`` refuses a run directory held by a running ``run`` (its lock), and one whose last job
  is still pending or running; nothing is submitted and nothing in the directory changes.

Same cluster, fixtures and helpers as the other tests here (tests/slurm/conftest.py).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from slurm_helpers import PY, ROOT, wait_steps

pytestmark = pytest.mark.slurm

BASE = [str(ROOT / "jobs" / "digits.yaml"), "--set", "train.log_every=1", "--set", "log.tensorboard=false",
        "--set", "train.eval=false", "--set", "log.progress=lines"]


def _jobs(slurm) -> list[str]:
    return sorted(slurm.run("squeue", "-h", "-o", "%i").stdout.split())


def test_spent_preemption_budget_stops_without_a_requeue(slurm, tmp_path):
    run_dir = tmp_path / "job"
    r = slurm.cli("submit", *BASE, "--set", "train.max_steps=100000", "--set", "job.requeue_preemption=0",
                  "--nodes", "1", "--partition", "low", "--run-dir", run_dir)
    assert r.returncode == 0, r.stderr
    job = re.search(r"submitted job (\d+)", r.stdout).group(1)
    slurm.wait_state(job, {"RUNNING"}, 120)
    wait_steps(run_dir, 50, 180)
    slurm.preempt_all()
    final = slurm.wait_done(job, 180)
    runs = slurm.sacct(job)
    assert len(runs) == 1, runs                                 # never requeued
    # Ended unfinished, by the hook's own exit code for a stop that is not requeued (errors.EXIT_STOPPED).
    assert final.split()[0] == "FAILED" and runs[0]["ExitCode"] == "3:0", (final, runs)
    rec = json.loads((run_dir / "requeue.json").read_text())
    assert "preemption budget (0) spent, not requeued" in rec["final"], rec
    assert rec["counts"]["preemption"] == 0, rec
    assert len(rec["events"]) == 1 and rec["events"][0]["requeued"] is False, rec
    # What was done is kept: a complete checkpoint at the step it stopped.
    saved = re.findall(r"checkpoint saved by \S+ at step (\d+)", (run_dir / "logs" / "rank-0.log").read_text())
    assert len(saved) == 1, saved
    assert (run_dir / "checkpoints" / f"step-{saved[0]}" / "commit.json").exists()
    assert not (run_dir / "result.json").exists()
    status = slurm.cli("status", run_dir)
    assert status.returncode == 0 and "preemption 0" in status.stdout, status.stdout


def test_submit_refuses_a_directory_that_a_local_run_holds(slurm, tmp_path):
    run_dir = tmp_path / "job"
    env = {k: v for k, v in slurm.env.items() if not k.startswith("SLURM_")}
    holder = subprocess.Popen([PY, "-m", "hpc_train", "run", *BASE, "--set", "train.max_steps=100000",
                               "--set", "checkpoint.every_steps=20", "--run-dir", str(run_dir)],
                              env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(run_dir.glob("checkpoints/step-*/commit.json")):
            assert holder.poll() is None and time.monotonic() < deadline, "the local run did not get going"
            time.sleep(0.2)
        config, queued = (run_dir / "config.yaml").read_bytes(), _jobs(slurm)
        r = slurm.cli("submit", *BASE, "--nodes", "1", "--run-dir", run_dir)
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert f"{run_dir} is in use by" in lines[0] and f"pid {holder.pid}" in lines[0], lines
        assert _jobs(slurm) == queued                            # nothing submitted
        assert not (run_dir / "job.json").exists() and not (run_dir / "submitit").exists()
        assert (run_dir / "config.yaml").read_bytes() == config  # the holder's config not rewritten
        assert holder.poll() is None                             # the holder trains on
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.communicate(timeout=120)


@pytest.mark.parametrize("state", ["PENDING", "RUNNING"])
def test_submit_refuses_a_directory_whose_last_job_is_live(slurm, tmp_path, state):
    run_dir = tmp_path / "job"
    blocker = None
    if state == "PENDING":   # every node taken first, so the job cannot start before it is held
        nodes = slurm.run("sinfo", "-h", "-p", "high", "-o", "%D", check=True).stdout.split()[0]
        blocker = slurm.run("sbatch", "--parsable", "-p", "high", f"-N{nodes}", "--exclusive", "-o", "/dev/null",
                            "--wrap", "sleep 120", check=True).stdout.strip()
        slurm.wait_state(blocker, {"RUNNING"}, 60)
    r = slurm.cli("submit", *BASE, "--set", "train.max_steps=100000", "--nodes", "1", "--run-dir", run_dir)
    assert r.returncode == 0, r.stderr
    job = re.search(r"submitted job (\d+)", r.stdout).group(1)
    try:
        if state == "PENDING":
            slurm.run("scontrol", "hold", job, check=True)       # held: pending until released
            slurm.run("scancel", blocker, check=True)
            assert slurm.wait_state(job, {"PENDING", "RUNNING"}, 60) == "PENDING"
        else:
            slurm.wait_state(job, {"RUNNING"}, 120)
            wait_steps(run_dir, 5, 180)
        job_json, config = (run_dir / "job.json").read_text(), (run_dir / "config.yaml").read_bytes()
        queued = _jobs(slurm)
        again = slurm.cli("submit", *BASE, "--nodes", "1", "--run-dir", run_dir)
        lines = [x for x in again.stderr.splitlines() if x.strip()]
        assert again.returncode == 2 and len(lines) == 1 and "Traceback" not in again.stderr, again.stderr
        # A running job's rank 0 holds the run directory's lock: that refusal names the job first.
        live = (f"belongs to job {job}, which is {state}", f"is in use by Slurm job {job} ")
        assert any(s in lines[0] for s in (live if state == "RUNNING" else live[:1])), lines
        assert _jobs(slurm) == queued                            # nothing submitted
        assert (run_dir / "job.json").read_text() == job_json    # the run's records untouched
        assert (run_dir / "config.yaml").read_bytes() == config
    finally:
        slurm.run("scancel", job)
