"""Helpers for the tests under tests/slurm/ (the fixtures are in conftest.py)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEVCLUSTER = ROOT / "slurm" / "devcluster.sh"
PY = sys.executable
IN_CI = os.environ.get("CI", "").lower() == "true"


def _unavailable(why: str):
    if IN_CI:
        pytest.fail(f"Slurm tests must run in CI, but: {why}")
    pytest.skip(why)


@dataclass
class Cluster:
    env: dict[str, str]          # PATH with the shims first, SLURM_CONF, PYTHONPATH

    def run(self, *cmd: str, timeout: float = 60, check: bool = False, cwd=None) -> subprocess.CompletedProcess:
        out = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr}{out.stdout}")
        return out

    def cli(self, *args: str, timeout: float = 300, cwd=None, env=None) -> subprocess.CompletedProcess:
        return subprocess.run([PY, "-m", "hpc_train", *map(str, args)], env=env or self.env, capture_output=True,
                              text=True, timeout=timeout, cwd=cwd or ROOT)

    def sacct(self, job_id: str) -> list[dict[str, str]]:
        out = self.run("sacct", "-n", "-P", "-X", "--duplicates", "-j", job_id,
                       "-o", "JobID,State,ExitCode,NodeList,Start,End", check=True).stdout
        keys = ["JobID", "State", "ExitCode", "NodeList", "Start", "End"]
        return [dict(zip(keys, line.split("|"))) for line in out.splitlines() if line.strip()]

    def job_steps(self, job_id: str) -> list[str]:
        """The job's numbered steps (``JOB.0``, ``JOB.1``, ...), as sacct lists them."""
        out = self.run("sacct", "-n", "-P", "-j", job_id, "-o", "JobID,JobName", check=True).stdout.split()
        # Not the local tier's cleanup at the job's end (a step of its own, by name).
        return [x.split("|")[0] for x in out if re.fullmatch(rf"{job_id}\.\d+\|.*", x)
                and x.split("|")[1] != "hpc_train-cleanup"]

    def restarts(self, job_id: str) -> int:
        """Slurm's ``Restarts`` of the job (requeues), from ``scontrol show job``."""
        out = self.run("scontrol", "show", "job", job_id, check=True).stdout
        return int(re.search(r"\bRestarts=(\d+)", out).group(1))

    def state(self, job_id: str) -> str:
        out = self.run("squeue", "-h", "-j", job_id, "-o", "%T").stdout.strip()
        if out:
            return out
        rows = self.sacct(job_id)
        return rows[-1]["State"] if rows else "UNKNOWN"

    def wait_state(self, job_id: str, states: set[str], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        st = ""
        while time.monotonic() < deadline:
            st = self.state(job_id).split()[0]
            if st in states:
                return st
            time.sleep(1)
        raise AssertionError(f"job {job_id} still {st} after {timeout}s, wanted one of {states}")

    def wait_done(self, job_id: str, timeout: float) -> str:
        return self.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                        "OUT_OF_MEMORY"}, timeout)

    def preempt_all(self, timeout: float = 180) -> None:
        """Preempt whatever runs in the low partition: a short high-priority job on every node
        (on fewer, a job that leaves enough nodes idle would not be preempted)."""
        nodes = self.run("sinfo", "-h", "-p", "high", "-o", "%D", check=True).stdout.split()[0]
        high = self.run("sbatch", "--parsable", "-p", "high", f"-N{nodes}", "--exclusive", "-o", "/dev/null",
                        "--wrap", "sleep 2", check=True).stdout.strip()
        self.wait_done(high, timeout)

    def idle(self, timeout: float = 60) -> None:
        """Wait until no job is in the queue (tests must not see each other's jobs)."""
        deadline = time.monotonic() + timeout
        while self.run("squeue", "-h").stdout.strip():
            if time.monotonic() > deadline:
                self.run("scancel", "--user=root")
                raise AssertionError("the cluster did not drain")
            time.sleep(0.5)


def export(c: Cluster, run_dir: Path, out: Path, step: int | None = None) -> dict:
    import torch
    args = ["ckpt", "export", str(run_dir), str(out)] + (["--step", str(step)] if step is not None else [])
    r = c.cli(*args)
    assert r.returncode == 0, r.stderr
    return torch.load(out, weights_only=True)


def assert_bitwise(a: dict, b: dict) -> None:
    import torch
    assert a.keys() == b.keys()
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, f"tensors differ: {diff}"


def metric_lines(run_dir: Path) -> list[str]:
    """The lines of ``metrics.jsonl`` that are whole: rank 0 flushes the file on a clock and a
    full buffer goes out whole, so a file read while its run trains (or after a kill) may end
    inside a line. Every line before the last newline must parse."""
    text = (Path(run_dir) / "metrics.jsonl").read_text()
    return text[:text.rfind("\n") + 1].splitlines()


def losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in metric_lines(run_dir):
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def last_step(run_dir: Path) -> int:
    """The last step a run logged a loss for (0 before its first)."""
    try:
        return max(losses(run_dir), default=0)
    except FileNotFoundError:
        return 0


def wait_steps(run_dir: Path, at_least: int, timeout: float) -> None:
    """Until the run has logged step ``at_least``; fails past ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while last_step(run_dir) < at_least:
        assert time.monotonic() < deadline, f"no progress past step {last_step(run_dir)} in {run_dir}"
        time.sleep(0.5)


def damage_shared_tier(run_dir: Path) -> list[Path]:
    """Flip a bit in every file of every complete shared checkpoint but its commit record: a
    restore that read any of them would fail its checksums and say so."""
    flipped = []
    for step_dir in (run_dir / "checkpoints").glob("step-*"):
        if (step_dir / "commit.json").exists():
            for f in step_dir.iterdir():
                if f.is_file() and f.name != "commit.json" and f.stat().st_size:
                    raw = bytearray(f.read_bytes())
                    raw[len(raw) // 2] ^= 0x10
                    f.write_bytes(bytes(raw))
                    flipped.append(f)
    return flipped


def q(s) -> str:
    return shlex.quote(str(s))
