"""The GPU paths, end to end, on a machine with one CUDA device:

    python benchmarks/gpu_paths.py [--reps 5] [--hidden 100000]

Every variant is the real ``python -m hpc_train run ... --nproc 1`` (NCCL, CUDA) of the built-in
trainer, read back from its own records (``result.json``, ``metrics.jsonl``):

* the paths: ``ddp`` fp32, ``ddp`` bf16, ``ddp`` fp16 (GradScaler), ``fsdp`` bf16, ``allreduce``; a
  user's own loop under ``torchrun`` (tests/scripts/own_loop.py) stopped by SIGTERM and resumed;
* checkpoint staging: an MLP whose state (weights and Adam) is about 1 GB, saved every 10 steps,
  sync against async with pinned-memory staging. Printed: the median time a save blocks the loop,
  the ratio async/sync, and the steps/s of both.

A variant that fails is reported as failed (its exit code or signal, its error file's first line
or the last lines of its stderr) and the rest go on; the summary says how many repetitions each
figure is based on, and the exit status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
sys.path.insert(0, str(Path(__file__).resolve().parent))
from reps import RepFailed, Reps, ratio  # noqa: E402


def _why(rd: Path, err: str) -> str:
    """A failed run's one line: its error file's first line, else stderr's last."""
    for f in sorted((rd / "logs").glob("rank-*.error")):
        return f.read_text().splitlines()[0][:300]
    return err.strip().splitlines()[-1][:300] if err.strip() else ""


