"""Preemption costs, measured side by side in one run.

1. A requeue cycle, phase by phase, for a state of >= 100 MB (an MLP with a wide hidden layer,
   Adam) on 2 nodes of the local Slurm cluster, preempted for real by a `high` job (twice):
   signal -> checkpoint committed -> every rank exited -> requeue issued; then Slurm's share
   (requeue, pending, scheduling), then job start -> process start -> hpc_train's worker ->
   torch imported -> process group ready -> model and data built -> checkpoint loaded -> first
   step done. hpc_train's own share (target <= 5 s): signal -> every rank exited, plus process
   start -> first step. The timestamps are the run's own (``stopped.json``, ``requeue.json``,
   the goodput ledger's per-run milestones), so nothing in the loop is there for the benchmark.
2. Training throughput with the per-step stop agreement against without it (local, 2 gloo
   ranks, interleaved runs, medians; target ratio >= 0.99).
3. Goodput of a job preempted every M seconds of running (60 and 120 s), from its goodput
   ledger, and projected for one preemption every 10 minutes and every 4 hours from the
   measured parts: per run start-up s, exit x and time between runs b, and the share f of
   training time blocked by checkpoint saves:
   goodput(M) = (M - s) * (1 - f) / (M + x + b).

A repetition that fails (a run, a restart cycle, a goodput period) is reported and the rest go on
(after a failed restart cycle its job's state is unknown, so the later cycles are not run); every
figure says how many repetitions it rests on, and the exit status is 1 if any failed.

Usage: .venv/bin/python benchmarks/preemption.py [--quick] [--only agreement --reps N --steps N]
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
from reps import Reps, ratio, run_checked  # noqa: E402
from submit_latency import PY, local_cluster  # noqa: E402

DIGITS = str(ROOT / "jobs" / "digits.yaml")
QUIET = ["--set", "log.tensorboard=false", "--set", "train.eval=false", "--set", "log.progress=lines"]


def sets(**kv) -> list[str]:
    out = []
    for k, v in kv.items():
        out += ["--set", f"{k.replace('__', '.')}={v}"]
    return out


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


def wait_steps(run_dir: Path, target: int, timeout: float = 600, poll: float = 0.2) -> int:
    """Wait until the run has trained ``target`` steps (its metrics say so); returns ``target``."""
    deadline = time.monotonic() + timeout
    while steps_done(run_dir) < target:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{run_dir}: step {target} not reached within {timeout:.0f} s")
        time.sleep(poll)
    return target


def preempt(env) -> None:
    """A real preemption: a `high` job that needs every node."""
    job = subprocess.run(["sbatch", "--parsable", "-p", "high", "-N2", "--exclusive", "-o", "/dev/null",
                          "--wrap", "sleep 1"], env=env, capture_output=True, text=True, check=True).stdout.strip()
    while squeue_state(env, job) != "GONE":
        time.sleep(0.2)


def submit(env, run_dir: Path, *flags: str) -> str:
    r = run_checked([PY, "-m", "hpc_train", "submit", DIGITS, "--nodes", "2", "--run-dir", str(run_dir), *QUIET,
                     *flags], "hpc_train submit", env=env, capture_output=True, timeout=900, cwd=ROOT)
    return re.search(r"submitted job (\d+)", r.stdout).group(1)


def wait_gone(env, job: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while squeue_state(env, job) != "GONE":
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job} did not finish")
        time.sleep(0.5)


def _json(path: Path, want=lambda rec: True, timeout: float = 300) -> dict:
    """The JSON file at ``path`` once it exists and ``want(rec)`` holds (the run writes it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            rec = json.loads(path.read_text())
            if want(rec):
                return rec
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path}: not written as expected within {timeout:.0f} s")
        time.sleep(0.2)


def restart_phases(stopped: dict, requeued_at: float, before: dict, after: dict) -> list[tuple[str, float, str]]:
    """(phase, seconds, whose) for one requeue cycle, from the run's own timestamps."""
    t0 = stopped["stop_received_at"]
    m = after["marks"]
    rows = [("signal -> checkpoint committed (every rank stopped at one step)",
             stopped["checkpoint_committed_at"] - t0, "hpc_train"),
            ("  -> requeue requested, every rank exited", before["exited"] - stopped["checkpoint_committed_at"],
             "hpc_train"),
            ("  -> scontrol requeue issued (batch shell's hook)", requeued_at - before["exited"], "hpc_train"),
            ("requeue -> rank 0's process start (Slurm: requeue, pending, schedule, batch script, srun)",
             m["process"] - requeued_at, "Slurm"),
            ("  -> hpc_train worker entered (interpreter, submitit's unpickling)", m["worker"] - m["process"],
             "hpc_train"),
            ("  -> torch imported", m["torch"] - m["worker"], "hpc_train"),
            ("  -> process group ready (rendezvous over 2 nodes)", m["group"] - m["torch"], "hpc_train"),
            ("  -> model and data built", m["restore"] - m["group"], "hpc_train"),
            ("  -> checkpoint loaded (chosen, verified, read)", m["loaded"] - m["restore"], "hpc_train"),
            ("  -> first step done", after["first_step"] - m["loaded"], "hpc_train")]
    return rows


