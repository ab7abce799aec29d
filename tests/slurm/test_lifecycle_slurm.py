"""One lifecycle on Slurm's plain path: a user's ``train.py`` through ``hpc_train.init()``, started by
a plain ``srun`` in the user's own batch script (no hpc_train launcher). The same guarantees as
tests/guarantees/test_lifecycle_matrix.py: busy, stop, goodput, no stale stop record, finished."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from slurm_helpers import PY, ROOT, metric_lines


pytestmark = pytest.mark.slurm

SCRIPT = str(ROOT / "tests" / "scripts" / "own_loop.py")
STEPS = 600


def _sbatch(slurm, tmp: Path, name: str, sleep: str) -> str:
    return slurm.run("sbatch", "--parsable", "-N2", "--ntasks-per-node=1", "-p", "low", "-D", str(tmp),
                     "-o", str(tmp / f"{name}.out"), "--wrap", f"srun {PY} {SCRIPT} {STEPS} {sleep}",
                     check=True).stdout.strip()


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """relative path -> (size, mtime_ns) of every file, but the lock and the heartbeats (liveness)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock" and ".heartbeat" not in p.parts}


def _max_step(rd: Path) -> int:
    try:
        return max((json.loads(ln).get("step", 0) for ln in metric_lines(rd)), default=0)
    except (OSError, ValueError):
        return 0


def test_plain_srun_of_an_own_loop_keeps_every_guarantee(slurm, tmp_path):
    rd = tmp_path / "runs" / "own_loop"
    first = _sbatch(slurm, tmp_path, "first", "0.2")
    slurm.wait_state(first, {"RUNNING"}, 120)
    deadline = time.monotonic() + 180
    while _max_step(rd) < 3:
        assert time.monotonic() < deadline, (tmp_path / "first.out").read_text()[-3000:]
        time.sleep(0.3)
    # busy: a second job into the same run directory is refused, naming the holder
    second = _sbatch(slurm, tmp_path, "second", "0.2")
    assert slurm.wait_done(second, 180) == "FAILED"
    out2 = (tmp_path / "second.out").read_text()
    assert f"is in use by Slurm job {first}" in out2 and "Traceback" not in out2, out2[-3000:]
    assert slurm.state(first) == "RUNNING", "the first job was harmed by the refused second one"
    # stop: SIGTERM to the tasks saves, exits non-zero, says how to resume
    slurm.run("scancel", "--signal=TERM", first, check=True)
    slurm.wait_done(first, 180)
    row = slurm.sacct(first)[-1]
    assert row["State"] == "FAILED" and row["ExitCode"].startswith("3:"), row
    out1 = (tmp_path / "first.out").read_text()
    assert "resume with: the same srun command" in out1, out1[-3000:]
    stopped = json.loads((rd / "stopped.json").read_text())
    assert stopped["checkpoint"] is True and stopped["steps"] >= 3, stopped
    assert (rd / "goodput.json").is_file() and not (rd / "result.json").exists()
    # the same batch script resumes and finishes: no stale stop record, steps neither redone nor lost
    third = _sbatch(slurm, tmp_path, "third", "0")
    assert slurm.wait_done(third, 240) == "COMPLETED", (tmp_path / "third.out").read_text()[-3000:]
    assert json.loads((rd / "result.json").read_text())["steps"] == STEPS
    assert not (rd / "stopped.json").exists(), "a stale stopped.json after the run finished"
    assert len(json.loads((rd / "goodput.json").read_text())["segments"]) >= 2
    # One row per logged step (the ranks' step-time spread, every 50 steps, is a row of its own)
    steps = [r["step"] for r in map(json.loads, metric_lines(rd)) if "loss" in r]
    assert steps == list(range(1, STEPS + 1)), steps
    # finished: a fourth start does nothing, exits 0, changes nothing
    before = snapshot(rd)
    fourth = _sbatch(slurm, tmp_path, "fourth", "0")
    assert slurm.wait_done(fourth, 180) == "COMPLETED"
    out4 = (tmp_path / "fourth.out").read_text()
    assert out4.count(f"finished at step {STEPS}") == 1 and "nothing to do" in out4, out4[-3000:]
    assert snapshot(rd) == before
