"""What each ``dist.strategy`` and ``train.precision`` costs: samples/s relative to ``ddp``, and
peak memory per rank, measured side by side in one run.

    .venv/bin/python benchmarks/strategies.py [--reps N] [--steps N] [--warmup N] [--hidden N]

Every variant is ``python -m hpc_train run JOB --nproc 2`` (gloo, one torch thread per rank) of
the built-in MLP (784 -> ``--hidden`` -> 10; default 2048, 1.6 M parameters, so that Adam's state
and FSDP's sharding show in the memory) on synthetic 1x28x28 data, batch 64 per rank, Adam,
checkpoints off. Only ``dist.strategy`` / ``train.precision`` differ.

* **samples/s**: rank 0 stamps the end of every step (hpc_train's ``metrics.jsonl``); the rate is
  global samples over the window from the end of step ``warmup`` to the last step (start-up and
  imports are outside it), and, robust to neighbours on a shared machine, the rate of the median
  step; as in benchmarks/overhead.py.
* **peak memory per rank**: ``ru_maxrss`` of ``getrusage(RUSAGE_CHILDREN)`` in a fresh wrapper
  process per run. Linux folds every waited-for descendant into it, so it is the peak resident
  set of the largest process of the run: a rank (the launcher is far smaller). It includes the
  interpreter and torch (~0.3 GB per rank), so differences between strategies are what matters.
* Variants run interleaved (A, B, C, ..., A, B, C, ...) so that drift in the machine's speed
  (2 shared cores here) hits each the same; medians of ``--reps`` repetitions are compared.
  A repetition that fails is reported and left out (the rest go on); every figure says how many
  repetitions it rests on, and the exit status is 1 if any failed (benchmarks/reps.py).

``dp`` is not measured on CPU: without GPUs nn.DataParallel is the bare module in one process,
so there is nothing to compare (it is refused with 2 processes per node).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from reps import RepFailed, Reps, ratio  # noqa: E402
BATCH, WORLD = 64, 2
VARIANTS = {   # key: (label, --set items)
    "ddp": ("ddp (reference)", {"dist.strategy": "ddp"}),
    "allreduce": ("allreduce", {"dist.strategy": "allreduce"}),
    "fsdp": ("fsdp", {"dist.strategy": "fsdp"}),
    "split": ("split (2 stages, all on CPU)", {"dist.strategy": "split"}),
    "none": ("none (no gradient averaging)", {"dist.strategy": "none"}),
    "bf16": ("ddp + bf16 autocast", {"dist.strategy": "ddp", "train.precision": "bf16"}),
    "fp16": ("ddp + fp16 autocast + GradScaler", {"dist.strategy": "ddp", "train.precision": "fp16"}),
}
# One wrapper process per run: its RUSAGE_CHILDREN covers this run's processes only.
_WRAPPER = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode)")


def run_variant(sets: dict[str, str], steps: int, hidden: int, work: Path, tag: str) -> tuple[list[float], float]:
    """(end-of-step stamps, peak RSS of the largest process in MiB) of one run."""
    job = work / "bench.yaml"
    job.write_text("job:\n  name: strategies-bench\n")
    run_dir = work / f"run-{tag}"
    every = {"model.name": "mlp", "model.hidden": hidden, "data.name": "synthetic", "data.batch_size": BATCH,
             "data.synthetic_size": steps * BATCH * WORLD, "train.max_steps": steps, "train.eval": "false",
             "checkpoint.enabled": "false", "log.progress": "off", "log.tensorboard": "false", **sets}
    argv = [sys.executable, "-m", "hpc_train", "run", str(job), "--nproc", str(WORLD), "--run-dir", str(run_dir)]
    for k, v in every.items():
        argv += ["--set", f"{k}={v}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "RANK", "WORLD_SIZE"))}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-c", _WRAPPER, *argv], cwd=ROOT, env=env, capture_output=True, text=True)
    try:
        maxrss_kib, code = r.stdout.split()[-2:]
    except ValueError:                  # the wrapper itself died before printing
        raise RepFailed("hpc_train run (wrapper)", r.returncode, r.stderr) from None
    if code != "0":
        raise RepFailed("hpc_train run", int(code), r.stderr)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {rec["step"]: rec["time"] for rec in records if "loss" in rec}
    if sorted(by_step) != list(range(1, steps + 1)):
        raise RuntimeError("metrics.jsonl misses steps")
    return [by_step[s] for s in range(1, steps + 1)], int(maxrss_kib) / 1024


def steady_rate(stamps: list[float], warmup: int) -> float:
    return (len(stamps) - warmup) * BATCH * WORLD / (stamps[-1] - stamps[warmup - 1])


def typical_rate(stamps: list[float], warmup: int) -> float:
    """Global samples/s of the median step after warm-up: robust to a neighbour taking the CPU
    for a moment on a shared machine (what benchmarks/overhead.py calls the median step)."""
    periods = [b - a for a, b in zip(stamps[warmup - 1:], stamps[warmup:])]
    return BATCH * WORLD / statistics.median(periods)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions of each variant (default 5)")
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default 40)")
    ap.add_argument("--warmup", type=int, default=5, help="steps excluded from the rate (default 5)")
    ap.add_argument("--hidden", type=int, default=2048, help="MLP hidden width (default 2048)")
    ap.add_argument("--only", nargs="*", choices=list(VARIANTS), help="a subset of the variants (ddp is always run)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    if not 1 <= args.warmup < args.steps - 1:
        ap.error("need 1 <= warmup < steps - 1")
    keys = ["ddp", *[k for k in (args.only or VARIANTS) if k != "ddp"]]
    params = 784 * args.hidden + args.hidden + args.hidden * 10 + 10
    print(f"MLP 784-{args.hidden}-10 ({params / 1e6:.2f} M parameters), synthetic 1x28x28, batch {BATCH}/rank x "
          f"{WORLD} ranks (gloo, 1 thread/rank), Adam, checkpoints off; {args.steps} steps per run, rate over steps "
          f"{args.warmup + 1}-{args.steps}; {args.reps} interleaved repetitions", flush=True)
    reps = Reps()
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="hpc_train-strategies-") as tmp:
        for rep in range(1, args.reps + 1):
            for key in keys:
                def one(key: str = key, rep: int = rep) -> tuple[float, float, float]:
                    stamps, peak = run_variant(VARIANTS[key][1], args.steps, args.hidden, Path(tmp), f"{key}-{rep}")
                    return steady_rate(stamps, args.warmup), typical_rate(stamps, args.warmup), peak
                got = reps.run(key, rep, one)
                if got:
                    print(f"  rep {rep}: {VARIANTS[key][0]:36s} {got[0]:8.1f} samples/s (median step "
                          f"{got[1]:8.1f})  peak {got[2]:7.1f} MiB", flush=True)
    med_rate = {k: reps.median(k, lambda v: v[0]) for k in keys}
    med_typ = {k: reps.median(k, lambda v: v[1]) for k in keys}
    med_rss = {k: reps.median(k, lambda v: v[2]) for k in keys}
    width = max(len(VARIANTS[k][0]) for k in keys)

    def num(x: float | None, fmt: str) -> str:
        return fmt.format(x) if x is not None else "-"
    print(f"\n{'variant':{width}s}  {'samples/s':>10s} {'vs ddp':>7s}  {'median step':>11s} {'vs ddp':>7s}  "
          f"{'peak MiB/rank':>13s} {'vs ddp':>8s}  based on")
    for k in keys:
        drss = med_rss[k] - med_rss["ddp"] if med_rss[k] is not None and med_rss["ddp"] is not None else None
        print(f"{VARIANTS[k][0]:{width}s}  {num(med_rate[k], '{:.1f}'):>10s} {ratio(med_rate[k], med_rate['ddp']):>7s}  "
              f"{num(med_typ[k], '{:.1f}'):>11s} {ratio(med_typ[k], med_typ['ddp']):>7s}  "
              f"{num(med_rss[k], '{:.1f}'):>13s} {num(drss, '{:+.1f}'):>8s}  {reps.basis(k)}")
    print(f"(medians of the successful repetitions of {args.reps}; peak = ru_maxrss of the largest process of the "
          f"run; total {time.time() - t0:.0f} s)")
    # Paired: each repetition's rate over the ddp run next to it, then the median. A shared
    # machine's speed drifts within a benchmark (2x here); a pair shares the same moment.
    print("\npaired ratio vs ddp (median over repetitions of rate / that repetition's ddp rate):")
    for k in keys[1:]:
        pairs = [reps.get(k, r)[0] / reps.get("ddp", r)[0] for r in range(1, args.reps + 1)
                 if reps.get(k, r) and reps.get("ddp", r)]
        if pairs:
            print(f"  {VARIANTS[k][0]:{width}s}  {statistics.median(pairs):6.3f}   "
                  f"(per rep: {' '.join(f'{x:.2f}' for x in pairs)}; {len(pairs)} pairs where both succeeded)")
        else:
            print(f"  {VARIANTS[k][0]:{width}s}  n/a (no repetition where both it and ddp succeeded)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "rates": {k: reps.values(k, lambda v: v[0]) for k in keys},
            "median_step": {k: reps.values(k, lambda v: v[1]) for k in keys},
            "peak_mib": {k: reps.values(k, lambda v: v[2]) for k in keys}, "steps": args.steps,
            "warmup": args.warmup, "hidden": args.hidden, "failed": [vars(f) for f in reps.failures]}, indent=2))
    return reps.finish()


if __name__ == "__main__":
    sys.exit(main())