def bench_restart(env, tmp: Path, preemptions: int, reps: Reps) -> None:
    run_dir = tmp / "big"
    # 784 x 11000 + 11000 x 10 weights, Adam: ~8.7 M parameters, ~105 MB of state.
    job = submit(env, run_dir, *sets(model__name="mlp", model__hidden=11000, train__max_steps=100000,
                                     train__log_every=10))
    cycles = []

    def cycle(i: int) -> list[tuple[str, float, str]]:
        _json(run_dir / "goodput.json", lambda r: len(r["segments"]) == i + 1
              and r["segments"][-1].get("first_step"), timeout=600)
        target = wait_steps(run_dir, steps_done(run_dir) + 20)
        preempt(env)
        stopped = _json(run_dir / "stopped.json", lambda r, n=target: r["steps"] >= n)
        requeued = _json(run_dir / "requeue.json", lambda r: len(r.get("requeued_at", [])) == i + 1)
        ledger = _json(run_dir / "goodput.json", lambda r: len(r["segments"]) == i + 2
                       and r["segments"][-1].get("first_step"), timeout=600)
        return restart_phases(stopped, requeued["requeued_at"][i], ledger["segments"][i], ledger["segments"][i + 1])
    try:
        for i in range(preemptions):
            got = reps.run("restart cycle", i + 1, lambda: cycle(i))
            if got is None:     # the cycles follow one job: after a failed one its state is unknown
                print(f"   restart cycles {i + 2}-{preemptions} not run (cycle {i + 1} failed)")
                break
            cycles.append(got)
    finally:
        subprocess.run(["scancel", job], env=env)
        wait_gone(env, job)
    if not cycles:
        print(f"\n1. a requeue cycle: {reps.basis('restart cycle')}")
        return
    size = max((sum(p.stat().st_size for p in d.iterdir()) for d in (run_dir / "checkpoints").glob("step-*")),
               default=0)
    print(f"\n1. a requeue cycle, {size / 1e6:.0f} MB checkpoint, 2 nodes, real preemption by a `high` job "
          f"({len(cycles)} cycles of {preemptions}; seconds):")
    print(f"   {'phase':80s}" + "".join(f"{'#' + str(i + 1):>8s}" for i in range(len(cycles))) + "   whose")
    for j, (name, _, whose) in enumerate(cycles[0]):
        print(f"   {name:80s}" + "".join(f"{c[j][1]:8.2f}" for c in cycles) + f"   {whose}")
    own = [sum(v for _, v, w in c if w == "hpc_train") for c in cycles]
    total = [sum(v for _, v, _ in c) for c in cycles]
    print(f"   {'hpc_train own share (target <= 5 s)':80s}" + "".join(f"{v:8.2f}" for v in own))
    print(f"   {'signal -> first step of the next run, in all':80s}" + "".join(f"{v:8.2f}" for v in total))


