"""Preemption costs, measured side by side in one run.

1. signal -> checkpoint committed -> requeue issued, for a state of >= 100 MB (an MLP with a
   wide hidden layer, Adam), on the local Slurm cluster with a real preemption by a `high` job,
   next to the signal lead (90 s by default).
2. Training throughput with the per-step stop agreement against without it (local, 2 gloo
   ranks, interleaved runs, medians; target ratio >= 0.99).
3. Goodput for a job preempted every M seconds: the fraction of wall time (submit -> done) spent
   in steps that count, for a few values of M.

Usage: .venv/bin/python benchmarks/preemption.py [--quick]
The cluster is started (and stopped) here if it is not up; that needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from submit_latency import PY, local_cluster  # noqa: E402

DIGITS = str(ROOT / "jobs" / "digits.yaml")
QUIET = ["--set", "log.tensorboard=false", "--set", "train.eval=false", "--set", "log.progress=lines"]


def sets(**kv) -> list[str]:
    out = []
    for k, v in kv.items():
        out += ["--set", f"{k.replace('__', '.')}={v}"]
    return out


def cli(env, *args, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "hpc_train", *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def squeue_state(env, job: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True).stdout
    return out.strip() or "GONE"


def steps_done(run_dir: Path) -> int:
    m = run_dir / "metrics.jsonl"
    if not m.exists():
        return 0
    last = 0
    for line in m.read_text().splitlines():
        try:
            last = max(last, json.loads(line).get("step", 0))
        except json.JSONDecodeError:
            pass
    return last


def preempt(env) -> None:
    """A real preemption: a `high` job that needs every node."""
    job = subprocess.run(["sbatch", "--parsable", "-p", "high", "-N2", "--exclusive", "-o", "/dev/null",
                          "--wrap", "sleep 1"], env=env, capture_output=True, text=True, check=True).stdout.strip()
    while squeue_state(env, job) != "GONE":
        time.sleep(0.2)


def submit(env, run_dir: Path, *flags: str) -> str:
    r = cli(env, "submit", DIGITS, "--nodes", "2", "--run-dir", run_dir, *QUIET, *flags)
    if r.returncode != 0:
        raise RuntimeError(r.stderr)
    return re.search(r"submitted job (\d+)", r.stdout).group(1)


def wait_gone(env, job: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while squeue_state(env, job) != "GONE":
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job} did not finish")
        time.sleep(0.5)


def bench_stop_timeline(env, tmp: Path) -> None:
    run_dir = tmp / "big"
    # 784 x 11000 + 11000 x 10 weights, Adam: ~8.7 M parameters, ~105 MB of state.
    job = submit(env, run_dir, *sets(model__name="mlp", model__hidden=11000, train__max_steps=100000,
                                     train__log_every=10))
    while steps_done(run_dir) < 30:
        time.sleep(0.5)
    preempt(env)
    stopped = json.loads((run_dir / "stopped.json").read_text())
    rec = json.loads((run_dir / "requeue.json").read_text())
    size = sum(p.stat().st_size for p in (run_dir / "checkpoints").glob(f"step-{stopped['steps']}/*"))
    t0 = stopped["stop_received_at"]
    print(f"\n1. stop timeline, {size / 1e6:.0f} MB checkpoint, 2 nodes (real preemption by a `high` job):")
    print(f"   signal -> every rank stopped, checkpoint committed  {stopped['checkpoint_committed_at'] - t0:6.2f} s")
    print(f"   signal -> requeue requested (rank 0)                {stopped['requeue_requested_at'] - t0:6.2f} s")
    print(f"   signal -> scontrol requeue issued (batch shell)     {rec['requeued_at'][0] - t0:6.2f} s")
    print("   signal lead (default --signal=USR2@90)               90.00 s")
    subprocess.run(["scancel", job], env=env)
    wait_gone(env, job)


def _sps(run_dir: Path, skip: int) -> float:
    """Samples/s from the median step interval: robust to the hiccups of a shared 2-core box,
    which swing whole-run rates by +-20%."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    t = [r["time"] for r in recs if "loss" in r and r["step"] > skip]
    return 64 / statistics.median(b - a for a, b in zip(t, t[1:]))


def bench_agreement(tmp: Path, reps: int, steps: int) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    on, off = [], []
    flags = [*QUIET, *sets(data__name="synthetic", data__batch_size=32, train__max_steps=steps,
                           train__log_every=1, checkpoint__enabled="false")]
    for i in range(reps):
        for label, store in (("on", on), ("off", off)):
            run_dir = tmp / f"agree-{label}-{i}"
            off_flags = ["--set", "train.fn=benchmarks.no_agreement:train"] if label == "off" else []
            r = subprocess.run([PY, "-m", "hpc_train", "run", DIGITS, "--nproc", "2", "--run-dir", str(run_dir),
                                *flags, *off_flags], env=env, capture_output=True, text=True, cwd=ROOT)
            if r.returncode != 0:
                raise RuntimeError(r.stderr)
            store.append(_sps(run_dir, skip=20))
    mon, moff = statistics.median(on), statistics.median(off)
    print(f"\n2. stop agreement cost (local, 2 gloo ranks, ConvNet, batch 32/rank, {steps} steps, median of {reps}):")
    print(f"   with the per-step agreement    {mon:8.0f} samples/s")
    print(f"   without it                     {moff:8.0f} samples/s")
    print(f"   ratio                          {mon / moff:8.3f}   (target >= 0.99)")
    print(f"   all runs: on {[round(x) for x in on]}, off {[round(x) for x in off]}")


def bench_goodput(env, tmp: Path, periods: list[float | None], steps: int) -> None:
    print(f"\n3. goodput, {steps} steps of the ConvNet on 2 nodes, preempted every M seconds of running:")
    print(f"   {'M':>6}  {'preemptions':>11}  {'wall s':>7}  {'step s':>7}  goodput")
    for m in periods:
        run_dir = tmp / f"goodput-{m}"
        t0 = time.time()
        job = submit(env, run_dir, *sets(train__max_steps=steps, train__log_every=50))
        n = 0
        running_since = None
        while squeue_state(env, job) != "GONE":
            st = squeue_state(env, job)
            if st == "RUNNING":
                running_since = running_since or time.monotonic()
                if m is not None and time.monotonic() - running_since >= m:
                    preempt(env)
                    n += 1
                    running_since = None
            else:
                running_since = None
            time.sleep(0.2)
        wall = time.time() - t0
        result = json.loads((run_dir / "result.json").read_text())
        step_s = result["progress"]["train_time_s"]
        print(f"   {('none' if m is None else f'{m:.0f}'):>6}  {n:>11}  {wall:7.1f}  {step_s:7.1f}  {step_s / wall:7.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hpc_train-bench-") as d:
        tmp = Path(d)
        bench_agreement(tmp, reps=3 if args.quick else 7, steps=120 if args.quick else 250)
        with local_cluster() as env:
            bench_stop_timeline(env, tmp)
            bench_goodput(env, tmp, [None, 40.0, 20.0] if not args.quick else [None, 30.0],
                          steps=1500 if args.quick else 3000)
    return 0


if __name__ == "__main__":
    sys.exit(main())
