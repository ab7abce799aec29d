"""Operations a real local run makes on its run directory, per second in steady state, from
``strace`` (issue 32: what a job costs a shared file system's metadata server).

``strace -f -tt -y -e trace=file,desc`` follows every process of ``python -m hpc_train run ...
--nproc N``; ``-y`` prints the path behind each file descriptor. Each call is sorted by what it
touches:

* a **path operation** names a path under the run directory (``openat``, ``stat``,
  ``utimensat``, ``rename``, ...): each is a metadata request to a shared file system's server
  (Lustre's MDS, an NFS server), the load the issue is about;
* an **fd operation** works on a file already open there (``write``, ``fsync``, ``close``,
  ``fstat``): on a shared file system a write lands on the data servers, not the metadata one.

Each is split by the file's kind (TensorBoard events, ``metrics.jsonl``, heartbeats, rank logs,
checkpoints, the rest). Steady state is the time between the first line of ``metrics.jsonl``
plus a settling margin and the final save (the first operation under ``checkpoints/`` or on
``result.json`` after it), less a margin: start-up and the end's checkpoint are not counted.

Usage: .venv/bin/python benchmarks/rundir_ops.py [--strace FILE --run-dir DIR] [--script]  (no
arguments: run the digits job with 2 processes under strace and report it; ``--script``: a user's
own loop on ``hpc_train.init()``, ``tests/scripts/own_loop.py``, under ``run --script`` instead,
about 25 s of steps, no periodic checkpoint).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("tensorboard", "metrics", "heartbeat", "rank 0 log", "rank logs", "checkpoints", "other")
SETTLE_S = 2.0      # after the first metrics line: imports, the first step's set-up
END_MARGIN_S = 0.5  # before the final save

_LINE = re.compile(r"^(\d+)\s+(\d\d):(\d\d):(\d\d\.\d+)\s+(?:<\.\.\. )?([a-z0-9_]+)")


def kind(path: str, run_dir: str) -> str:
    rel = path[len(run_dir):].lstrip("/")
    if rel.startswith("tb/") or rel == "tb":
        return "tensorboard"
    if rel == "metrics.jsonl":
        return "metrics"
    if rel.startswith("logs/.heartbeat"):
        return "heartbeat"
    if rel == "logs/rank-0.log":     # the console's progress lines too: it does not grow with the ranks
        return "rank 0 log"
    if rel.startswith("logs/"):
        return "rank logs"
    if rel.startswith("checkpoints"):
        return "checkpoints"
    return "other"


@dataclass
class Ops:
    """Run-directory operations in the steady-state window, by (path or fd, kind)."""
    window_s: float
    path_ops: Counter = field(default_factory=Counter)
    fd_ops: Counter = field(default_factory=Counter)
    path_calls: Counter = field(default_factory=Counter)   # (kind, syscall): what they are

    def per_s(self, which: str, k: str | None = None) -> float:
        c = self.path_ops if which == "path" else self.fd_ops
        n = sum(c.values()) if k is None else c[k]
        return n / self.window_s if self.window_s > 0 else float("nan")


def _path_argument(line: str) -> str:
    """The path a call names: its first quoted argument. Not a result that happens to name the run
    directory (``readlink("/proc/PID/fd/3", "RUN_DIR/logs/...")`` asks procfs, not the file
    system; a resumed call prints only its results)."""
    if "resumed>" in line.split('"', 1)[0]:
        return ""
    parts = line.split('"', 2)
    return parts[1] if len(parts) > 2 else ""


def parse(strace_file: Path, run_dir: Path) -> Ops:
    """The steady-state operations on ``run_dir`` in ``strace_file`` (see the module's doc)."""
    rd = str(Path(run_dir).resolve())
    quoted, fd_ref = f'"{rd}', f"<{rd}"
    events: list[tuple[float, str, str, str]] = []   # (time, "path" | "fd", kind, syscall)
    for line in Path(strace_file).read_text(errors="replace").splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        t = int(m[2]) * 3600 + int(m[3]) * 60 + float(m[4])
        call = m[5]
        if quoted in line and _path_argument(line).startswith(rd):
            p = line[line.index(quoted) + 1:].split('"', 1)[0]
            events.append((t, "path", kind(p, rd), call))
        elif fd_ref in line.split(") = ", 1)[0]:
            p = line[line.index(fd_ref) + 1:].split(">", 1)[0]
            events.append((t, "fd", kind(p, rd), call))
    metrics = [t for t, w, k, c in events if k == "metrics" and c.startswith("write")]
    if not metrics:
        raise RuntimeError(f"no write to {rd}/metrics.jsonl in {strace_file}: not a traced training run")
    start = metrics[0] + SETTLE_S
    end_marks = [t for t, w, k, c in events if t > start and k == "checkpoints"]
    end = (min(end_marks) if end_marks else max(t for t, *_ in events)) - END_MARGIN_S
    ops = Ops(window_s=max(0.0, end - start))
    for t, w, k, c in events:
        if start <= t <= end:
            (ops.path_ops if w == "path" else ops.fd_ops)[k] += 1
            if w == "path":
                ops.path_calls[(k, c)] += 1
    return ops


SCRIPT = ["--script", str(ROOT / "tests" / "scripts" / "own_loop.py")]
SCRIPT_TAIL = ["--set", "checkpoint.every_steps=0", "--", "500", "0.05"]   # steps, sleep after each


def trace_run(out_dir: Path, nproc: int = 2, extra: list[str] | None = None,
              what: list[str] | None = None) -> tuple[Path, Path]:
    """``python -m hpc_train run jobs/digits.yaml --nproc N`` (or ``run WHAT``) under strace, into
    ``out_dir``: (the trace, the run directory)."""
    strace = shutil.which("strace")
    if strace is None:
        raise RuntimeError("strace is not installed")
    trace, run_dir = out_dir / "run.strace", out_dir / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(ROOT)
    argv = [strace, "-f", "-tt", "-y", "-e", "trace=file,desc", "-o", str(trace), sys.executable, "-m",
            "hpc_train", "run", *(what or [str(ROOT / "jobs" / "digits.yaml")]), "--nproc", str(nproc), "--run-dir",
            str(run_dir), "--set", "log.progress=lines", *(extra or [])]
    r = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"the traced run failed (exit {r.returncode}): {r.stderr[-2000:]}")
    return trace, run_dir


