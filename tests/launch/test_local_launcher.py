"""Real multi-process runs of ``python -m hpc_train run``: gloo process groups, real signals.

Kept small (the linear model on a few hundred synthetic samples) except where real digits are
the point. No timing is asserted; subprocess timeouts only turn a hang into a failure.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_train.ckpt import store
from hpc_train.errors import EXIT_STOPPED

RESULT_KEYS = {"train_loss", "test_accuracy", "steps", "epochs", "wall_seconds", "world_size"}
PLUGINS = "tests.plugins_for_tests"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def alive(pid: int) -> bool:
    """Without psutil: a pid that is gone or a zombie (exited, not yet reaped) is not alive."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.procs
def test_two_process_run_reports_everything(run_cli, run_dir, smoke):
    r = run_cli("run", "jobs/digits.yaml", "--nproc", "2", "--run-dir", run_dir, *smoke,
                "--set", "train.max_steps=12", "--set", "train.log_every=4")
    assert r.returncode == 0, r.stderr
    assert f"tensorboard --logdir {run_dir / 'tb'}" in r.stderr      # says where the curves are

    result = json.loads((run_dir / "result.json").read_text())
    assert RESULT_KEYS <= result.keys()
    # 256 samples / (16 per rank x 2 ranks) = 8 steps per epoch: step 12 is in epoch 1.
    assert (result["steps"], result["epochs"], result["world_size"]) == (12, 1, 2)
    assert 0.0 <= result["test_accuracy"] <= 1.0 and math.isfinite(result["train_loss"])
    assert result["wall_seconds"] > 0 and result["effective_batch_size"] == 32

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics if "loss" in m] == list(range(1, 13))
    assert 8 in [m["step"] for m in metrics if "eval_acc" in m]          # the end of epoch 0
    assert [m["step"] for m in metrics if "samples_per_s" in m] == [4, 8, 12]

    for rank in (0, 1):
        lines = (run_dir / "logs" / f"rank-{rank}.log").read_text().splitlines()
        records = [ln for ln in lines if ln.startswith("[rank ")]
        assert records and all(ln.startswith(f"[rank {rank}] ") for ln in records)
        assert any("process group ready: gloo, world 2" in ln for ln in records)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/acc", "lr", "samples_per_s", "eval/acc"} <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 13))
    assert 8 in [e.step for e in acc.Scalars("eval/acc")]
    speeds = acc.Scalars("samples_per_s")
    assert [e.step for e in speeds] == [4, 8, 12] and all(e.value > 0 for e in speeds)


@pytest.mark.procs
def test_digits_job_reaches_95_percent(run_cli, run_dir):
    """The `make run` acceptance: the real job, real handwritten digits, 2 processes."""
    r = run_cli("run", "jobs/digits.yaml", "--nproc", "2", "--run-dir", run_dir, timeout=400)
    assert r.returncode == 0, r.stderr
    result = json.loads((run_dir / "result.json").read_text())
    assert result["world_size"] == 2
    assert result["test_accuracy"] >= 0.95, result


@pytest.mark.parametrize("fn,says", [("die_on_rank1", "RuntimeError: boom from rank 1"),
                                     ("exit_on_rank1", "exit code 3")])
