"""Issue 51 on the real local cluster: jobs/hf_gpt2.py (a Hugging Face Trainer script) on 2 nodes
under `submit --script`, `sbatch --script` (Slurm's own sbatch of the rendered script) and as an
array task (`submit --script --sweep`), and the unmodified script under `submit --script`: four
jobs side by side (one task per node; the nodes have room for two jobs each), all preempted once
by one `high` job past step 12.

With hpc_train.huggingface's two lines the preemption's stop reaches both ranks at one step, the
Trainer saves ``checkpoint-N`` there, the job is requeued once, and the rerun resumes from that
checkpoint (0 steps redone) to weights bitwise those of an uninterrupted run. The unmodified
script (its own ``get_last_checkpoint``) is requeued once too and stays bitwise, redoing the
steps since its last periodic save.

The reference is the same script and arguments under `run --script --nproc 2` on this machine,
run while the jobs do: 2 ranks over gloo sum the same two numbers in either order, so the weights
do not depend on which launcher started them.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from slurm_helpers import PY, ROOT, assert_bitwise

pytest.importorskip("transformers")
pytestmark = pytest.mark.slurm

SCRIPT = str(ROOT / "jobs" / "hf_gpt2.py")
STEPS = 80
WAYS = {"submit": (), "sbatch": (), "array": (), "unmodified": ("--save-steps", "10", "--unmodified")}


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


def _submit(slurm, root: Path, how: str) -> tuple[str, Path]:
    """(job id, run directory) of one way in."""
    run_dir, out = root / "job", root / "job.sbatch"
    flags = {"sbatch": ("-o", out), "array": ("--sweep", "optim.lr=0.1")}.get(how, ())
    r = slurm.cli("sbatch" if how == "sbatch" else "submit", "--script", SCRIPT, "--nodes", "2", "--partition", "low",
                  "--time", "10", "--run-dir", run_dir, *flags, *_args(root, *WAYS[how]))
    assert r.returncode == 0, r.stderr
    if how == "sbatch":
        return slurm.run("sbatch", "--parsable", out, check=True, cwd=root).stdout.strip().split(";")[0], run_dir
    if how == "array":
        [task] = re.findall(r"submitted array task (\S+):", r.stdout)
        [task_dir] = re.findall(r" -> (.+)$", r.stdout, re.MULTILINE)
        return task, Path(task_dir)
    return re.search(r"submitted job (\d+)", r.stdout).group(1), run_dir


def test_trainer_scripts_preempted_once_on_every_slurm_path_are_requeued_once_and_bitwise(slurm, tmp_path):
    import torch
    ref = tmp_path / "ref"
    reference = subprocess.Popen([PY, "-m", "hpc_train", "run", "--script", SCRIPT, "--nproc", "2", "--run-dir",
                                  str(ref / "run"), *map(str, _args(ref))], env=slurm.env, cwd=ROOT,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    jobs = {how: _submit(slurm, tmp_path / how, how) for how in WAYS}
    for how, (job, run_dir) in jobs.items():
        slurm.wait_state(job, {"RUNNING"}, 120)
        _wait_for(f"{how}: run 1 never reached step 12", lambda: "\nstep 12\n" in _log(run_dir), 240)
    slurm.preempt_all()
    _, err = reference.communicate(timeout=400)
    assert reference.returncode == 0, err[-4000:]
    expected = torch.load(ref / "final.pt", weights_only=True)
    for how, (job, run_dir) in jobs.items():
        assert slurm.wait_done(job, 400) == "COMPLETED", (how, slurm.sacct(job))
        assert slurm.restarts(job) == 1, (how, slurm.sacct(job))        # one requeue, never two
        rec = json.loads((run_dir / "requeue.json").read_text())
        assert rec["counts"] == {"preemption": 1, "timeout": 0, "failure": 0}, (how, rec)
        assert (run_dir / "result.json").exists() and not (run_dir / "stopped.json").exists(), how
        assert_bitwise(expected, torch.load(tmp_path / how / "final.pt", weights_only=True))
        if how == "unmodified":
            continue
        log0 = _log(run_dir)
        stopped = re.search(r"stopped by (\w+) at step (\d+); transformers.Trainer saves its checkpoint", log0)
        assert stopped, (how, log0[-4000:])
        step = int(stopped.group(2))
        # The rerun loaded the checkpoint of the very step the stop agreed on: 0 steps redone.
        out = tmp_path / how / "out"
        assert f"resuming from the Trainer's {out}/checkpoint-{step} (step {step})" in log0, (how, log0[-4000:])
        assert log0.count(f"\nstep {step}\n") == 1 and f"\nstep {step + 1}\n" in log0, how
        assert not (run_dir / "checkpoints").exists(), how
