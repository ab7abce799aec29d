"""Submission latency on the local Slurm cluster, and CLI start-up, measured side by side.

1. From `python -m hpc_train submit` (the command's start) to the first training step, against a
   raw `sbatch` of an equivalent hand-written script (srun + a plain DDP loop of the same model
   and data) from `sbatch`'s start to its first step. Runs are interleaved; medians and the
   ratio are printed (target <= 1.3).
2. Wall time of `python -m hpc_train --help` and `status RUN_DIR` against bare `python -c pass`.

A repetition that fails is reported and left out (the rest go on); every figure says how many
repetitions it rests on, and the exit status is 1 if any failed (benchmarks/reps.py).

Needs the cluster: `sudo slurm/devcluster.sh up` (started and stopped here if it is not up).
Usage: .venv/bin/python benchmarks/submit_latency.py [--reps N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVCLUSTER = ROOT / "slurm" / "devcluster.sh"
PY = sys.executable
sys.path.insert(0, str(Path(__file__).resolve().parent))
from reps import Reps, ratio, run_checked  # noqa: E402

# The hand-written baseline: what a user would write after the PyTorch DDP tutorial.
RAW_WORKER = textwrap.dedent("""
    import os, sys, time, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from hpc_train.trainer.models import ConvNet
    from sklearn.datasets import load_digits
    import hostlist
    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    os.environ["MASTER_ADDR"] = hostlist.expand_hostlist(os.environ["SLURM_JOB_NODELIST"])[0]
    os.environ["MASTER_PORT"] = str(20000 + int(os.environ["SLURM_JOB_ID"]) % 40000)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    d = load_digits()
    x = torch.nn.functional.interpolate(torch.tensor(d.images, dtype=torch.float32).unsqueeze(1), size=(28, 28))
    y = torch.tensor(d.target)
    model = DDP(ConvNet())
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    loss = torch.nn.functional.cross_entropy(model(x[rank::world][:32]), y[rank::world][:32])
    loss.backward(); opt.step()
    if rank == 0:
        open(sys.argv[1], "w").write(str(time.time()))
    dist.barrier(); dist.destroy_process_group()
""")


def cluster_env() -> dict[str, str]:
    env = dict(os.environ)
    out = subprocess.run([str(DEVCLUSTER), "env"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        line = line.strip().rstrip(";")
        if line.startswith("export "):
            k, _, v = line[7:].partition("=")
            env[k] = subprocess.run(["bash", "-c", f"printf %s {v}"], capture_output=True, text=True, env=env).stdout
    return env


@contextlib.contextmanager
def local_cluster():
    """The local cluster's client environment; started (and stopped after) if it is not up."""
    started = subprocess.run([str(DEVCLUSTER), "status"], capture_output=True).returncode != 0
    if started:
        subprocess.run([str(DEVCLUSTER), "up", "--nodes", "2"], check=True, capture_output=True)
    try:
        env = cluster_env()
        env["PYTHONPATH"] = str(ROOT)
        # The jobs import hpc_train from ROOT (a worktree of another commit, too): with its
        # bytecode written, as an install has it, or each process compiles it again where
        # PYTHONDONTWRITEBYTECODE is set, and a larger code base starts slower for that alone.
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "hpc_train")], check=True)
        yield env
    finally:
        if started:
            subprocess.run([str(DEVCLUSTER), "down"], capture_output=True)


def wait_file(path: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} never appeared")
        time.sleep(0.05)


def first_step_time(run_dir: Path, timeout: float = 300) -> float:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while True:
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                rec = json.loads(line)
                if rec.get("step") == 1 and "loss" in rec:
                    return rec["time"]
        if time.monotonic() > deadline:
            raise RuntimeError(f"no first step in {run_dir}")
        time.sleep(0.05)


def drain(env) -> None:
    while subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True).stdout.strip():
        time.sleep(0.2)


