"""What the `Run` API costs a user's own loop: jobs/charlm.py through hpc_train against the same
loop hand-written with plain DDP, in one run.

    .venv/bin/python benchmarks/own_loop.py [--reps 5] [--steps 400] [--warmup 50]

* **hand-written**: the example's model, data and optimizer in the loop the PyTorch DDP
  tutorials teach (``torch.multiprocessing.spawn``, ``init_process_group``, ``DistributedSampler``,
  ``DataLoader``, ``DDP``), with ``loss.item()`` every step as the example logs it; one torch
  thread per rank, as hpc_train sets.
* **Run**: ``python -m hpc_train run --script jobs/charlm.py --nproc 2`` unchanged: ``run.wrap``
  (DDP with the stop agreement riding on its all-reduce), ``run.loader``, ``run.log`` every step
  (metrics.jsonl; TensorBoard off, as the hand-written loop has none), ``run.step_end`` every step,
  and an async DCP checkpoint every 100 steps.
* **Run, checkpoints off**: the same without saves, which tells the saves' share of the gap.

Both sides stamp rank 0's wall clock once per step; the rate is global samples over the steps
after ``warmup`` (steady state), and the median step (robust to neighbours). Variants run
interleaved; medians of the repetitions are compared. It also prints what one ``step_end`` costs
without a watched DDP module (one small all-reduce of two floats, 2 gloo ranks).

A repetition that fails (the baseline's processes included: one died of SIGABRT once) is reported
(variant, repetition, exit code or signal, the last lines of its stderr) and the rest go on; every
figure says how many repetitions it rests on, and the exit status is 1 if any failed
(benchmarks/reps.py).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from reps import Reps, ratio, run_checked  # noqa: E402
BATCH, WORLD, SEED = 32, 2, 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hand_worker(rank: int, world: int, port: int, steps: int, out: str) -> None:
    import math

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    sys.path.insert(0, str(ROOT / "jobs"))
    from charlm import TEXT, CharMLP, CharWindows

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(SEED)
    data = CharWindows(TEXT.read_text(), 16)
    model = DDP(CharMLP(len(data.chars), 16))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min((s + 1) / warmup, 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / steps)))))
    sampler = DistributedSampler(data, shuffle=True, seed=SEED, drop_last=True)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True)
    loss_fn = nn.CrossEntropyLoss()
    stamps, step, epoch = [], 0, 0
    while step < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = loss_fn(model(x), y)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
            step += 1
            loss.item()
            stamps.append(time.time())
            if step >= steps:
                break
        epoch += 1
    if rank == 0:
        Path(out).write_text(json.dumps({"stamps": stamps}))
    dist.barrier()
    dist.destroy_process_group()


def run_hand(steps: int, work: Path) -> list[float]:
    out = work / "hand.json"
    code = ("import sys, torch.multiprocessing as mp; sys.path.insert(0, sys.argv[1]); import own_loop; "
            "mp.spawn(own_loop._hand_worker, args=(2, int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]), nprocs=2)")
    run_checked([sys.executable, "-c", code, str(Path(__file__).parent), str(_free_port()), str(steps), str(out)],
                "hand-written loop", cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["stamps"]


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "RANK", "WORLD_SIZE"))}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    return env


def run_api(steps: int, work: Path, tag: str, every: int | None = 100) -> list[float]:
    rd = work / f"run-{tag}"
    ckpt = f"checkpoint.every_steps={every}" if every else "checkpoint.enabled=false"
    run_checked([sys.executable, "-m", "hpc_train", "run", "--script", str(ROOT / "jobs" / "charlm.py"),
                 "--nproc", str(WORLD), "--run-dir", str(rd), "--set", f"seed={SEED}",
                 "--set", f"data.batch_size={BATCH}", "--set", "log.tensorboard=false",
                 "--set", ckpt, "--set", "checkpoint.every_seconds=0", "--", "--steps", str(steps)],
                "hpc_train run", cwd=ROOT, env=_clean_env(), capture_output=True)
    recs = [json.loads(x) for x in (rd / "metrics.jsonl").read_text().splitlines()]
    by_step = {rec["step"]: rec["time"] for rec in recs if "loss" in rec}
    if sorted(by_step) != list(range(1, steps + 1)):
        raise RuntimeError("metrics.jsonl misses steps")
    return [by_step[s] for s in range(1, steps + 1)]


def step_end_cost() -> dict:
    """``--fn`` target: the median cost of one ``step_end`` with no watched DDP module."""
    import torch

    import hpc_train
    run = hpc_train.init()
    state = {"model": torch.nn.Linear(4, 4), "step": 0}
    times = []
    for _ in range(600):
        state["step"] += 1
        t0 = time.perf_counter()
        run.step_end(state)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times[100:])
    if run.is_main:
        (run.run_dir / "step_end.json").write_text(json.dumps({"median_s": med}))
    return run.finish({"median_s": med})


def measure_step_end(work: Path) -> float:
    rd = work / "step-end"
    run_checked([sys.executable, "-m", "hpc_train", "run", "--fn", "benchmarks.own_loop:step_end_cost",
                 "--nproc", str(WORLD), "--run-dir", str(rd), "--set", "checkpoint.enabled=false",
                 "--set", "log.tensorboard=false"], "step_end run", cwd=ROOT, env=_clean_env(), capture_output=True)
    return json.loads((rd / "step_end.json").read_text())["median_s"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=50)
    args = ap.parse_args(argv)
    if not 1 <= args.warmup < args.steps - 1:
        ap.error("need 1 <= warmup < steps - 1")
    variants = {"hand": "hand-written DDP loop", "run": "Run API (jobs/charlm.py), async ckpt every 100",
                "run_off": "Run API, checkpoints off (what the saves cost)"}
    reps = Reps()
    w = args.warmup
    print(f"char-level MLP (jobs/charlm.py), batch {BATCH}/rank x {WORLD} ranks (gloo, 1 thread/rank), "
          f"{args.steps} steps, rate over steps {w + 1}-{args.steps}; {args.reps} interleaved reps",
          flush=True)
    t0 = time.time()

    def one(key: str, rep: int, work: Path) -> tuple[float, float]:
        """(steady-state samples/s, samples/s of the median step) of one run."""
        stamps = (run_hand(args.steps, work) if key == "hand" else
                  run_api(args.steps, work, f"{rep}") if key == "run" else
                  run_api(args.steps, work, f"{rep}-off", every=None))
        return ((len(stamps) - w) * BATCH * WORLD / (stamps[-1] - stamps[w - 1]),
                BATCH * WORLD / statistics.median(b - a for a, b in zip(stamps[w - 1:], stamps[w:])))

    with tempfile.TemporaryDirectory(prefix="hpc_train-bench-") as tmp:
        work = Path(tmp)
        for rep in range(1, args.reps + 1):
            for key in variants:
                got = reps.run(key, rep, lambda: one(key, rep, work))
                if got:
                    print(f"  rep {rep}: {variants[key]:48s} {got[0]:8.0f} samples/s "
                          f"(median step: {got[1]:.0f})", flush=True)
        cost = reps.run("step_end", 1, lambda: measure_step_end(work))
    for title, i in (("steady-state samples/s", 0), ("samples/s of the median step", 1)):
        med = {k: reps.median(k, lambda v: v[i]) for k in variants}
        print(f"\n{title}: hand-written {reps.figure('hand', lambda v: v[i], '{:.0f}')}, "
              f"Run {reps.figure('run', lambda v: v[i], '{:.0f}')}, ratio {ratio(med['run'], med['hand'])}; "
              f"checkpoints off {reps.figure('run_off', lambda v: v[i], '{:.0f}')}, "
              f"ratio {ratio(med['run_off'], med['hand'])}")
    hand, run = reps.median("hand", lambda v: v[0]), reps.median("run", lambda v: v[0])
    if hand and run is not None:
        print(f"\nRun / hand-written (median steady-state samples/s): {run / hand:.3f} "
              f"(target >= 0.97: {'met' if run / hand >= 0.97 else 'NOT met'}; Run {reps.basis('run')}, "
              f"hand-written {reps.basis('hand')})")
    else:
        print(f"\nRun / hand-written: n/a (Run: {reps.basis('run')}; hand-written: {reps.basis('hand')})")
    print("step_end without a watched DDP module (one 2-float all-reduce, 2 gloo ranks): "
          + (f"{cost * 1e6:.0f} us/step (median of 500)" if cost is not None else "FAILED (see above)"))
    print(f"total {time.time() - t0:.0f} s")
    return reps.finish()


if __name__ == "__main__":
    sys.exit(main())
