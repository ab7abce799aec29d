"""What hpc_train costs: training samples/s against a hand-written DDP loop.

    .venv/bin/python benchmarks/overhead.py [--quick] [--reps N] [--steps N] [--warmup N]

Both sides train ``hpc_train.trainer.models.ConvNet`` on the same synthetic 1x28x28 data
(``hpc_train.trainer.data.synthetic``), batch 64 per rank, 2 processes on this machine, gloo, one
torch thread per rank, Adam at lr 1e-3:

* **hand-written**: the loop the PyTorch DDP tutorials teach (``torch.multiprocessing.spawn``,
  ``init_process_group``, ``DistributedSampler``, ``DataLoader``, ``DDP``; zero_grad, forward,
  backward, step), written here from scratch;
* **hpc_train**: ``python -m hpc_train run JOB --nproc 2`` with the default config (schedule,
  TensorBoard, metrics, progress lines, stop-flag agreement every step), checkpoints off; and
  again with async checkpoints every 10 steps; and with the node-local tier alone every 10 steps.

Measured identically on both sides: rank 0 stamps the wall clock at the end of every optimizer
step (hpc_train's own ``metrics.jsonl`` record; a list in the hand-written loop), and the
steady-state rate is ``global samples / time`` from the end of step ``warmup`` to the end of the
last step. Start-up (imports, rendezvous, data) is outside the window on both sides. The window
lies inside one epoch, so no evaluation falls in it. Variants run interleaved (A, B, C, A, B, C,
...) so that drift in the machine's speed hits each the same; the medians are compared. A
repetition that fails is reported and left out, the rest go on, every figure says how many
repetitions it rests on, and the exit status is 1 if any failed (benchmarks/reps.py).
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
BATCH, WORLD, LR, SEED = 64, 2, 1e-3, 0


# -- the hand-written loop (what the tutorials teach) -------------------------------------------
def _tutorial_worker(rank: int, world: int, port: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from hpc_train.config import DataSection
    from hpc_train.trainer.data import synthetic
    from hpc_train.trainer.models import ConvNet

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(SEED)
    train_ds, _ = synthetic(DataSection(name="synthetic", synthetic_size=steps * BATCH * world), SEED)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(train_ds, batch_size=BATCH, sampler=sampler)
    model = DDP(ConvNet())
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    loss_fn = nn.CrossEntropyLoss()
    stamps = []
    sampler.set_epoch(0)
    for step, (x, y) in enumerate(loader, 1):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 10 == 0:
            last = loss.item()           # the tutorials print the loss now and then
        stamps.append(time.time())
        if step == steps:
            break
    if rank == 0:
        Path(out).write_text(json.dumps({"stamps": stamps, "loss": last}))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_hand_written(steps: int, workdir: Path) -> list[float]:
    out = workdir / "hand.json"
    # A fresh interpreter per repetition, as the hpc_train side gets: no warm caches carried over.
    code = ("import sys, torch.multiprocessing as mp; sys.path.insert(0, sys.argv[1]); "
            "import overhead; mp.spawn(overhead._tutorial_worker, "
            "args=(2, int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]), nprocs=2)")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    run_checked([sys.executable, "-c", code, str(Path(__file__).parent), str(_free_port()), str(steps),
                 str(out)], "hand-written loop", cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["stamps"]


# -- hpc_train ------------------------------------------------------------------------------------
def run_hpc_train(steps: int, workdir: Path, checkpoints: bool, tag: str, stragglers: bool = True,
                  local: bool = False, keep: bool | None = None) -> list[float]:
    job = workdir / "bench.yaml"
    job.write_text("job:\n  name: overhead-bench\n")          # every other value: hpc_train's defaults
    run_dir = workdir / f"run-{tag}"
    sets = {"model.name": "convnet", "data.name": "synthetic", "data.batch_size": BATCH,
            "data.synthetic_size": steps * BATCH * WORLD, "train.max_steps": steps, "optim.lr": LR,
            "seed": SEED, "checkpoint.enabled": str(checkpoints).lower(), "log.progress": "lines"}
    if not stragglers:
        sets["dist.straggler_every_steps"] = 0    # the straggler gathering off (issue 31's comparison)
    if checkpoints:
        sets["checkpoint.every_steps"] = 10
        sets["checkpoint.every_seconds"] = 0      # exactly every 10 steps: no timed saves between them
        sets["checkpoint.local_every_seconds"] = 0
    if local:   # issue 30: the node-local tier alone, every 10 steps (the shared tier only at the end)
        sets.update({"checkpoint.enabled": "true", "checkpoint.every_steps": 0, "checkpoint.every_seconds": 0,
                     "checkpoint.local_every_steps": 10, "checkpoint.local_every_seconds": 0})
    if keep is not None:   # issue 52: the defaults' checkpoints (none falls in the run), keeping on or off
        sets.update({"checkpoint.enabled": "true", "checkpoint.local_on_failure": str(keep).lower()})
    argv = [sys.executable, "-m", "hpc_train", "run", str(job), "--nproc", str(WORLD), "--run-dir", str(run_dir)]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "RANK", "WORLD_SIZE"))}
    run_checked(argv, "hpc_train run", cwd=ROOT, env=env, capture_output=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {rec["step"]: rec["time"] for rec in records if "loss" in rec}
    if sorted(by_step) != list(range(1, steps + 1)):
        raise RuntimeError("metrics.jsonl misses steps")
    return [by_step[s] for s in range(1, steps + 1)]


def steady_rate(stamps: list[float], warmup: int) -> float:
    """Global samples/s from the end of step ``warmup`` to the end of the last step."""
    steps = len(stamps) - warmup
    return steps * BATCH * WORLD / (stamps[-1] - stamps[warmup - 1])


def typical_rate(stamps: list[float], warmup: int) -> float:
    """Global samples/s of the median step after warm-up: insensitive to another process taking
    the CPU for a moment (this measures the loop, not the machine's neighbours), and blind to
    a cost paid once in a while (a checkpoint every 10 steps), which :func:`steady_rate` sees."""
    periods = [b - a for a, b in zip(stamps[warmup - 1:], stamps[warmup:])]
    return BATCH * WORLD / statistics.median(periods)


def within_run(stamps: list[float], warmup: int, every: int = 10) -> float:
    """A run's rate against the same run's steps that no save touches: the mean step over the
    window's steps whose position after a save (every ``every`` steps) is 3 or more, over the
    mean of all of them. A save costs its step (the copy) and the next (the agreement waits for
    the write); both lie within two steps of it. Measured inside one run, so a machine whose
    speed drifts from run to run (this one's reps differ by more than the effect) cancels; for
    a variant that saves nothing it is the estimate's own noise."""
    periods = {s: b - a for s, (a, b) in enumerate(zip(stamps[warmup - 1:], stamps[warmup:]), start=warmup + 1)}
    clean = [d for s, d in periods.items() if s % every >= 3]
    return statistics.mean(clean) / statistics.mean(periods.values())


def _straggler_rank(rank: int, port: int, steps: int, out) -> None:
    import torch
    import torch.distributed as dist

    from hpc_train.node.straggler import Stragglers
    import logging
    logging.getLogger("hpc_train").setLevel(logging.ERROR)   # steps of no work: its naming is noise here
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        s = Stragglers(50, 1.3, rank, WORLD, True, Path(tempfile.gettempdir()))
        for step in range(1, 101):        # warm-up: the first gatherings connect
            s.arrived()
            s.left(step, torch.device("cpu"))
        dist.barrier()
        t = time.perf_counter()
        for step in range(101, 101 + steps):
            s.arrived()
            s.left(step, torch.device("cpu"))
        out.put((rank, (time.perf_counter() - t) / steps * 1e6))
    finally:
        dist.destroy_process_group()


def straggler_cost_us(steps: int = 5000) -> float:
    """What straggler detection adds to a step, alone: each rank's ``arrived`` and ``left`` (the
    time stamps, and the gathering every 50 steps: one all-gather of a float per rank) with no
    training between them, in microseconds a step, the slower rank's."""
    import torch.multiprocessing as mp

    from hpc_train.launch.local import free_port
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_straggler_rank, args=(r, port, steps, q)) for r in range(WORLD)]
    for p in procs:
        p.start()
    got = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    return max(v for _, v in got)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps per run (3 repetitions still)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of each variant (default 5)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 80; quick 40)")
    ap.add_argument("--warmup", type=int, default=None, help="steps excluded from the rate (default 10; quick 5)")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--only", help="comma-separated variants to run (hand is always run), of: hpc, hpc_local, "
                                   "hpc_ckpt, hpc_nostrag, hpc_keep, hpc_nokeep")
    args = ap.parse_args(argv)
    steps = args.steps or (40 if args.quick else 80)
    warmup = args.warmup or (5 if args.quick else 10)
    if not 1 <= warmup < steps - 1:
        ap.error("need 1 <= warmup < steps - 1")

    # The local tier runs right after "checkpoints off" in each rep: the two are compared rep by
    # rep too (paired), and a pair of neighbouring runs shares the machine's state of the moment.
    variants = {"hand": "hand-written DDP loop", "hpc": "hpc_train, checkpoints off",
                "hpc_local": "hpc_train, node-local tier every 10 steps",
                "hpc_ckpt": "hpc_train, async checkpoint every 10 steps",
                "hpc_nostrag": "hpc_train, checkpoints and stragglers off",
                # Issue 52: the defaults (shared every 10 min, local every 30 s: neither saves in
                # the run), each rank's own state kept at its peer every step, then not; neighbours.
                "hpc_keep": "hpc_train, defaults (keeping on)",
                "hpc_nokeep": "hpc_train, defaults, local_on_failure off"}
    if args.only:
        keep = {"hand", *(k.strip() for k in args.only.split(","))}
        unknown = keep - set(variants)
        if unknown:
            ap.error(f"--only: unknown {sorted(unknown)}; valid: {', '.join(variants)}")
        variants = {k: v for k, v in variants.items() if k in keep}
    reps = Reps()
    print(f"ConvNet, synthetic 1x28x28, batch {BATCH}/rank x {WORLD} ranks (gloo, 1 thread/rank), Adam; "
          f"{steps} steps per run, rate over steps {warmup + 1}-{steps}; {args.reps} interleaved repetitions",
          flush=True)
    t0 = time.time()

    def one(key: str, rep: int, work: Path) -> tuple[float, float, float]:
        """(steady-state samples/s, samples/s of the median step, :func:`within_run`) of one run."""
        if key == "hand":
            stamps = run_hand_written(steps, work)
        else:
            stamps = run_hpc_train(steps, work, checkpoints=key == "hpc_ckpt", tag=f"{key}-{rep}",
                                   stragglers=key != "hpc_nostrag", local=key == "hpc_local",
                                   keep={"hpc_keep": True, "hpc_nokeep": False}.get(key))
        return steady_rate(stamps, warmup), typical_rate(stamps, warmup), within_run(stamps, warmup)

    with tempfile.TemporaryDirectory(prefix="hpc_train-bench-") as tmp:
        work = Path(tmp)
        for rep in range(1, args.reps + 1):
            for key in variants:
                got = reps.run(key, rep, lambda: one(key, rep, work))
                if got:
                    print(f"  rep {rep}: {variants[key]:45s} {got[0]:8.1f} samples/s "
                          f"(median step: {got[1]:.1f})", flush=True)

    width = max(len(v) for v in variants.values())
    medians = {}
    tables = {}
    for title, i in (("steady-state samples/s (window from the end of warm-up to the last step)", 0),
                     ("samples/s of the median step (robust to neighbours on a shared machine)", 1)):
        med = {k: reps.median(k, lambda v: v[i]) for k in variants}
        medians[title] = med
        tables[i] = {k: reps.values(k, lambda v: v[i]) for k in variants}
        print(f"\n{title}")
        print(f"{'variant':{width}s}  " + "".join(f"{'rep ' + str(r):>9s}" for r in range(1, args.reps + 1))
              + f"{'median':>10s}{'ratio':>8s}  based on")
        for key, label in variants.items():
            cells = "".join(f"{got[i]:9.1f}" if (got := reps.get(key, r)) else f"{'failed':>9s}"
                            for r in range(1, args.reps + 1))
            print(f"{label:{width}s}  {cells}" + (f"{med[key]:10.1f}" if med[key] is not None else f"{'-':>10s}")
                  + f"{ratio(med[key], med['hand']):>8s}  {reps.basis(key)}")
    med = next(iter(medians.values()))
    if "hpc_keep" in variants:
        rk = ratio(med["hpc_keep"], med["hpc_nokeep"])
        pairs = [a[0] / b[0] for r in range(1, args.reps + 1)
                 if (a := reps.get("hpc_keep", r)) and (b := reps.get("hpc_nokeep", r))]
        print(f"\nissue 52: each rank's own state kept at a peer every step, on / off (the defaults otherwise): "
              f"{rk}; paired, rep by rep: {', '.join(f'{x:.3f}' for x in pairs)} (target >= 0.99: "
              f"{'met' if rk != 'n/a' and float(rk) >= 0.99 else 'NOT met'})")
    if "hpc" not in variants:
        return reps.finish()
    r = ratio(med["hpc"], med["hand"])
    print(f"\nhpc_train / hand-written (median of steady-state samples/s, checkpoints off): {r} "
          + (f"(target >= 0.97: {'met' if float(r) >= 0.97 else 'NOT met'}); " if r != "n/a" else "")
          + f"with async checkpoints every 10 steps: {ratio(med['hpc_ckpt'], med['hand'])} "
          f"(hand-written {reps.basis('hand')}; hpc_train {reps.basis('hpc')}; with checkpoints "
          f"{reps.basis('hpc_ckpt')}). Total {time.time() - t0:.0f} s.")
    rl = ratio(med["hpc_local"], med["hpc"])
    print(f"node-local tier every 10 steps / checkpoints off, the same trainer: {rl}"
          + (f" (target >= 0.97: {'met' if float(rl) >= 0.97 else 'NOT met'})" if rl != "n/a" else ""))
    pairs = [a[0] / b[0] for r in range(1, args.reps + 1)
             if (a := reps.get("hpc_local", r)) and (b := reps.get("hpc", r))]
    if pairs:
        paired = statistics.median(pairs)
        print(f"the same, paired (each rep's local-tier run over the run before it, checkpoints off; median of "
              f"{len(pairs)}: {', '.join(f'{x:.3f}' for x in pairs)}): {paired:.3f} (target >= 0.97: "
              f"{'met' if paired >= 0.97 else 'NOT met'})")
    inside = {k: reps.median(k, lambda v: v[2]) for k in ("hpc_local", "hpc")}
    if None not in inside.values():
        print(f"node-local tier every 10 steps, within each run (the mean step over the mean of the steps 3-9 after "
              f"a save; drift between runs cancels): {inside['hpc_local']:.3f} (target >= 0.97: "
              f"{'met' if inside['hpc_local'] >= 0.97 else 'NOT met'}); the same estimate with checkpoints off, its "
              f"noise: {inside['hpc']:.3f}")
    rs = ratio(med["hpc"], med["hpc_nostrag"])
    print(f"straggler detection on (every 50 steps, the default) / off: {rs}"
          + (f" (target >= 0.99: {'met' if float(rs) >= 0.99 else 'NOT met'})" if rs != "n/a" else ""))
    # The A/B ratio above is within the run-to-run noise of a shared machine (reps differ by more
    # than the effect): the detection's own cost, timed alone in the same run, says what it is.
    cost = straggler_cost_us()
    step_med = medians["samples/s of the median step (robust to neighbours on a shared machine)"]["hpc"]
    if step_med:
        step_us = BATCH * WORLD / step_med * 1e6
        print(f"straggler detection's own cost, timed alone (2 gloo ranks, 5000 steps, a gathering every 50): "
              f"{cost:.1f} us a step, against a median step of {step_us:.0f} us: on / off = "
              f"{step_us / (step_us + cost):.4f} (target >= 0.99: {'met' if step_us / (step_us + cost) >= 0.99 else 'NOT met'})")
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": steps, "warmup": warmup, "steady": tables[0],
                                               "median_step": tables[1],
                                               "within_run": {k: reps.values(k, lambda v: v[2]) for k in variants},
                                               "ratio": float(r) if r != "n/a" else None,
                                               "failed": [vars(f) for f in reps.failures]}, indent=2))
    return reps.finish()


if __name__ == "__main__":
    sys.exit(main())