def report(ops: Ops, file=sys.stdout) -> None:
    print(f"steady state: {ops.window_s:.1f} s", file=file)
    print(f"{'file kind':<14} {'path ops/s':>11} {'fd ops/s':>9}", file=file)
    for k in KINDS:
        print(f"{k:<14} {ops.per_s('path', k):>11.2f} {ops.per_s('fd', k):>9.2f}", file=file)
    print(f"{'all':<14} {ops.per_s('path'):>11.2f} {ops.per_s('fd'):>9.2f}", file=file)
    calls = ", ".join(f"{k}/{c} {n / ops.window_s:.2f}" for (k, c), n in ops.path_calls.most_common())
    print(f"path ops by call (per s): {calls}", file=file)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strace", type=Path, help="an existing trace (with --run-dir)")
    p.add_argument("--run-dir", type=Path)
    p.add_argument("--keep", action="store_true", help="keep the trace and the run directory")
    p.add_argument("--script", action="store_true", help="trace a user's own loop under run --script")
    a = p.parse_args()
    if a.strace:
        report(parse(a.strace, a.run_dir))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="rundir-ops-"))
    try:
        trace, run_dir = trace_run(tmp, extra=SCRIPT_TAIL if a.script else None, what=SCRIPT if a.script else None)
        report(parse(trace, run_dir))
    finally:
        if a.keep:
            print(f"kept: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