def _sps(run_dir: Path, skip: int) -> float:
    """Samples/s from the median step interval: robust to the hiccups of a shared 2-core box,
    which swing whole-run rates by +-20%."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    t = [r["time"] for r in recs if "loss" in r and r["step"] > skip]
    return 64 / statistics.median(b - a for a, b in zip(t, t[1:]))


def bench_agreement(tmp: Path, n: int, steps: int, reps: Reps) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    flags = [*QUIET, *sets(data__name="synthetic", data__batch_size=32, train__max_steps=steps,
                           train__log_every=1, checkpoint__enabled="false")]

    def one(label: str, i: int) -> float:
        run_dir = tmp / f"agree-{label}-{i}"
        off_flags = ["--set", "train.fn=benchmarks.no_agreement:train"] if label == "off" else []
        run_checked([PY, "-m", "hpc_train", "run", DIGITS, "--nproc", "2", "--run-dir", str(run_dir),
                     *flags, *off_flags], f"hpc_train run (agreement {label})", env=env, capture_output=True,
                    cwd=ROOT)
        return _sps(run_dir, skip=20)
    for i in range(1, n + 1):
        for label in ("on", "off"):
            reps.run(f"agreement {label}", i, lambda: one(label, i))
    on, off = reps.values("agreement on"), reps.values("agreement off")
    print(f"\n2. stop agreement cost (local, 2 gloo ranks, ConvNet, batch 32/rank, {steps} steps, {n} repetitions):")
    print(f"   with the per-step agreement    {reps.figure('agreement on', fmt='{:8.0f}', unit=' samples/s')}")
    print(f"   without it                     {reps.figure('agreement off', fmt='{:8.0f}', unit=' samples/s')}")
    print(f"   ratio                          {ratio(reps.median('agreement on'), reps.median('agreement off'), '{:8.3f}')}"
          f"   (target >= 0.99)")
    print(f"   all runs: on {[round(x) for x in on]}, off {[round(x) for x in off]}")


def bench_goodput(env, tmp: Path, periods: list[float], steps: int, reps: Reps) -> None:
    print(f"\n3. goodput, {steps} steps of the digits ConvNet on 2 nodes (a checkpoint every 30 s), "
          f"preempted every M s of running:")
    print(f"   {'M':>6}  {'preemptions':>11}  {'wall s':>7}  {'ledger wall':>11}  {'goodput':>7}  "
          f"{'projected':>9}  parts")
    from hpc_train import goodput
    fits = []

    def one(m: float) -> None:
        run_dir = tmp / f"goodput-{m:.0f}"
        t0 = time.time()
        job = submit(env, run_dir, *sets(train__max_steps=steps, train__log_every=100, checkpoint__every_seconds=30))
        n = 0
        running_since = None
        try:
            while (st := squeue_state(env, job)) != "GONE":
                if st == "RUNNING":
                    running_since = running_since or time.monotonic()
                    if time.monotonic() - running_since >= m:
                        preempt(env)
                        n += 1
                        running_since = None
                else:
                    running_since = None
                time.sleep(0.2)
        except BaseException:       # no job of a failed period left to run into the next one
            subprocess.run(["scancel", job], env=env)
            raise
        wall = time.time() - t0
        b = goodput.breakdown(run_dir)
        parts = b["parts"]
        runs = b["runs"]
        # Per run: start-up with the load, exit after the signal, the gap to the next run; and
        # the share of training time blocked by saves. The last run ends by finishing.
        seg = json.loads((run_dir / goodput.FILE).read_text())["segments"]
        load = sum(float(s.get("load_s") or 0) for s in seg)
        block = sum(float(s.get("save_block_s") or 0) for s in seg)
        fit = {"s": (parts["start-up"] + load) / runs, "x": parts["exit"] / runs,
               "b": parts["between runs"] / (runs - 1) if runs > 1 else 0.0,
               "f": block / max(1e-9, parts["training"] + block)}
        fits.append(fit)
        proj = projected(m, fit)
        print(f"   {m:6.0f}  {n:>11}  {wall:7.1f}  {b['wall_s']:11.1f}  {parts['training'] / b['wall_s']:7.3f}  "
              f"{proj:9.3f}  " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items() if v))
    for m in periods:
        reps.run(f"goodput M={m:.0f}", 1, lambda: one(m))
    if not fits:
        print("   no period succeeded: nothing to project from")
        return
    avg = {k: statistics.mean(f[k] for f in fits) for k in fits[0]}
    if len(fits) < len(periods):
        print(f"   (projections from {len(fits)} of {len(periods)} periods; the others failed)")
    print(f"   measured per run: start-up + load s = {avg['s']:.1f} s, exit after the signal x = {avg['x']:.1f} s, "
          f"between runs b = {avg['b']:.1f} s; checkpoint share of training f = {avg['f']:.4f}")
    for m, label in ((600.0, "10 minutes"), (4 * 3600.0, "4 hours")):
        print(f"   projected goodput, a preemption every {label:10s}: {projected(m, avg):.3f}")


def projected(m: float, fit: dict[str, float]) -> float:
    return max(0.0, m - fit["s"]) * (1 - fit["f"]) / (m + fit["x"] + fit["b"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["restart", "goodput", "agreement"], help="one section (default: all three)")
    ap.add_argument("--cycles", type=int, default=None, help="preemptions in the restart section (default 2; quick 1)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions in the agreement section (default 7; quick 3)")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per run in the agreement section (default 250; quick 120; at least 23)")
    args = ap.parse_args()
    if args.steps is not None and args.steps < 23:
        ap.error("--steps: at least 23 (the rate skips the first 20 steps)")
    want = {args.only} if args.only else {"restart", "goodput", "agreement"}
    reps = Reps()
    with tempfile.TemporaryDirectory(prefix="hpc_train-bench-") as d:
        tmp = Path(d)
        if want & {"restart", "goodput"}:
            with local_cluster() as env:
                if "restart" in want:
                    # A failure outside the cycles (the submission) is this section's one failed repetition.
                    reps.run("restart section", 1, lambda: bench_restart(
                        env, tmp, preemptions=args.cycles or (1 if args.quick else 2), reps=reps))
                if "goodput" in want:
                    bench_goodput(env, tmp, [30.0] if args.quick else [60.0, 120.0],
                                  steps=1500 if args.quick else 6000, reps=reps)
        if "agreement" in want:
            bench_agreement(tmp, n=args.reps or (3 if args.quick else 7),
                            steps=args.steps or (120 if args.quick else 250), reps=reps)
    return reps.finish()


if __name__ == "__main__":
    sys.exit(main())
