"""Issue 33 (5) on the real local cluster: jobs/lightning_digits.py, a plain Lightning script,
under `submit --script` on 2 nodes (`num_nodes=2, devices=1`, SLURMEnvironment with Lightning's
own requeue off), preempted once by a `high` job and stopped once by its time limit. Each stop
reaches the script as SIGTERM, once, from hpc_train (issue 33, part 1) and saves through
Lightning's SIGTERM path (OnExceptionCheckpoint); hpc_train requeues the job exactly once for each;
the final weights are bitwise those of an uninterrupted Slurm run.

Each stop lands on an epoch boundary, the case Lightning resumes bitwise (docs/lightning.md):
while a pause file exists, every rank waits at an epoch's end until a stop comes (the script's
``--pause-file``). Run 1 waits after epoch 0 and is preempted there. Run 2 resumes, waits after
epoch 1 until its time limit's signal, and the file is then removed: run 3 trains to the end,
long before its own limit. The job is submitted with ``--time 4 --signal-lead 30`` (a stop earlier
than 150 s into a run is a preemption's: run 1's is, though the `high` job that preempts it waits
for the uninterrupted run beside it to end); once run 2 waits after epoch 1, its limit is
lowered to 2 minutes (``scontrol update``), so its signal comes 60-90 s into it, as slurmctld
checks every 30 s, not 120-150 s: a stop with 90 s or less left is the time limit's.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from slurm_helpers import ROOT, assert_bitwise

pytestmark = pytest.mark.slurm

SCRIPT = str(ROOT / "jobs" / "lightning_digits.py")
EPOCHS = 6      # of 14 steps each on 2 ranks


def _args(root: Path, *extra) -> list:
    return ["--", "--devices", "1", "--num-nodes", "2", "--epochs", str(EPOCHS), "--root", root / "ld",
            "--weights", root / "final.pt", *extra]


def _log(run_dir: Path, rank: int = 0) -> str:
    path = run_dir / "logs" / f"rank-{rank}.log"
    return path.read_text() if path.exists() else ""


def _wait_for(what: str, done, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.3)


def test_lightning_script_preempted_then_timed_out_is_requeued_once_each_and_bitwise(slurm, tmp_path):
    import torch
    # What the stopped job must equal: the same script and arguments on the cluster, never
    # stopped. It runs beside the job, in the `high` partition: nothing preempts it, and the
    # `high` job that preempts the job waits for it to end (it asks for every node).
    ref = tmp_path / "ref"
    r = slurm.cli("submit", "--script", SCRIPT, "--nodes", "2", "--partition", "high", "--time", "10",
                  "--run-dir", ref / "run", *_args(ref))
    assert r.returncode == 0, r.stderr
    ref_job = re.search(r"submitted job (\d+)", r.stdout).group(1)
    run_dir, pause, ckpts = tmp_path / "job", tmp_path / "pause", tmp_path / "ld" / "checkpoints"
    pause.touch()
    r = slurm.cli("submit", "--script", SCRIPT, "--nodes", "2", "--partition", "low", "--time", "4",
                  "--signal-lead", "30", "--run-dir", run_dir, *_args(tmp_path, "--pause-file", pause))
    assert r.returncode == 0, r.stderr
    job = re.search(r"submitted job (\d+)", r.stdout).group(1)

    slurm.wait_state(job, {"RUNNING"}, 120)          # run 1: held after epoch 0, preempted there
    _wait_for("run 1 never ended epoch 0", lambda: "epoch 0 ended at step 14" in _log(run_dir), 240)
    slurm.preempt_all()
    # Run 2 (its log appended to run 1's): held after epoch 1 until the time limit's signal.
    _wait_for("run 2 never ended epoch 1", lambda: "epoch 1 ended at step 28" in _log(run_dir), 300)
    slurm.run("scontrol", "update", f"JobId={job}", "TimeLimit=2", check=True)
    _wait_for("run 2 was never stopped", lambda: _log(run_dir).count("Received SIGTERM") == 2, 300)
    pause.unlink()                                   # run 3 trains through
    assert slurm.wait_done(job, 400) == "COMPLETED"

    runs = slurm.sacct(job)
    assert len(runs) == 3 and runs[-1]["State"] == "COMPLETED", runs
    assert slurm.restarts(job) == 2                  # one requeue per stop, never two
    rec = json.loads((run_dir / "requeue.json").read_text())
    assert rec["counts"] == {"preemption": 1, "timeout": 1, "failure": 0} and not rec.get("in_place"), rec
    for rank in (0, 1):
        log = _log(run_dir, rank)
        assert log.count(f"rank {rank} of 2 (SLURMEnvironment)") == 3, log[-3000:]
        assert log.count("Received SIGTERM") == 2, log[-3000:]            # once per stop, from hpc_train
        assert "SLURM auto-requeueing enabled" not in log                 # Lightning's requeue stayed off
    log0 = _log(run_dir)
    assert log0.count(f"Restoring states from the checkpoint path at {ckpts / 'on_exception.ckpt'}") == 2, log0
    assert "ended before the epoch ended" not in log0                     # both resumes at an epoch boundary
    assert "epoch 0 ended" in log0 and log0.count("epoch 1 ended") == 1 and f"epoch {EPOCHS - 1} ended" in log0
    assert (run_dir / "result.json").exists() and not (run_dir / "stopped.json").exists()
    assert slurm.wait_done(ref_job, 300) == "COMPLETED" and len(slurm.sacct(ref_job)) == 1, slurm.sacct(ref_job)
    assert_bitwise(torch.load(ref / "final.pt", weights_only=True),
                   torch.load(tmp_path / "final.pt", weights_only=True))


def test_lightning_s_own_requeue_at_the_time_limit_is_counted_as_the_time_limit_s(slurm, tmp_path):
    """Issue 33 (2, 5): what the docs advise against, done anyway. With
    ``train.script_signal=passthrough`` Slurm's USR2 reaches the script, and Lightning's
    ``SLURMEnvironment(auto_requeue=True, requeue_signal=SIGUSR2)`` runs ``scontrol requeue``
    itself at the time limit's signal: Slurm ends the batch shell, and hpc_train's hook never runs
    for that run. The next run's hook finds it in sacct and counts it once, as the time limit's
    (not a preemption's); ``status`` says who requeued it."""
    run_dir, pause = tmp_path / "job", tmp_path / "pause"
    pause.touch()
    r = slurm.cli("submit", "--script", SCRIPT, "--nodes", "1", "--partition", "low", "--time", "5",
                  "--signal-lead", "30", "--set", "train.script_signal=passthrough", "--run-dir", run_dir,
                  "--", "--devices", "1", "--num-nodes", "1", "--epochs", "2", "--root", tmp_path / "ld",
                  "--pause-file", pause, "--lightning-requeue")
    assert r.returncode == 0, r.stderr
    job = re.search(r"submitted job (\d+)", r.stdout).group(1)
    # Run 1 waits after epoch 0, Lightning's handler in place; its limit is then lowered to 1 minute,
    # so the time limit's signal comes at the controller's next check, and Lightning requeues.
    _wait_for("run 1 never ended epoch 0", lambda: "epoch 0 ended at step 28" in _log(run_dir), 240)
    slurm.run("scontrol", "update", f"JobId={job}", "TimeLimit=1", check=True)
    _wait_for("Lightning never requeued the job", lambda: slurm.restarts(job) >= 1, 120)
    # Run 2's own limit, raised once slurmdbd keeps run 1 apart (an update before that lands on
    # run 1's row), before run 2 starts (the controller holds a requeued job a few seconds).
    _wait_for("sacct never listed run 2", lambda: len(slurm.sacct(job)) >= 2, 60)
    slurm.run("scontrol", "update", f"JobId={job}", "TimeLimit=5", check=True)
    pause.unlink()                                   # run 2 trains to the end
    assert slurm.wait_done(job, 300) == "COMPLETED"
    runs = slurm.sacct(job)
    assert slurm.restarts(job) == 1 and [x["State"] for x in runs] == ["REQUEUED", "COMPLETED"], runs
    log = _log(run_dir)
    assert "SLURM auto-requeueing enabled" in log and "Handling auto-requeue signal" in log, log[-3000:]
    rec = json.loads((run_dir / "requeue.json").read_text())
    assert rec["counts"] == {"preemption": 0, "timeout": 1, "failure": 0}, rec
    assert [(e["key"], e["by"]) for e in rec["events"]] == [(f"{job}:0", "outside")], rec
    st = slurm.cli("status", run_dir)
    assert "(timeout 1 of them requeued outside hpc_train)" in st.stdout, st.stdout + st.stderr
