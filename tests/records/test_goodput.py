"""The goodput ledger (issue 12), on real local runs: a kill -9 after a checkpoint, a stop by
SIGTERM, and the resumes that follow. The ledger's redone steps must equal the steps lost (the
``metrics.jsonl`` lines past the checkpoint the restart resumes from), its parts must add up to
the wall time measured by this test's clock, outside the processes that write the ledger (that
the parts sum to the ledger's own wall is true by its construction, so it is not asserted), and
``status`` must show it. (The same on the real cluster,
with preemptions, is in tests/slurm/test_preemption.py.)"""

from __future__ import annotations

import pytest

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import REPO, clean_env, hpc, kill9_workers, metric_lines, show, write_config

from hpc_train import goodput
from hpc_train.ckpt import store

# Every test here starts real training processes: not in `make test-fast`.
pytestmark = pytest.mark.procs


def _metric_steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in metric_lines(run_dir) if '"loss"' in x]


def _steps_past(run_dir: Path, step: int) -> set[int]:
    """The steps past ``step`` that some line of ``metrics.jsonl`` says ended (a straggler report
    is written at its step's end, before the step's loss line: a kill can fall between them)."""
    return {s for s in (json.loads(x).get("step") for x in metric_lines(run_dir))
            if isinstance(s, int) and s > step}


def test_ledger_counts_redone_steps_and_adds_up_to_the_wall_time(tmp_path):
    # Steps of about 10 ms (the bare MLP's take about 1 ms: a look every 50 ms cannot aim a kill).
    cfg = write_config(tmp_path / "job.yaml", {"train": {"max_steps": 400}, "checkpoint": {"every_steps": 100},
                                               "data": {"name": "tests.plugins_for_tests:slow_data"}})
    rd = tmp_path / "run"
    t_first = time.time()
    p = subprocess.Popen([sys.executable, "-m", "hpc_train", "run", str(cfg), "--nproc", "2", "--run-dir", str(rd)],
                         cwd=REPO, env=clean_env(HPC_TEST_SLOW_S="0.0006"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    # Past a checkpoint, and some steps beyond it that the kill will lose: early in the interval,
    # so that the next checkpoint cannot complete between this look and the kill (with saves
    # every 40 and 1-ms steps, a look that lagged on a loaded machine once saw the kill lose none).
    deadline = time.monotonic() + 180
    while True:
        ck = store.newest_complete(rd)
        done = _metric_steps(rd) if (rd / "metrics.jsonl").exists() else []
        if ck is not None and done and ck.step + 15 <= max(done) < ck.step + 50 and ck.step >= 100:
            break
        assert time.monotonic() < deadline and p.poll() is None, "no checkpoint and progress past it"
        time.sleep(0.05)
    kill9_workers(p.pid)
    p.communicate(timeout=60)
    p.wait()
    t_first_gone = time.time()          # the first launcher has exited (it records its end before)
    ck = store.newest_complete(rd)
    lost = len(_steps_past(rd, ck.step))
    assert lost > 0

    time.sleep(1.0)      # a visible gap between the runs
    t_second = time.time()              # the second launcher starts after this
    second = hpc("run", str(cfg), "--nproc", "2", "--run-dir", str(rd), timeout=300)
    t_end = time.time()
    assert second.returncode == 0, show(second)

    rec = json.loads((rd / goodput.FILE).read_text())
    assert len(rec["segments"]) == 2
    first, again = rec["segments"]
    assert first["redone_steps"] == lost, (first, lost)
    assert first["redone_s"] > 0 and not first["closed"] and again["closed"]
    assert again["step_from"] == ck.step and again["step_to"] == 400 and again["load_s"] > 0
    b = goodput.breakdown(rd)
    assert b["redone_steps"] == lost
    # Against this test's clock: the ledger's span lies inside the one measured out here, and
    # covers all but 2% of it; so do its parts together.
    outside = t_end - t_first
    assert abs(b["wall_s"] - outside) <= 0.02 * outside, (b, outside)
    assert abs(sum(b["parts"].values()) - outside) <= 0.02 * outside, (b, outside)
    slack = 0.05                        # /proc start times have 10 ms ticks; float seconds in JSON
    assert rec["segments"][0]["start"] >= t_first - slack, (rec["segments"][0], t_first)
    assert first["start"] <= first["first_step"] <= t_first_gone and first.get("exited", 0) <= t_first_gone + slack
    assert again["start"] >= t_second - slack and again["exited"] <= t_end + slack, (again, t_second, t_end)
    # The gap seen out here, from the first launcher's exit to the second's start, is between runs.
    assert b["parts"]["between runs"] >= (t_second - t_first_gone) - slack, (b, t_second - t_first_gone)
    assert b["parts"]["between runs"] >= 1.0          # the gap, and the kill's own time
    # The second run trained at most for as long as it ran, by the outside clock.
    assert b["parts"]["training"] <= (t_end - t_second) + (t_first_gone - t_first), b
    assert len(b["parts"]) == 7 and all(v >= 0 for v in b["parts"].values()), b

    status = hpc("status", str(rd), timeout=60)
    assert status.returncode == 0, show(status)
    line = next(x for x in status.stdout.splitlines() if "goodput:" in x)
    assert "% training" in line and "% redone" in line and "2 runs" in line
    table = hpc("status", str(rd), "--goodput", timeout=60)
    assert "steps redone after a restart: %d" % lost in table.stdout, table.stdout


def test_a_graceful_stop_redoes_nothing(tmp_path):
    cfg = write_config(tmp_path / "job.yaml", {"train": {"max_steps": 300}, "checkpoint": {"every_steps": 100}})
    rd = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "hpc_train", "run", str(cfg), "--nproc", "2", "--run-dir", str(rd)],
                         cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not ((rd / "metrics.jsonl").exists() and len(_metric_steps(rd)) >= 30):
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=120)
    second = hpc("run", str(cfg), "--nproc", "2", "--run-dir", str(rd), timeout=300)
    assert second.returncode == 0, show(second)
    rec = json.loads((rd / goodput.FILE).read_text())
    assert [s["redone_steps"] for s in rec["segments"]] == [0, 0]
    assert all(s["closed"] for s in rec["segments"])
    assert rec["segments"][0]["save_block_s"] > 0       # the stop's save blocked, and is counted
    # Each run's start-up milestones, in the order they pass (benchmarks/preemption.py reads them
    # as the restart's phases): process start, worker, torch, group, restore, loaded, first step.
    for s in rec["segments"]:
        m = s["marks"]
        order = [s["start"], m["process"], m["worker"], m["torch"], m["group"], m["restore"], m["loaded"],
                 s["first_step"]]
        assert order == sorted(order), s
        assert s["first_step"] - s["start"] < 120
