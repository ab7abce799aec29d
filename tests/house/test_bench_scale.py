"""benchmarks/scale.py at 64 ranks on 8 nodes, one repetition, no strace: it builds its run
directory through the records' writers, the hook decides the requeue it must, and every part
has a figure (no speed is asserted: a shared machine)."""

from __future__ import annotations

import subprocess
import sys

from helpers import REPO, clean_env


def test_scale_benchmark_runs_small():
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "scale.py"), "--ranks", "64", "--nodes", "8",
                        "--reps", "1", "--steps", "200", "--no-strace", "--no-cli"],
                       env=clean_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "64 ranks on 8 nodes, medians of 1" in r.stdout
    for part in ("hook gather + decide (preemption stop)", "status (in-process)", "status --goodput (in-process)",
                 "restore plan, sizes", "restore plan, checksums", "watchdog scan, store", "watchdog scan, files"):
        row = next((ln for ln in r.stdout.splitlines() if ln.startswith(f"| {part}")), None)
        assert row is not None and "(median of 1)" in row, (part, r.stdout)
    assert "all 7 repetitions succeeded" in r.stdout
