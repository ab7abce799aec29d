"""What one save of the node-local tier costs the CPU: the training thread's share and the writer's.

    .venv/bin/python benchmarks/local_save.py [--against DIR] [--reps 5] [--saves 40] [--model convnet|mlp]

One process, one thread for torch, the model with Adam after two steps (its state complete),
``LocalTier`` with copies off writing under ``/dev/shm`` (a save every call). Per save: the
wall and CPU time of ``LocalTier.save`` on the calling thread (the blocking copy) and the CPU
time of the writer thread's job (the item's files, its commit record, the pruning). Each figure
is the median over ``--saves`` saves after 5 unmeasured ones, in a fresh interpreter per rep.

``--against DIR``: another checkout of hpc_train (``git worktree add DIR COMMIT``) measured the
same way, its reps interleaved with this checkout's, so that both see the same machine; the
ratios compare the medians of the reps. A rep that fails is reported and left out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from reps import Reps, ratio, run_checked  # noqa: E402


def child(saves: int, model_name: str) -> dict[str, float]:
    import time

    import torch
    torch.set_num_threads(1)
    import hpc_train
    from hpc_train import config as config_mod
    from hpc_train.ckpt.local.tier import LocalTier
    from hpc_train.trainer.models import MLP, ConvNet

    model = ConvNet() if model_name == "convnet" else MLP(hidden=2048)
    optim = torch.optim.Adam(model.parameters(), 1e-3)
    for _ in range(2):
        optim.zero_grad()
        model(torch.randn(8, 1, 28, 28)).sum().backward()
        optim.step()
    base, run_dir = Path(tempfile.mkdtemp(dir="/dev/shm")), Path(tempfile.mkdtemp())
    cfg = config_mod.load(None, [f"checkpoint.local_dir={base}", "checkpoint.local_every_steps=1",
                                 "checkpoint.local_replicas=0"])
    tier = LocalTier(cfg.checkpoint, cfg.dist, run_dir, 0, 1, node=base / "hpc_train-bench" / "node0")
    writer_cpu: list[float] = []
    job = tier._background          # the writer thread's whole job, timed on that thread

    def timed(*a):
        t = time.thread_time()
        try:
            return job(*a)
        finally:
            writer_cpu.append(time.thread_time() - t)
    tier._background = timed
    state = {"model": model, "optim": optim, "step": 0}
    kinds = {"model": "module", "optim": "optimizer", "step": "plain"}
    wall, cpu = [], []
    try:
        for step in range(1, saves + 6):
            state["step"] = step
            t, c = time.perf_counter(), time.thread_time()
            tier.save(state, step, kinds)
            wall.append(time.perf_counter() - t)
            cpu.append(time.thread_time() - c)
            tier.wait()
        nbytes = sum(f.stat().st_size for f in tier.dir.glob(f"step-{saves + 5}/*"))
    finally:
        tier.close(remove=True)
        for d in (base, run_dir):
            subprocess.run(["rm", "-rf", str(d)], check=False)
    ms = lambda xs: statistics.median(xs[5:]) * 1e3   # noqa: E731
    return {"blocking_ms": ms(wall), "blocking_cpu_ms": ms(cpu), "writer_cpu_ms": ms(writer_cpu),
            "item_bytes": nbytes, "code": str(Path(hpc_train.__file__).resolve().parents[1])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", help="another checkout of hpc_train, measured side by side")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--saves", type=int, default=40)
    ap.add_argument("--model", choices=("convnet", "mlp"), default="convnet")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.saves, args.model)))
        return 0
    codes = {"this": ROOT}
    if args.against:
        codes["against"] = Path(args.against).resolve()
        if not (codes["against"] / "hpc_train" / "ckpt" / "local.py").is_file():
            ap.error(f"--against {args.against}: not a checkout of hpc_train with a local tier")
    reps = Reps()

    def one(code: Path) -> dict[str, float]:
        env = {**os.environ, "PYTHONPATH": str(code)}
        out = run_checked([sys.executable, str(Path(__file__).resolve()), "--child", "--saves", str(args.saves),
                           "--model", args.model], f"local save ({code})", cwd=code, env=env, capture_output=True,
                          text=True).stdout
        got = json.loads(out.strip().splitlines()[-1])
        if Path(got["code"]) != code:
            raise RuntimeError(f"the rep for {code} imported hpc_train from {got['code']}")
        return got
    for rep in range(1, args.reps + 1):
        for key, code in codes.items():
            got = reps.run(key, rep, lambda code=code: one(code))
            if got:
                print(f"  rep {rep} {key:8s} blocking {got['blocking_ms']:.3f} ms (CPU {got['blocking_cpu_ms']:.3f}), "
                      f"writer CPU {got['writer_cpu_ms']:.3f} ms, item {got['item_bytes'] / 1e6:.2f} MB", flush=True)
    print(f"\n{args.model} with Adam, a local save every call, medians of {args.saves} saves, then of the reps (ms):")
    for key, code in codes.items():
        med = {f: reps.median(key, lambda v, f=f: v[f]) for f in ("blocking_ms", "blocking_cpu_ms", "writer_cpu_ms")}
        if None in med.values():
            print(f"  {key} ({code}): no rep succeeded")
            continue
        print(f"  {key:8s} blocking {med['blocking_ms']:.3f} (CPU {med['blocking_cpu_ms']:.3f}), writer CPU "
              f"{med['writer_cpu_ms']:.3f}; CPU a save {med['blocking_cpu_ms'] + med['writer_cpu_ms']:.3f} "
              f"({reps.basis(key)}; {code})")
    if args.against:
        total = {k: reps.median(k, lambda v: v["blocking_cpu_ms"] + v["writer_cpu_ms"]) for k in codes}
        block = {k: reps.median(k, lambda v: v["blocking_ms"]) for k in codes}
        print(f"  this / against: CPU a save {ratio(total['this'], total['against'])}, blocking "
              f"{ratio(block['this'], block['against'])}")
    return reps.finish()


if __name__ == "__main__":
    sys.exit(main())
