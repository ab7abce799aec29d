"""Issue 20 on the real local cluster: what a submit ran is in RUN_DIR/submission.sh (the same text
as the dry run and submitit's copy), a dry run on a directory whose job still runs says the real
submit would refuse, and `hpc_train.submit(fn, nodes=2).result()` is rank 0's return value."""

from __future__ import annotations

import pickle
import re
import shlex

import pytest
from slurm_helpers import ROOT

pytestmark = pytest.mark.slurm

DIGITS = str(ROOT / "jobs" / "digits.yaml")
SNAPSHOT = str(ROOT / "jobs" / "ddp_snapshot.py")


def test_submission_sh_is_what_was_submitted_and_what_the_dry_run_showed(slurm, tmp_path):
    run_dir, snap = tmp_path / "run", tmp_path / "my snap.pt"
    args = ["submit", "--script", SNAPSHOT, "--nodes", "2", "--run-dir", run_dir, "--time", "00:10:00",
            "--", "--epochs", "1", "--snapshot", snap]
    dry = slurm.cli(*args[:-5], "--dry-run", *args[-5:])
    assert dry.returncode == 0, dry.stderr
    assert f"# runs: python {SNAPSHOT} --epochs 1 --snapshot {shlex.quote(str(snap))}," in dry.stdout, dry.stdout
    assert not run_dir.exists()
    r = slurm.cli(*args)
    assert r.returncode == 0, r.stderr
    job = re.search(r"submitted job (\d+)", r.stdout).group(1)
    kept = (run_dir / "submission.sh").read_text()
    assert kept == dry.stdout
    assert kept == (run_dir / "submitit" / f"{job}_submission.sh").read_text()   # what sbatch was given
    assert slurm.wait_done(job, 240) == "COMPLETED"
    assert (run_dir / "submission.sh").read_text() == kept


def test_dry_run_on_a_directory_whose_job_still_runs_says_submit_would_refuse(slurm, tmp_path):
    run_dir = tmp_path / "run"
    r = slurm.cli("submit", DIGITS, "--nodes", "2", "--run-dir", run_dir, "--set", "train.max_steps=1000000",
                  "--set", "log.progress=lines")
    assert r.returncode == 0, r.stderr
    job = re.search(r"submitted job (\d+)", r.stdout).group(1)
    slurm.wait_state(job, {"RUNNING"}, 120)
    try:
        dry = slurm.cli("submit", DIGITS, "--nodes", "2", "--run-dir", run_dir, "--dry-run")
        assert dry.returncode == 2 and "#SBATCH --nodes=2" in dry.stdout, dry.stderr
        assert len(dry.stderr.strip().splitlines()) == 1, dry.stderr
        # A running job's rank 0 holds the run directory's lock: that refusal names the job first.
        assert any(f"a real submit would refuse this: {run_dir} {s}" in dry.stderr
                   for s in (f"belongs to job {job}, which is RUNNING", f"is in use by Slurm job {job} ")), dry.stderr
        real = slurm.cli("submit", DIGITS, "--nodes", "2", "--run-dir", run_dir)
        assert real.returncode == 2 and any(s in real.stderr for s in (
            f"belongs to job {job}, which is RUNNING", f"is in use by Slurm job {job} ")), real.stderr
        assert slurm.state(job).split()[0] == "RUNNING"
    finally:
        slurm.run("scancel", job)


def test_result_of_a_two_node_callable_is_rank_0s_return_value(slurm, tmp_path, monkeypatch):
    for k, v in slurm.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.syspath_prepend(str(ROOT))
    import hpc_train
    from tests.plugins_for_tests import world_report
    job = hpc_train.submit(world_report, 10.0, nodes=2, run_dir=tmp_path / "fn")
    first = job.result()             # submitit's own Job raised "use `results()`" here
    assert first["rank"] == 0 and first["world"] == 2 and first["sum"] == 30.0, first   # (1+2) x 10
    every = job.results()
    assert [r["rank"] for r in every] == [0, 1] and every[0] == first
    assert job.done() and slurm.wait_done(str(job.job_id), 60) == "COMPLETED"   # sacct may lag result()
    again = pickle.loads(pickle.dumps(job))
    assert again.job_id == job.job_id and again.result() == first
    assert "# runs: tests.plugins_for_tests.world_report (1 positional argument)" in \
        (tmp_path / "fn" / "submission.sh").read_text()
