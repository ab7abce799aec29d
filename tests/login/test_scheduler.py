"""A scheduler that does not answer: a failed ``squeue`` or ``sacct`` leaves a job unknown, never
ended (submitit's InfoWatcher does the same). ``status`` says so in one line and still shows the
run directory, ``cancel`` refuses and sends no ``scancel``, ``scheduler.wait`` keeps polling, and
``submit`` says in one line that no controller can be reached (issue 29.4), submitting nothing.

A controller that is down cannot be caused on demand here (the real cluster is shared, and
tests/slurm/ needs it up), so ``squeue``, ``sacct``, ``sinfo``, ``sbatch`` and ``scancel`` are small
scripts on PATH that answer as Slurm 22.05 does, word for word, and record every call in ``calls``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from helpers import clean_env, hpc, show

from hpc_train.login import scheduler

DOWN = {  # what each command prints, and its exit status, while slurmctld and slurmdbd are down
    "squeue": ("slurm_load_jobs error: Unable to contact slurm controller (connect failure)", 1),
    "sacct": ("sacct: error: Problem talking to the database: Connection refused", 1),
    "sinfo": ("slurm_load_partitions: Unable to contact slurm controller (connect failure)", 1),
}
# What sinfo 22.05 prints on a machine that knows no controller at all (no slurm.conf, no DNS SRV
# record for one), word for word as measured with the real sinfo here and SLURM_CONF unset.
SINFO_NO_CONTROLLER = """\
sinfo: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host
sinfo: error: fetch_config: DNS SRV lookup failed
sinfo: error: _establish_config_source: failed to fetch config
sinfo: fatal: Could not establish a configuration source"""
SQUEUE_DOWN = "squeue failed: slurm_load_jobs error: Unable to contact slurm controller (connect failure)"


def _tools(tmp_path: Path, **answers: str) -> dict[str, str]:
    """``NAME="shell body"`` for each scheduler command; each call is logged in ``calls`` first."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in {"scancel": "exit 0", **answers}.items():
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {tmp_path}/calls\n{body}\n')
        (bin_dir / name).chmod(0o755)
    return clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}")


def _down(name: str) -> str:
    text, code = DOWN[name]
    return f'echo "{text}" >&2; exit {code}'


