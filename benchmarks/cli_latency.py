"""Wall time of the commands that do not train, as figures (the tests assert no speed: the
machine they run on is shared, and a threshold there fails on load, not on a regression).

Each figure is the median of ``--reps`` runs (default 5), printed with its min and max and how
many runs it rests on (a run that fails is reported, left out, and counted; the exit status is 1
if any failed):

1. ``config.load`` of a YAML "billion laughs" file (refused at the first alias), in this process;
2. ``python -m hpc_train --help`` and ``python -c pass`` (interpreter start-up, for scale);
3. ``status RUN_DIR`` of a local run directory (files only, no scheduler);
4. ``sweep summary SWEEP_DIR`` over a 100-task sweep directory (files only);
5. ``status SWEEP_DIR`` over the same 100 tasks: two scheduler calls, so only where ``squeue``
   and ``sacct`` are on PATH (the local cluster: ``eval "$(slurm/devcluster.sh env)"``); the
   tasks' job ids are made up, so the scheduler answers for none of them.

Light: a few seconds, nothing trains. Usage: .venv/bin/python benchmarks/cli_latency.py [--reps N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
sys.path.insert(0, str(Path(__file__).resolve().parent))
from reps import RepFailed, Reps  # noqa: E402

REPS = Reps()

BILLION_LAUGHS = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{x}: &{x} [{', '.join([f'*{p}'] * 9)}]\n" for p, x in zip("abcdefgh", "bcdefghi"))


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _timed(name: str, reps: int, fn) -> str:
    """Each of ``reps`` calls of ``fn`` timed as one repetition of the figure ``name``."""
    def one():
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    for rep in range(1, reps + 1):
        REPS.run(name, rep, one)
    return name


def _timed_cmd(name: str, args: list[str], reps: int, ok: tuple[int, ...] = (0,)) -> str:
    def call() -> None:
        r = subprocess.run(args, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
        if r.returncode not in ok:
            raise RepFailed(" ".join(args[1:4]), r.returncode, r.stderr)
    return _timed(name, reps, call)


def _show(name: str) -> None:
    times = REPS.values(name)
    if not times:
        print(f"{name:<44} {REPS.basis(name)}")
        return
    print(f"{name:<44} median {statistics.median(times) * 1000:8.1f} ms   "
          f"(min {min(times) * 1000:.1f}, max {max(times) * 1000:.1f}, {REPS.basis(name)})")


def _run_dir(root: Path, i: int = 0, steps: int = 200) -> Path:
    """The files `status` reads of a finished local run (no training: the figures are the reader's)."""
    rd = root / f"{i}-seed={i}"
    (rd / "logs").mkdir(parents=True)
    (rd / "config.yaml").write_text("seed: %d\n" % i)
    (rd / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s, "epoch": s // 50}) + "\n"
                                              for s in range(1, steps + 1)))
    (rd / "result.json").write_text(json.dumps({"loss": 1.0 / steps, "steps": steps}))
    return rd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from hpc_train import config
    from hpc_train.errors import UsageError

    tmp = Path(tempfile.mkdtemp(prefix="cli-latency-"))
    try:
        bomb = tmp / "bomb.yaml"
        bomb.write_text(BILLION_LAUGHS)

        def refuse() -> None:
            try:
                config.load(bomb)
            except UsageError:
                return
            raise RuntimeError("the alias bomb was accepted")
        _show(_timed("config.load(billion laughs) -> refused", a.reps, refuse))

        _show(_timed_cmd("python -c pass", [PY, "-c", "pass"], a.reps))
        _show(_timed_cmd("python -m hpc_train --help", [PY, "-m", "hpc_train", "--help"], a.reps))
        rd = _run_dir(tmp / "local")
        _show(_timed_cmd("status RUN_DIR (local run)", [PY, "-m", "hpc_train", "status", str(rd)], a.reps))

        sweep = tmp / "sweep"
        tasks = [{"index": i, "overrides": {"seed": str(i)}, "run_dir": str(_run_dir(sweep, i)),
                  "jobs": [f"999999_{i}"]} for i in range(100)]
        (sweep / "sweep.json").write_text(json.dumps({"source": "benchmark", "created": time.time(), "tasks": tasks,
                                                      "submissions": [{"jobs": [t["jobs"][0] for t in tasks]}]}))
        _show(_timed_cmd("sweep summary SWEEP_DIR (100 tasks)",
                         [PY, "-m", "hpc_train", "sweep", "summary", str(sweep)], a.reps))
        if shutil.which("squeue") and shutil.which("sacct"):
            _show(_timed_cmd("status SWEEP_DIR (100 tasks, 2 scheduler calls)",
                             [PY, "-m", "hpc_train", "status", str(sweep)], a.reps))
        else:
            print("status SWEEP_DIR: skipped (no squeue/sacct on PATH; see the docstring)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return REPS.finish()


if __name__ == "__main__":
    sys.exit(main())
