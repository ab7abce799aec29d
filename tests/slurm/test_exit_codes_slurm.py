"""The exit-code table of docs/faults.md on Slurm's paths: a finish, a stop whose budget is spent, a
refusal and a crash whose budget is spent, through ``submit`` and through a script rendered by
``sbatch`` and submitted with plain sbatch, all at once on the real cluster.

Each code is the one the page documents, read from its table (``helpers.documented_exit``): the
batch script's (the job's, as sacct says it) and the training step's (its worker processes').
The requeue hook's record says the same outcome, read from the run's records, and ``status``
shows it; a refused job changes nothing of the run it was refused: no restart, nothing charged. (The local
paths: tests/guarantees/test_lifecycle_matrix.py.)
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
from helpers import documented_exit, rank_records
from slurm_helpers import ROOT, wait_steps

pytestmark = pytest.mark.slurm

BASE = [str(ROOT / "jobs" / "digits.yaml"), "--set", "train.log_every=1", "--set", "log.tensorboard=false",
        "--set", "train.eval=false", "--set", "log.progress=lines", "--nodes", "1"]
OUTCOME_FLAGS = {
    "finished": ["--set", "train.max_steps=10"],
    # runs until preempted, then stops and saves; its preemption budget is spent (0): no requeue
    # (two ranks: a second job of its script must not touch rank 1's record either)
    "stopped": ["--set", "train.max_steps=100000", "--set", "job.requeue_preemption=0", "--tasks-per-node", "2"],
    # the model's forward raises at step 3 (while the marker exists); no budget to restart or requeue
    "failed": ["--set", "model.name=tests.plugins_for_tests:fail_while_marked", "--set", "train.max_steps=100",
               "--set", "job.restarts_in_place=0", "--set", "job.requeue_failure=0"],
}


def _start(slurm, path: str, outcome: str, d: Path, fail_env: dict[str, str]) -> str:
    """Submits one job of ``outcome`` through ``path``; its job id."""
    rd = d / f"{path}-{outcome}"
    if path == "submit":
        env = {**slurm.env, **fail_env} if outcome == "failed" else None
        r = slurm.cli("submit", *BASE, *OUTCOME_FLAGS[outcome], "--run-dir", rd, env=env)
        assert r.returncode == 0, r.stderr
        return re.search(r"submitted job (\d+)", r.stdout).group(1)
    script = d / f"{outcome}.sbatch"
    r = slurm.cli("sbatch", *BASE, *OUTCOME_FLAGS[outcome], "--run-dir", rd, "-o", script)
    assert r.returncode == 0, r.stderr
    return _sbatch(slurm, script, fail_env if outcome == "failed" else {})


def _sbatch(slurm, script: Path, env: dict[str, str]) -> str:
    export = ",".join(["ALL", *(f"{k}={v}" for k, v in env.items())])
    out = slurm.run("sbatch", "--parsable", f"--export={export}", str(script), check=True, cwd=script.parent)
    return out.stdout.strip().split(";")[0]


def _codes(slurm, job: str) -> tuple[str, str, str]:
    """(state, the batch script's exit code, the training step's) of the job's one run."""
    out = slurm.run("sacct", "-n", "-P", "--duplicates", "-j", job, "-o", "JobID,State,ExitCode", check=True).stdout
    rows = {r[0]: r for r in (line.split("|") for line in out.splitlines() if line.strip())}
    return rows[job][1].split()[0], rows[job][2], rows[f"{job}.0"][2]