@pytest.mark.procs
def test_a_dying_worker_stops_the_run(run_cli, run_dir, fn, says):
    """Rank 1 fails while rank 0 waits for it in a collective: the command ends, names rank 1 and
    its error, and leaves no worker behind. (The timeout only turns a hang into a failure.)"""
    try:
        r = run_cli("run", "jobs/digits.yaml", "--nproc", "2", "--run-dir", run_dir, "--set",
                    f"train.fn={PLUGINS}:{fn}", timeout=60)
    except subprocess.TimeoutExpired:
        # The workers run in their own sessions: killing the launcher leaves them behind.
        for f in run_dir.glob("pid-rank*"):
            try:
                os.kill(int(f.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
        pytest.fail("`run` hung after rank 1 died (killed after 60 s)")
    assert r.returncode not in (0, 2), r.stderr
    blame = [ln for ln in r.stderr.splitlines() if ln.startswith("hpc_train: worker rank")]
    assert len(blame) == 1 and blame[0].startswith("hpc_train: worker rank 1 failed") and says in blame[0], r.stderr
    assert str(run_dir / "logs" / "rank-1.log") in r.stderr
    pids = [int((run_dir / f"pid-rank{rank}").read_text()) for rank in (0, 1)]
    assert not [p for p in pids if alive(p)]
    assert not (run_dir / "result.json").exists()


def wait_for_step(log: Path, proc: subprocess.Popen, step: int, limit_s: float = 120) -> None:
    """Until rank 0 has logged a step >= ``step`` (a hang guard, not a timing assertion)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        if log.exists() and any(int(s) >= step for s in re.findall(r" step (\d+)/", log.read_text())):
            return
        time.sleep(0.05)
    raise AssertionError(f"no step {step} in {log} after {limit_s}s")


@pytest.mark.procs
def test_ctrl_c_saves_and_the_same_command_resumes(py, clean_env, run_dir, tmp_path):
    total = 30
    argv = [py, "-m", "hpc_train", "run", "jobs/digits.yaml", "--nproc", "2", "--run-dir", str(run_dir),
            "--set", f"data.name={PLUGINS}:slow_data", "--set", "data.synthetic_size=160",
            "--set", "data.batch_size=8", "--set", "model.name=linear", "--set", f"train.max_steps={total}",
            "--set", "train.log_every=1", "--set", "log.progress=lines", "--set", "log.tensorboard=false"]
    root = Path(__file__).resolve().parents[2]
    err = tmp_path / "first.err"
    with open(err, "w") as ferr:
        # Each training sample takes 20 ms to load: about 0.16 s a step, so the interrupt lands mid-run.
        proc = subprocess.Popen(argv, env=clean_env(HPC_TEST_SLOW_S="0.02"), cwd=root, stdout=subprocess.DEVNULL,
                                stderr=ferr)
        try:
            wait_for_step(run_dir / "logs" / "rank-0.log", proc, 2)
            proc.send_signal(signal.SIGINT)             # what Ctrl-C sends to the launcher
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    stderr = err.read_text()
    assert code == EXIT_STOPPED, stderr
    m = re.search(r"checkpoint saved at step (\d+); run the same command to resume", stderr)
    assert m, stderr
    step = int(m.group(1))
    assert 2 <= step < total
    assert json.loads((run_dir / "stopped.json").read_text())["steps"] == step
    ckpt = store.inspect(run_dir / "checkpoints" / f"step-{step}")
    assert ckpt.complete, ckpt.problem
    assert {"rank-0.pt", "rank-1.pt"} <= ckpt.record["files"].keys() and ckpt.record["world_size"] == 2
    assert not (run_dir / "result.json").exists()

    again = subprocess.run(argv, env=clean_env(), cwd=root, capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stderr
    assert f"resuming from step {step}" in again.stderr
    assert f"resumed from step {step} ({run_dir / 'checkpoints' / f'step-{step}'})" in \
        (run_dir / "logs" / "rank-0.log").read_text()
    result = json.loads((run_dir / "result.json").read_text())
    assert result["steps"] == total and not (run_dir / "stopped.json").exists()
    # The curves continue without a doubled segment: every step recorded exactly once.
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m] == list(range(1, total + 1))


@pytest.mark.parametrize("accum,steps", [(1, 12), (2, 6)])
@pytest.mark.procs
def test_user_plugins_and_gradient_accumulation(run_cli, clean_env, run_dir, tmp_path, accum, steps):
    """The model and the dataset come from the user's module by import path; with
    optim.grad_accum=2 an epoch has half the optimizer steps and sees the same samples."""
    marks = tmp_path / "marks"
    marks.mkdir()
    r = run_cli("run", "jobs/digits.yaml", "--nproc", "2", "--run-dir", run_dir,
                "--set", f"model.name={PLUGINS}:tiny_model", "--set", f"data.name={PLUGINS}:small_data",
                "--set", "data.batch_size=8", "--set", "train.epochs=2", "--set", "train.max_steps=0",
                "--set", f"optim.grad_accum={accum}", "--set", "log.tensorboard=false",
                env=clean_env(HPC_TEST_MARK_DIR=str(marks)))
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in marks.iterdir()) == ["small_data-rank0", "small_data-rank1",
                                                       "tiny_model-rank0", "tiny_model-rank1"]
    result = json.loads((run_dir / "result.json").read_text())
    # 96 samples / (8 per rank x 2 ranks) = 6 micro-batches per rank per epoch.
    assert (result["steps"], result["epochs"]) == (steps, 2)
    assert result["effective_batch_size"] == 16 * accum
    assert result["progress"]["samples_seen"] == 2 * 96
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics if "eval_acc" in m] == [steps // 2, steps]
    log0 = (run_dir / "logs" / "rank-0.log").read_text()
    assert f"model {PLUGINS}:tiny_model" in log0 and f"{steps // 2} steps/epoch" in log0


@pytest.mark.procs
def test_digits_are_read_exactly_as_scikit_learn_loads_them():
    # data.py reads scikit-learn's digits file without importing scikit-learn (a restart's
    # start-up cost); the arrays must be the ones load_digits returns, bit for bit.
    import numpy as np
    from sklearn.datasets import load_digits

    from hpc_train.trainer import data
    images, target = data._digits_arrays()
    ref = load_digits()
    assert images.dtype == ref.images.dtype and np.array_equal(images, ref.images)
    assert target.dtype == ref.target.dtype and np.array_equal(target, ref.target)


@pytest.mark.procs
def test_a_non_daemon_thread_of_the_users_code_is_waited_for_at_exit(run_cli, run_dir, smoke):
    # A finished worker leaves without the interpreter's teardown (lifecycle.exit_done), but not while
    # a non-daemon thread of the user's code still runs: a normal exit would wait for it.
    r = run_cli("run", "jobs/digits.yaml", "--nproc", "2", "--run-dir", run_dir, *smoke,
                "--set", f"train.fn={PLUGINS}:leaves_a_thread", timeout=120)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in run_dir.glob("uploaded-rank*")) == ["uploaded-rank0", "uploaded-rank1"]


@pytest.mark.procs
def test_the_users_code_runs_with_the_garbage_collector_on(run_cli, run_dir, smoke):
    # The worker turns Python's cyclic collector off while torch imports (goodput.pause_gc); the
    # user's callable must get it back on, or its reference cycles would never be freed.
    r = run_cli("run", "jobs/digits.yaml", "--nproc", "2", "--run-dir", run_dir, *smoke,
                "--set", f"train.fn={PLUGINS}:reports_gc", timeout=120)
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        assert json.loads((run_dir / f"gc-rank{rank}.json").read_text()) == {"enabled": True}


def test_start_up_pauses_the_collector_and_freezes_what_it_made():
    # In a fresh interpreter: pytest's own collector state must not change.
    code = """
import gc
from hpc_train import goodput
goodput.resume_gc()                      # never paused: a no-op
assert gc.isenabled() and gc.get_freeze_count() == 0
goodput.pause_gc()
assert not gc.isenabled()
made = [[i] for i in range(1000)]        # start-up's objects
goodput.resume_gc()
assert gc.isenabled() and gc.get_freeze_count() >= 1000
gc.disable()                             # a collector the user turned off stays theirs
goodput.pause_gc(); goodput.resume_gc()
assert not gc.isenabled()
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[2], timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