def _calls(tmp_path: Path) -> list[str]:
    f = tmp_path / "calls"
    return [line.split()[0] for line in f.read_text().splitlines()] if f.exists() else []


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A submitted run (job 5) that has logged step 3."""
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "job.json").write_text(json.dumps({"jobs": [{"job_id": "5", "submitted": 0, "via": "sbatch"}]}))
    (rd / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 3, "loss": 1.5}\n')
    return rd


def test_cancel_refuses_when_squeue_fails_and_sends_no_scancel(tmp_path, run_dir):
    env = _tools(tmp_path, squeue=_down("squeue"), sacct=_down("sacct"))
    p = hpc("cancel", run_dir, env=env)
    assert p.returncode == 1 and "Traceback" not in p.stderr, show(p)
    lines = p.stderr.strip().splitlines()
    assert lines == [f"hpc_train: error: cannot tell whether job 5 is still live: {SQUEUE_DOWN}; nothing cancelled"], \
        show(p)
    assert "already ended" not in p.stdout, show(p)
    assert _calls(tmp_path) == ["squeue", "sacct"]          # one query, and no scancel


def test_status_says_the_scheduler_did_not_answer_and_still_shows_the_run(tmp_path, run_dir):
    env = _tools(tmp_path, squeue=_down("squeue"), sacct=_down("sacct"))
    p = hpc("status", run_dir, env=env)
    assert p.returncode == 0 and "Traceback" not in p.stderr, show(p)
    assert f"  job 5: unknown, the scheduler did not answer ({SQUEUE_DOWN})" in p.stdout.splitlines(), show(p)
    assert "finished long ago" not in p.stdout, show(p)
    assert "last step 3, loss 1.5000" in p.stdout, show(p)   # the run directory is still read
    assert _calls(tmp_path) == ["squeue", "sacct"]


def test_with_squeue_down_an_accounting_record_is_shown_but_not_taken_as_final(tmp_path, run_dir):
    """slurmdbd may still answer: sacct's last row is shown, but it may be a requeued job's
    earlier run (NODE_FAIL) whose next run the database has not recorded yet."""
    env = _tools(tmp_path, squeue=_down("squeue"), sacct='echo "5|NODE_FAIL|node1|00:00:05|0:0"')
    p = hpc("status", run_dir, env=env)
    assert f"  job 5: unknown, the scheduler did not answer ({SQUEUE_DOWN}); sacct's last record: NODE_FAIL" \
           in p.stdout.splitlines(), show(p)
    p = hpc("cancel", run_dir, env=env)
    assert p.returncode == 1 and "cannot tell whether job 5 is still live" in p.stderr, show(p)
    assert "scancel" not in _calls(tmp_path)


def test_a_purged_job_is_no_failure(tmp_path, run_dir):
    """Slurm's squeue exits 1 with "Invalid job id specified" when asked about one job that has
    left the queue: that is an answer (not queued), so the job has ended."""
    env = _tools(tmp_path, squeue='echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1',
                 sacct='echo "5|COMPLETED|node1|00:01:00|0:0"')
    p = hpc("cancel", run_dir, env=env)
    assert p.returncode == 0 and p.stdout.strip() == "nothing to cancel: 5 already ended", show(p)
    p = hpc("status", run_dir, env=env)
    assert "  job 5: COMPLETED on node1, elapsed 00:01:00, restarts 0" in p.stdout.splitlines(), show(p)


def test_with_sacct_down_a_job_squeue_no_longer_lists_has_ended(tmp_path, run_dir):
    env = _tools(tmp_path, squeue="exit 0", sacct=_down("sacct"))
    p = hpc("status", run_dir, env=env)
    assert ("  job 5: not in the queue (ended); its final state is unknown: sacct failed: "
            "sacct: error: Problem talking to the database: Connection refused") in p.stdout.splitlines(), show(p)
    p = hpc("cancel", run_dir, env=env)
    assert p.returncode == 0 and p.stdout.strip() == "nothing to cancel: 5 already ended", show(p)
    assert "scancel" not in _calls(tmp_path)


def test_cancel_still_cancels_a_live_job(tmp_path, run_dir):
    env = _tools(tmp_path, squeue='echo "5|RUNNING|node1|0:05|None"', sacct='echo "5|RUNNING|node1|00:00:05|0:0"')
    p = hpc("cancel", run_dir, env=env)
    assert p.returncode == 0 and p.stdout.strip() == "cancelled 5", show(p)
    assert _calls(tmp_path) == ["squeue", "sacct", "scancel"]


def test_wait_goes_on_through_a_failed_query(tmp_path, monkeypatch):
    """First poll: squeue fails and sacct's last row is the NODE_FAIL of the job's requeued first
    run; then the job runs again, then it completes. wait returns the completion, and each poll
    is one squeue and one sacct call."""
    count = f'c={tmp_path}/n.$(basename $0); n=$(( $(cat $c 2>/dev/null || echo 0) + 1 )); echo $n > $c'
    squeue = f'{count}\n[ $n -eq 1 ] && {{ {_down("squeue")}; }}\n[ $n -eq 2 ] && echo "5|RUNNING|node2|0:01|None"\nexit 0'
    sacct = (f'{count}\necho "5|NODE_FAIL|node1|00:00:05|0:0"\n'
             '[ $n -ge 3 ] && echo "5|COMPLETED|node2|00:00:09|0:0"\nexit 0')
    env = _tools(tmp_path, squeue=squeue, sacct=sacct)
    monkeypatch.setenv("PATH", env["PATH"])
    seen = []
    final = scheduler.wait(["5"], on_change=lambda answer: seen.append(getattr(answer, "failed", answer)))
    assert final["5"].state == "COMPLETED", final
    assert seen[0] == SQUEUE_DOWN, seen      # the caller is told, once, then that it answered again
    assert seen[1:] == [None, None], seen
    assert _calls(tmp_path) == ["squeue", "sacct"] * 3


@pytest.mark.parametrize("held,delay", [(0, 1.0), (5, 1.0), (10, 1.0), (25, 2.5), (120, 12.0), (300, 30.0),
                                        (86400, 30.0)])
def test_polls_follow_a_tenth_of_the_state_s_age(held, delay):
    assert scheduler.poll_delay(held) == delay


@given(st.floats(0, 1e6), st.floats(0, 1e6))
def test_a_change_is_seen_within_a_tenth_of_its_age_and_never_faster_than_a_second(a, b):
    lo, hi = sorted((a, b))
    assert 1.0 <= scheduler.poll_delay(lo) <= scheduler.poll_delay(hi) <= 30.0
    assert scheduler.poll_delay(hi) <= max(1.0, hi / 10)


@pytest.fixture
def sweep_dir(tmp_path: Path) -> Path:
    """A sweep of one task (array job 7, task 0) that has not finished."""
    sweep = tmp_path / "sweep"
    (sweep / "task-0").mkdir(parents=True)
    manifest = {"source": "x", "created": 0, "submissions": [{"jobs": ["7_0"], "time": 0}],
                "tasks": [{"index": 0, "overrides": {"optim.lr": "0.1"}, "run_dir": str(sweep / "task-0"),
                           "jobs": ["7_0"]}]}
    (sweep / "sweep.json").write_text(json.dumps(manifest))
    return sweep


def test_a_sweep_task_squeue_cannot_see_is_never_resubmitted(tmp_path, sweep_dir):
    env = _tools(tmp_path, squeue=_down("squeue"), sacct=_down("sacct"), sbatch="exit 1", sinfo="exit 1")
    p = hpc("status", sweep_dir, env=env)
    assert p.returncode == 0, show(p)
    assert "0     NO_ANSWER  7_0" in p.stdout and "--resubmit-failed" not in p.stdout, show(p)
    assert f"the scheduler did not answer ({SQUEUE_DOWN}; sacct failed: " in p.stdout, show(p)
    p = hpc("submit", "--resubmit-failed", sweep_dir, env=env)
    assert p.returncode == 2 and "Traceback" not in p.stderr, show(p)
    assert p.stderr.strip().splitlines() == [
        f"hpc_train: error: cannot tell whether task(s) 0 of {sweep_dir} are still live: {SQUEUE_DOWN}; sacct failed: "
        "sacct: error: Problem talking to the database: Connection refused; nothing resubmitted"], show(p)
    assert _calls(tmp_path) == ["squeue", "sacct"] * 2      # and nothing submitted


def test_submit_refuses_a_run_directory_whose_job_may_still_be_live(tmp_path, run_dir):
    env = _tools(tmp_path, squeue=_down("squeue"), sacct=_down("sacct"))
    p = hpc("submit", "jobs/digits.yaml", "--run-dir", run_dir, "--dry-run", env=env)
    assert p.returncode == 2, show(p)
    assert (f"a real submit would refuse this: {run_dir} belongs to job 5, and the scheduler did not say whether "
            f"it is still live ({SQUEUE_DOWN})") in p.stderr, show(p)


@pytest.mark.parametrize("sinfo, line", [
    (f"cat >&2 <<'EOF'\n{SINFO_NO_CONTROLLER}\nEOF\nexit 1",
     "no Slurm controller can be reached from here (sinfo: fatal: Could not establish a configuration source: no "
     "slurm.conf, and no DNS record names a controller); submit from a login node of the cluster, or set "
     "SLURM_CONF; nothing was submitted"),
    (_down("sinfo"), "the Slurm controller does not answer (slurm_load_partitions: Unable to contact slurm "
                     "controller (connect failure)); is slurmctld up? nothing was submitted"),
], ids=["no-controller-known", "controller-down"])
def test_submit_without_a_reachable_controller_is_one_line(tmp_path, sinfo, line):
    env = _tools(tmp_path, sinfo=sinfo, sbatch="exit 1")
    rd = tmp_path / "new-run"
    p = hpc("submit", "jobs/digits.yaml", "--run-dir", rd, env=env)
    assert p.returncode == 2 and "Traceback" not in p.stderr, show(p)
    assert p.stderr.splitlines() == [f"hpc_train: error: {line}"], show(p)
    assert _calls(tmp_path) == ["sinfo"] and not rd.exists()     # nothing submitted, nothing written