def _status(slurm, rd: Path) -> str:
    r = slurm.cli("status", rd)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_every_outcome_s_exit_code_is_the_documented_one_through_submit_and_sbatch(slurm, tmp_path):
    marker = tmp_path / "FAIL"
    marker.write_text("fail")
    fail_env = {"HPC_TEST_FAIL_MARKER": str(marker), "HPC_TEST_FAIL_RUN": "failed", "HPC_TEST_FAIL_AT_STEP": "3"}
    jobs = {(path, outcome): _start(slurm, path, outcome, tmp_path, fail_env)
            for outcome in ("stopped", "finished", "failed") for path in ("submit", "sbatch")}
    for path in ("submit", "sbatch"):
        slurm.wait_state(jobs[path, "stopped"], {"RUNNING"}, 180)
        wait_steps(tmp_path / f"{path}-stopped", 3, 180)
    held = (tmp_path / "submit-stopped" / "job.json").read_bytes()

    # Refused: submit into the running job's directory exits 2 and submits nothing; the same
    # rendered script submitted again is a job refused by the run directory's lock.
    again = slurm.cli("submit", *BASE, *OUTCOME_FLAGS["stopped"], "--run-dir", tmp_path / "submit-stopped")
    assert again.returncode == documented_exit("refused", "slurm") and "Traceback" not in again.stderr, again.stderr
    records = rank_records(tmp_path / "sbatch-stopped")
    dup = _sbatch(slurm, tmp_path / "stopped.sbatch", {})
    slurm.wait_done(dup, 300)
    assert rank_records(tmp_path / "sbatch-stopped") == records, "the refused job rewrote the holder's rank records"
    for key in (("submit", "finished"), ("sbatch", "finished"), ("submit", "failed"), ("sbatch", "failed")):
        slurm.wait_done(jobs[key], 300)
    slurm.preempt_all()
    for path in ("submit", "sbatch"):
        slurm.wait_done(jobs[path, "stopped"], 300)

    for (path, outcome), job in jobs.items():
        rd = tmp_path / f"{path}-{outcome}"
        state, code, step = _codes(slurm, job)
        assert code == f"{documented_exit(outcome, 'slurm')}:0", (path, outcome, state, code)
        assert step == f"{documented_exit(outcome, 'worker')}:0", (path, outcome, state, step)
        assert state == ("COMPLETED" if outcome == "finished" else "FAILED"), (path, outcome, state)
        assert len(slurm.sacct(job)) == 1, slurm.sacct(job)             # never requeued
        # What the hook read of the outcome (its record's final line), and status says it.
        said = _status(slurm, rd)
        # submit's directory names its job (job.json), a plain sbatch script's its rank 0's
        # record: status asks Slurm for the job's state either way, and calls neither a local run.
        assert f"job {job}: {state}" in said and "local run" not in said, said
        if outcome == "finished":
            assert "finished: result.json written" in said and not (rd / "requeue.json").exists(), said
        else:
            final = json.loads((rd / "requeue.json").read_text())["final"]
            assert f"{'preemption' if outcome == 'stopped' else 'failure'} budget (0) spent" in final, final
            assert final in said, said
        if outcome == "failed":   # the culprit's own error, not only the budget
            assert "test failure:" in said, said
    state, code, step = _codes(slurm, dup)
    assert code == f"{documented_exit('refused', 'slurm')}:0", (state, code)
    # The step's code is its worst task's: rank 0's 2, or rank 1's, which srun's
    # --kill-on-bad-exit ended (SIGTERM, then SIGKILL) while it waited for the group rank 0 never
    # joined; sacct writes a signal as 0:15, 0:9 or 9:0, by which task it saw end first.
    killed = {f"0:{int(sig)}" for sig in (signal.SIGTERM, signal.SIGKILL)} | {f"{int(signal.SIGKILL)}:0"}
    assert step == f"{documented_exit('refused', 'worker')}:0" or step in killed, (state, step)
    assert len(slurm.sacct(dup)) == 1, slurm.sacct(dup)                 # not requeued
    # The refused job changed nothing of the run it was refused: the run stopped once, at its own
    # preemption, its budget spent by that alone.
    rd = tmp_path / "sbatch-stopped"
    assert not (rd / "logs" / "rank-0.error").exists(), "the refused job wrote an error file into the holder's run"
    rec = json.loads((rd / "requeue.json").read_text())
    assert len(rec["events"]) == 1 and rec["counts"]["preemption"] == 0, rec
    assert (tmp_path / "submit-stopped" / "job.json").read_bytes() == held   # the refused submit wrote nothing
