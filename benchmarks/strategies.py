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
    maxrss_kib, code = r.stdout.split()[-2:]
    if code != "0":
        raise RuntimeError(f"{' '.join(argv)} failed ({code}):\n{r.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {rec["step"]: rec["time"] for rec in records if "loss" in rec}
    assert sorted(by_step) == list(range(1, steps + 1)), "metrics.jsonl misses steps"
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
    rates: dict[str, list[float]] = {k: [] for k in keys}
    typical: dict[str, list[float]] = {k: [] for k in keys}
    rss: dict[str, list[float]] = {k: [] for k in keys}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="hpc_train-strategies-") as tmp:
        for rep in range(args.reps):
            for key in keys:
                stamps, peak = run_variant(VARIANTS[key][1], args.steps, args.hidden, Path(tmp), f"{key}-{rep}")
                rates[key].append(steady_rate(stamps, args.warmup))
                typical[key].append(typical_rate(stamps, args.warmup))
                rss[key].append(peak)
                print(f"  rep {rep + 1}: {VARIANTS[key][0]:36s} {rates[key][-1]:8.1f} samples/s (median step "
                      f"{typical[key][-1]:8.1f})  peak {peak:7.1f} MiB", flush=True)
    med_rate = {k: statistics.median(v) for k, v in rates.items()}
    med_typ = {k: statistics.median(v) for k, v in typical.items()}
    med_rss = {k: statistics.median(v) for k, v in rss.items()}
    width = max(len(VARIANTS[k][0]) for k in keys)
    print(f"\n{'variant':{width}s}  {'samples/s':>10s} {'vs ddp':>7s}  {'median step':>11s} {'vs ddp':>7s}  "
          f"{'peak MiB/rank':>13s} {'vs ddp':>8s}")
    for k in keys:
        print(f"{VARIANTS[k][0]:{width}s}  {med_rate[k]:10.1f} {med_rate[k] / med_rate['ddp']:7.3f}  "
              f"{med_typ[k]:11.1f} {med_typ[k] / med_typ['ddp']:7.3f}  "
              f"{med_rss[k]:13.1f} {med_rss[k] - med_rss['ddp']:+8.1f}")
    print(f"(medians of {args.reps}; peak = ru_maxrss of the largest process of the run; total "
          f"{time.time() - t0:.0f} s)")
    # Paired: each repetition's rate over the ddp run next to it, then the median. A shared
    # machine's speed drifts within a benchmark (2x here); a pair shares the same moment.
    print("\npaired ratio vs ddp (median over repetitions of rate / that repetition's ddp rate):")
    for k in keys[1:]:
        pairs = [r / d for r, d in zip(rates[k], rates["ddp"])]
        print(f"  {VARIANTS[k][0]:{width}s}  {statistics.median(pairs):6.3f}   "
              f"(per rep: {' '.join(f'{x:.2f}' for x in pairs)})")
    if args.json:
        Path(args.json).write_text(json.dumps({"rates": rates, "median_step": typical, "peak_mib": rss, "steps": args.steps,
                                               "warmup": args.warmup, "hidden": args.hidden}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
