"""Issue 51 on the real local cluster: jobs/hf_gpt2.py (a Hugging Face Trainer script) under
`submit --script` and `sbatch --script` on 2 nodes, preempted once by a `high` job.

With hpc_train.huggingface's two lines the preemption's stop reaches both ranks at one step, the
Trainer saves ``checkpoint-N`` there, the job is requeued once, and the rerun resumes from that
checkpoint (0 steps redone) to weights bitwise those of an uninterrupted run. The unmodified
script (its own ``get_last_checkpoint``) is requeued once too and stays bitwise, redoing the
steps since its last periodic save.

The reference is the same script and arguments under `run --script --nproc 2` on this machine:
2 ranks over gloo sum the same two numbers in either order, so the weights do not depend on
which launcher started them.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from slurm_helpers import ROOT, assert_bitwise

pytest.importorskip("transformers")
pytestmark = pytest.mark.slurm

SCRIPT = str(ROOT / "jobs" / "hf_gpt2.py")
STEPS = 60


def _args(root: Path, *extra) -> list:
    return ["--", "--output-dir", root / "out", "--steps", str(STEPS), "--pace", "0.3", "--weights",
            root / "final.pt", *extra]


def _log(run_dir: Path, rank: int = 0) -> str:
    path = run_dir / "logs" / f"rank-{rank}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def _wait_for(what: str, done, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.3)


def _preempted_once(slurm, tmp_path: Path, *extra: str, how: str = "submit") -> Path:
    """Submit (``submit --script``, or ``sbatch --script`` and Slurm's own sbatch), preempt once
    past step 12, and wait for the requeued run to complete; the run directory, after checking
    that the job was requeued exactly once, for the preemption."""
    run_dir, out = tmp_path / "job", tmp_path / "job.sbatch"
    r = slurm.cli(how, "--script", SCRIPT, "--nodes", "2", "--partition", "low", "--time", "10",
                  "--run-dir", run_dir, *(("-o", out) if how == "sbatch" else ()), *_args(tmp_path, *extra))
    assert r.returncode == 0, r.stderr
    job = (re.search(r"submitted job (\d+)", r.stdout).group(1) if how == "submit" else
           slurm.run("sbatch", "--parsable", out, check=True, cwd=tmp_path).stdout.strip().split(";")[0])
    slurm.wait_state(job, {"RUNNING"}, 120)
    _wait_for("run 1 never reached step 12", lambda: "\nstep 12\n" in _log(run_dir), 240)
    slurm.preempt_all()
    assert slurm.wait_done(job, 400) == "COMPLETED", slurm.sacct(job)
    assert slurm.restarts(job) == 1, slurm.sacct(job)                  # one requeue, never two
    rec = json.loads((run_dir / "requeue.json").read_text())
    assert rec["counts"] == {"preemption": 1, "timeout": 0, "failure": 0}, rec
    assert (run_dir / "result.json").exists() and not (run_dir / "stopped.json").exists()
    return run_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cluster):
    d = tmp_path_factory.mktemp("hf-ref")
    r = cluster.cli("run", "--script", SCRIPT, "--nproc", "2", "--run-dir", d / "run", *_args(d), timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    import torch
    return torch.load(d / "final.pt", weights_only=True)


@pytest.mark.parametrize("how", ["submit", "sbatch"])
def test_trainer_script_preempted_saves_at_its_step_requeues_once_and_is_bitwise(slurm, reference, tmp_path, how):
    import torch
    run_dir = _preempted_once(slurm, tmp_path, how=how)
    log0 = _log(run_dir)
    stopped = re.search(r"stopped by (\w+) at step (\d+); transformers.Trainer saves its checkpoint", log0)
    assert stopped, log0[-4000:]
    step = int(stopped.group(2))
    # The rerun loaded the checkpoint of the very step the stop agreed on: 0 steps redone.
    assert f"resuming from the Trainer's {tmp_path / 'out'}/checkpoint-{step} (step {step})" in log0, log0[-4000:]
    assert log0.count(f"\nstep {step}\n") == 1 and f"\nstep {step + 1}\n" in log0
    assert not (run_dir / "checkpoints").exists()
    assert_bitwise(reference, torch.load(tmp_path / "final.pt", weights_only=True))


def test_unmodified_trainer_script_preempted_is_requeued_once_and_bitwise(slurm, reference, tmp_path):
    import torch
    _preempted_once(slurm, tmp_path, "--save-steps", "10", "--unmodified")
    assert_bitwise(reference, torch.load(tmp_path / "final.pt", weights_only=True))