def one_hpc_train(env, tmp: Path, i: int) -> float:
    run_dir = tmp / f"hpc{i}"
    t0 = time.time()
    try:
        run_checked([PY, "-m", "hpc_train", "submit", str(ROOT / "jobs/digits.yaml"), "--nodes", "2",
                     "--run-dir", str(run_dir), "--set", "train.max_steps=1", "--set", "train.log_every=1",
                     "--set", "log.tensorboard=false", "--set", "train.eval=false", "--set",
                     "checkpoint.enabled=false"], "hpc_train submit", env=env, capture_output=True)
        return first_step_time(run_dir) - t0
    finally:
        drain(env)          # a failed repetition leaves no job behind for the next one


def one_raw(env, tmp: Path, i: int) -> float:
    worker = tmp / "raw_worker.py"
    worker.write_text(RAW_WORKER)
    stamp = tmp / f"raw{i}.first_step"
    script = tmp / f"raw{i}.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --output={tmp}/raw{i}.out\n"
                      f"srun {shlex.quote(PY)} {shlex.quote(str(worker))} {shlex.quote(str(stamp))}\n")
    t0 = time.time()
    try:
        run_checked(["sbatch", str(script)], "sbatch", env=env, capture_output=True, cwd=tmp)
        wait_file(stamp)
        return float(stamp.read_text()) - t0
    finally:
        drain(env)


def wall(name: str, cmd: list[str], env, reps: int, record: Reps) -> float | None:
    """The median wall time of ``cmd`` over the repetitions that exited 0 (each failure recorded)."""
    def one() -> float:
        t0 = time.perf_counter()
        run_checked(cmd, name, env=env, capture_output=True)
        return time.perf_counter() - t0
    for rep in range(1, reps + 1):
        record.run(name, rep, one)
    return record.median(name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    reps = Reps()
    with local_cluster() as env:
        with tempfile.TemporaryDirectory(prefix="hpc_train-bench-") as d:
            tmp = Path(d)
            reps.run("warm-up (raw sbatch)", 0, lambda: one_raw(env, tmp, 99))   # warm the page cache for both sides
            for i in range(1, args.reps + 1):      # interleaved: A, B, A, B, ...
                h = reps.run("hpc_train submit", i, lambda: one_hpc_train(env, tmp, i))
                r = reps.run("raw sbatch", i, lambda: one_raw(env, tmp, i))
                print(f"  rep {i}: hpc_train submit {'FAILED' if h is None else f'{h:.2f}s'}, "
                      f"raw sbatch {'FAILED' if r is None else f'{r:.2f}s'}", flush=True)
            mh, mr = reps.median("hpc_train submit"), reps.median("raw sbatch")
            print("\nsubmit -> first training step (2 nodes x 1 task, gloo):")
            print(f"  hpc_train submit (submitit)   {reps.figure('hpc_train submit', fmt='{:6.2f}', unit=' s')}")
            print(f"  raw sbatch, hand-written DDP  {reps.figure('raw sbatch', fmt='{:6.2f}', unit=' s')}")
            print(f"  ratio hpc_train / raw         {ratio(mh, mr, '{:6.2f}')}   (target <= 1.3)")
            n = 7
            status_dir = tmp / "hpc1"
            names = ("python -c pass", "python -m hpc_train --help", "python -m hpc_train status DIR")
            base = wall(names[0], [PY, "-c", "pass"], env, n, reps)
            helpt = wall(names[1], [PY, "-m", "hpc_train", "--help"], env, n, reps)
            statt = wall(names[2], [PY, "-m", "hpc_train", "status", str(status_dir)], env, n, reps)
            print("\nCLI wall time:")
            for name, t, note in zip(names, (base, helpt, statt), ("", "", ", includes squeue+sacct")):
                shown = f"{t * 1000:7.0f} ms" if t is not None else f"{'-':>7s}   "
                rel = f"{ratio(t, base, '{:.1f}')}x, " if name != names[0] else ""
                print(f"  {name:30s}  {shown}   ({rel}{reps.basis(name)}{note})")
    return reps.finish()


if __name__ == "__main__":
    sys.exit(main())