def hpc_run(rd: Path, sets: list[str], timeout: float = 600) -> None:
    """One run to completion; :class:`RepFailed` (exit code, and the error file's first line or
    stderr's tail) if it failed."""
    r = subprocess.run([PY, "-m", "hpc_train", "run", "jobs/digits.yaml", "--nproc", "1", "--run-dir", str(rd),
                        "--set", "dist.backend=nccl", "--set", "log.progress=lines", "--set", "log.tensorboard=false",
                        *[a for s in sets for a in ("--set", s)]],
                       cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        why = _why(rd, "")
        # The tail shown: the error file's (the worker's traceback) where there is one, else stderr's.
        errs = "\n".join(f.read_text() for f in sorted((rd / "logs").glob("rank-*.error")))
        raise RepFailed(f"hpc_train run{': ' + why if why else ''}", r.returncode, errs or r.stderr)


def paths(tmp: Path, reps: Reps, extra: list[str] = ()) -> list[str]:
    lines = []
    variants = {"ddp fp32": [], "ddp bf16": ["train.precision=bf16"], "ddp fp16": ["train.precision=fp16"],
                "fsdp bf16": ["dist.strategy=fsdp", "train.precision=bf16"], "allreduce fp32": ["dist.strategy=allreduce"]}

    def one(name: str, sets: list[str]) -> str:
        rd = tmp / name.replace(" ", "-")
        hpc_run(rd, ["train.max_steps=300", "checkpoint.every_steps=100", *sets, *extra])
        res = json.loads((rd / "result.json").read_text())
        rates = [m["samples_per_s"] for m in map(json.loads, (rd / "metrics.jsonl").read_text().splitlines())
                 if "samples_per_s" in m]
        return (f"{name:12s} ok: {res['steps']} steps, test acc {res['test_accuracy']:.4f}, "
                f"{statistics.median(rates):.0f} samples/s, checkpoints {len(list((rd / 'checkpoints').glob('step-*')))}")
    for name, sets in variants.items():
        line = reps.run(name, 1, lambda: one(name, sets))
        lines.append(line or f"{name:12s} FAILED: {reps.failures[-1].reason}")
    line = reps.run("own loop (torchrun)", 1, lambda: own_loop(tmp))
    lines.append(line or f"own loop (torchrun) FAILED: {reps.failures[-1].reason}")
    return lines


def own_loop(tmp: Path) -> str:
    """A user's loop under torchrun on the GPU: SIGTERM mid-run, then the same command resumes."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
    cmd = [PY, "-m", "torch.distributed.run", "--nproc_per_node", "1", str(ROOT / "tests/scripts/own_loop.py"), "400", "0.02"]
    p = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (tmp / "runs/own_loop/metrics.jsonl").exists():
            time.sleep(0.2)
        time.sleep(2)
        os.kill(p.pid, signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    except BaseException:               # no torchrun left behind by a failed repetition
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    stopped = json.loads((tmp / "runs/own_loop/stopped.json").read_text()) if (tmp / "runs/own_loop/stopped.json").exists() else {}
    r = subprocess.run(cmd[:-1] + ["0"], cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    res = json.loads((tmp / "runs/own_loop/result.json").read_text()) if (tmp / "runs/own_loop/result.json").exists() else {}
    return (f"own loop (torchrun, nccl): stopped at step {stopped.get('steps')} (exit {p.returncode}, "
            f"checkpoint {stopped.get('checkpoint')}); resumed: exit {r.returncode}, steps {res.get('steps')}, "
            f"hint: {[ln for ln in err.splitlines() if 'resume with' in ln][:1]}")


def staging(tmp: Path, n: int, hidden: int, reps: Reps) -> list[str]:
    sets = ["model.name=mlp", f"model.hidden={hidden}", "data.name=synthetic", "data.synthetic_size=20000",
            "data.batch_size=256", "train.max_steps=60", "train.eval=false", "checkpoint.every_steps=10",
            "checkpoint.keep=2"]
    size = None

    def one(mode: str, i: int) -> tuple[float, float]:
        """(the time one save blocked the loop, median samples/s) of one run."""
        nonlocal size
        rd = tmp / f"stage-{mode}-{i}"
        hpc_run(rd, [*sets, f"checkpoint.async_save={'true' if mode == 'async' else 'false'}"])
        # The loop's own ledger: the time saves blocked training, over the saves of this run.
        seg = json.loads((rd / "goodput.json").read_text())["segments"][-1]
        rates = [m["samples_per_s"] for m in map(json.loads, (rd / "metrics.jsonl").read_text().splitlines())
                 if "samples_per_s" in m]
        size = sum(f.stat().st_size for f in (rd / "checkpoints").rglob("*") if f.is_file()) / 2 ** 20 / 2
        return seg["save_block_s"] / 6, statistics.median(rates)    # steps 10, 20, ..., 60
    for i in range(1, n + 1):
        for mode in ("sync", "async"):   # interleaved
            reps.run(f"staging {mode}", i, lambda: one(mode, i))
    out = [f"checkpoint state ~{size:.0f} MiB per checkpoint (MLP hidden {hidden} with Adam)" if size is not None
           else f"checkpoint state: no run succeeded (MLP hidden {hidden} with Adam)"]
    for mode in ("sync", "async"):
        key = f"staging {mode}"
        blocked = reps.values(key, lambda v: v[0])
        if blocked:
            out.append(f"{mode:5s}: a save blocks {reps.figure(key, lambda v: v[0] * 1000, '{:.1f}', ' ms')} "
                       f"(runs {', '.join(f'{b * 1000:.1f}' for b in blocked)}), "
                       f"{reps.median(key, lambda v: v[1]):.0f} samples/s")
        else:
            out.append(f"{mode:5s}: {reps.basis(key)}")
    out.append("async blocking / sync save: " + ratio(reps.median("staging async", lambda v: v[0]),
                                                      reps.median("staging sync", lambda v: v[0])))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=100000)
    ap.add_argument("--only", choices=("paths", "staging"))
    ap.add_argument("--set", action="append", default=[], help="an extra --set for the paths' runs")
    args = ap.parse_args()
    import torch
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}")
    reps = Reps()
    with tempfile.TemporaryDirectory() as d:
        if args.only != "staging":
            for line in paths(Path(d), reps, args.set):
                print(line, flush=True)
        if args.only != "paths":
            for line in staging(Path(d), args.reps, args.hidden, reps):
                print(line, flush=True)
    return reps.finish()


if __name__ == "__main__":
    sys.exit(main())
