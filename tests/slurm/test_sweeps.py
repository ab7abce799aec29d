"""Sweeps as one array job, end to end on the real local cluster.

One 4-point sweep (P=2) is shared by most tests to keep the Slurm time short. The module
fixture runs the whole story once and records what it saw at each stage:

1. submit the sweep (task 3 is made to fail at step 25 while a marker file exists), and the
   same 4 points as 4 single ``submit``s, for the bitwise comparison;
2. once task 0 has trained 30 steps, send it what a preemption sends (``scancel --signal``);
3. when the array has ended: ``status`` (task 3 must show FAILED), then remove the marker and
   ``submit --resubmit-failed``; when that ends, ``status`` again.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import time
from datetime import datetime
from pathlib import Path

import pytest
from slurm_helpers import ROOT, assert_bitwise, export, losses

pytestmark = pytest.mark.slurm

PLUG = "tests.plugins_for_tests"
# ~70 ms per step (slow_data sleeps 2 ms per sample): long enough to interrupt task 0 mid-run.
BASE = [str(ROOT / "jobs" / "digits.yaml"), "--set", f"model.name={PLUG}:fail_while_marked",
        "--set", f"data.name={PLUG}:slow_data", "--set", "data.synthetic_size=256",
        "--set", "train.max_steps=120", "--set", "train.log_every=1", "--set", "train.eval=false",
        "--set", "log.tensorboard=false", "--set", "log.progress=lines", "--set", "checkpoint.every_steps=10",
        "--set", "job.requeue_failure=0", "--set", "job.restarts_in_place=0", "--nodes", "1"]
SWEEP = "grid:\n  optim.lr: [0.05, 0.1]\nseeds: [1, 2]\n"
POINTS = [("0.05", "1"), ("0.05", "2"), ("0.1", "1"), ("0.1", "2")]
FAILING = 3
FAIL_AT = 25


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(1)


def _ended(c, job_ids: list[str]) -> bool:
    out = c.run("squeue", "-h", "-j", ",".join(j.split("_")[0] for j in job_ids), "-o", "%i").stdout
    return not out.strip()


def _steps(run_dir: Path) -> int:
    try:
        return max(losses(run_dir), default=0)
    except FileNotFoundError:
        return 0


@pytest.fixture(scope="module")
def story(cluster, tmp_path_factory):
    c = cluster
    c.idle()
    tmp = tmp_path_factory.mktemp("sweeps")
    sweep_file, marker, sweep_dir = tmp / "sweep.yaml", tmp / "FAIL", tmp / "sweep"
    sweep_file.write_text(SWEEP)
    marker.write_text("fail")
    env = {**c.env, "HPC_TEST_SLOW_S": "0.002", "HPC_TEST_FAIL_MARKER": str(marker),
           "HPC_TEST_FAIL_RUN": "3-optim.lr=0.1,seed=2", "HPC_TEST_FAIL_AT_STEP": str(FAIL_AT)}
    t0 = time.monotonic()
    r = c.cli("submit", *BASE, "--sweep", sweep_file, "--array-parallelism", "2", "--run-dir", sweep_dir, env=env)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((sweep_dir / "sweep.json").read_text())
    tasks = [t["jobs"][0] for t in manifest["tasks"]]
    run_dirs = [Path(t["run_dir"]) for t in manifest["tasks"]]
    singles = []
    for i, (lr, seed) in enumerate(POINTS):   # the same points, one plain submit each (no failure marker)
        s = c.cli("submit", *BASE, "--set", f"optim.lr={lr}", "--set", f"seed={seed}", "--run-dir",
                  tmp / f"single-{i}", env={**c.env, "HPC_TEST_SLOW_S": "0.002"})
        assert s.returncode == 0, s.stderr
        singles.append(re.search(r"submitted job (\d+)", s.stdout).group(1))
    _wait(lambda: _steps(run_dirs[0]) >= 30, 180, "task 0 to reach step 30")
    # What a preemption sends to one task's step (preempt_send_user_signal + --signal=USR2), sent
    # to that task's process itself. Not `scancel --signal=USR2 1_0`: while the array still has
    # pending tasks, slurmctld signals the task but answers "Job can not be altered now, try again
    # later", and scancel retries every few seconds until the requeued run takes a second signal
    # (slurmctld.log, Slurm 22.05; the same with the task's own job id).
    line = next(x for x in (run_dirs[0] / "logs" / "rank-0.log").read_text().splitlines() if "on-node" in x)
    os.kill(int(re.search(r"pid (\d+)", line).group(1)), signal.SIGUSR2)
    _wait(lambda: _ended(c, tasks + singles), 300, "the array and the single jobs to end")
    first_status = c.cli("status", sweep_dir)
    marker.unlink()
    resub = c.cli("submit", "--resubmit-failed", sweep_dir, env=env)
    assert resub.returncode == 0, resub.stderr
    manifest2 = json.loads((sweep_dir / "sweep.json").read_text())
    _wait(lambda: _ended(c, manifest2["submissions"][-1]["jobs"]), 180, "the resubmitted task to end")
    final_status = c.cli("status", sweep_dir)
    print(f"sweep story took {time.monotonic() - t0:.0f}s")
    yield dict(tmp=tmp, dir=sweep_dir, tasks=tasks, run_dirs=run_dirs, singles=singles, submit=r,
               first_status=first_status, resubmit=resub, manifest=manifest2, final_status=final_status)
    c.run("scancel", "--user=root")


def _rows(status_out: str) -> dict[int, list[str]]:
    rows = {}
    for line in status_out.splitlines():
        f = line.split()
        if f and f[0].isdigit():
            rows[int(f[0])] = f
    return rows


def test_sweep_is_one_array_with_at_most_p_tasks_running(story, cluster):
    array = story["tasks"][0].split("_")[0]
    assert [t for t in story["tasks"]] == [f"{array}_{i}" for i in range(4)]
    rows = cluster.sacct(array)    # every run of every task, requeued runs included
    assert {r["JobID"] for r in rows} == set(story["tasks"])
    fmt = "%Y-%m-%dT%H:%M:%S"
    spans = [(datetime.strptime(r["Start"], fmt), datetime.strptime(r["End"], fmt)) for r in rows]
    # Intervals are [start, end): a task that starts in the second another ended does not overlap it.
    most = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    print(f"array {array}: {len(rows)} runs of 4 tasks, at most {most} running at once (sacct)")
    assert most == 2, f"{most} tasks ran at once (P=2): {rows}"


def test_preempting_one_task_requeues_only_it_and_it_finishes(story, cluster):
    tasks, run_dirs = story["tasks"], story["run_dirs"]
    runs = cluster.sacct(tasks[0])
    print(f"task {tasks[0]}: {len(runs)} runs ({', '.join(r['State'] for r in runs)})")
    assert [r["State"] for r in runs] == ["REQUEUED", "COMPLETED"], runs
    assert len(tasks) == 4 and all(len(cluster.sacct(t)) == 1 for t in tasks[1:])
    ev = json.loads((run_dirs[0] / "requeue.json").read_text())["events"]
    assert [(e["key"], e["cause"], e["requeued"]) for e in ev] == [(f"{tasks[0]}:0", "preemption", True)], ev
    assert not any(json.loads(p.read_text()).get("requeued_at") for p in
                   (d / "requeue.json" for d in run_dirs[1:]) if p.exists())
    assert json.loads((run_dirs[0] / "result.json").read_text())["steps"] == 120
    assert re.search(r"resumed from step (\d+) ", (run_dirs[0] / "logs" / "rank-0.log").read_text())
    # Tasks 0 and 1 start together and were packed onto one node in every run seen here: no two
    # tasks ever used the same rendezvous port.
    ports = [set(re.findall(r"rendezvous \S+:(\d+)", (d / "logs" / "rank-0.log").read_text())) for d in run_dirs]
    assert len(ports) == 4 and all(ports) and all(not ports[i] & ports[j] for i in range(4) for j in range(i + 1, 4)), ports
    row = _rows(story["first_status"].stdout)[0]
    assert row[1] == "COMPLETED" and row[5] == str(len(runs) - 1), story["first_status"].stdout   # restarts


def test_failed_task_shows_failed_and_only_it_is_resubmitted(story):
    first = _rows(story["first_status"].stdout)
    assert first[FAILING][1] == "FAILED", story["first_status"].stdout
    assert [first[i][1] for i in range(3)] == ["COMPLETED"] * 3
    assert "--resubmit-failed" in story["first_status"].stdout
    out = story["resubmit"].stdout
    assert re.findall(r"resubmitted task (\d+)", out) == [str(FAILING)], out
    m = story["manifest"]
    assert len(m["submissions"]) == 2 and m["submissions"][1]["resubmitted"] == [FAILING]
    assert [len(t["jobs"]) for t in m["tasks"]] == [1, 1, 1, 2]
    # It resumed from its last checkpoint before the failure (every 10 steps; it died at 25).
    log = (story["run_dirs"][FAILING] / "logs" / "rank-0.log").read_text()
    assert re.search(r"resumed from step 20 \(\S+step-20\)", log), log[-2000:]
    final = _rows(story["final_status"].stdout)
    assert [final[i][1] for i in range(4)] == ["COMPLETED"] * 4, story["final_status"].stdout


def test_each_task_is_bitwise_a_single_submit_of_its_point(story, cluster):
    tmp = story["tmp"]
    for i, run_dir in enumerate(story["run_dirs"]):
        assert cluster.wait_done(story["singles"][i], 10) == "COMPLETED"
        got = export(cluster, run_dir, tmp / f"task-{i}.pt")
        want = export(cluster, tmp / f"single-{i}", tmp / f"single-{i}.pt")
        assert_bitwise(got, want)
        # The point reached the config each task ran with.
        cfg = (run_dir / "config.yaml").read_text()
        assert f"lr: {POINTS[i][0]}" in cfg and f"seed: {POINTS[i][1]}" in cfg


def test_summary_is_sorted_by_the_metric_and_written_as_csv(story, cluster):
    r = cluster.cli("sweep", "summary", story["dir"], "--metric", "loss")
    assert r.returncode == 0, r.stderr
    final = {i: losses(d)[max(losses(d))] for i, d in enumerate(story["run_dirs"])}
    want = sorted(final, key=lambda i: final[i])
    with open(story["dir"] / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(row["task"]) for row in rows] == want
    assert [float(row["loss"]) for row in rows] == [final[i] for i in want]
    assert [(row["optim.lr"], row["seed"]) for row in rows] == [POINTS[i] for i in want]
    printed = [int(f[1]) for f in (line.split() for line in r.stdout.splitlines()) if f and f[0].isdigit()]
    assert printed == want, r.stdout


def _counting_path(tmp: Path, env: dict[str, str]) -> tuple[dict[str, str], Path]:
    """PATH wrappers that log each scheduler command, then run the devcluster shim of that name
    with themselves taken off PATH (the shim looks further along PATH for the real binary)."""
    wrap, log = tmp / "count", tmp / "calls.log"
    wrap.mkdir()
    for name in ("squeue", "sacct", "scontrol", "sinfo", "sbatch", "scancel", "sstat"):
        p = wrap / name
        p.write_text(f'#!/bin/sh\necho {name} >> "{log}"\nPATH="${{PATH#{wrap}:}}" exec {name} "$@"\n')
        p.chmod(0o755)
    return {**env, "PATH": f"{wrap}:{env['PATH']}"}, log


def test_status_of_100_tasks_asks_the_scheduler_twice(slurm, tmp_path):
    """One squeue and one sacct for the whole sweep. How long it takes is a benchmark
    (benchmarks/cli_latency.py), not asserted here: the machine is shared."""
    sweep_file = tmp_path / "s.yaml"
    sweep_file.write_text("seeds: [" + ", ".join(map(str, range(100))) + "]\n")
    sweep_dir = tmp_path / "sweep"
    r = slurm.cli("submit", *BASE, "--sweep", sweep_file, "--array-parallelism", "1", "--run-dir", sweep_dir)
    assert r.returncode == 0, r.stderr
    array = json.loads((sweep_dir / "sweep.json").read_text())["tasks"][0]["jobs"][0].split("_")[0]
    env, log = _counting_path(tmp_path, slurm.env)
    try:
        t = time.monotonic()
        st = slurm.cli("status", sweep_dir, env=env, timeout=120)    # a bound on a hang
        took = time.monotonic() - t
    finally:
        slurm.run("scancel", array)
    assert st.returncode == 0, st.stderr
    calls = log.read_text().split()
    print(f"status of 100 tasks: {took:.2f}s (information only), scheduler calls {calls}")
    assert sorted(calls) == ["sacct", "squeue"], calls
    rows = _rows(st.stdout)
    assert len(rows) == 100 and sum(row[1] == "PENDING" for row in rows.values()) >= 98, st.stdout


def test_more_points_than_max_array_size_is_refused(slurm, tmp_path):
    size = int(re.search(r"MaxArraySize\s*=\s*(\d+)", slurm.run("scontrol", "show", "config").stdout).group(1))
    sweep_file = tmp_path / "s.yaml"
    sweep_file.write_text("seeds: [" + ", ".join(map(str, range(size + 1))) + "]\n")
    r = slurm.cli("submit", *BASE, "--sweep", sweep_file, "--run-dir", tmp_path / "sweep")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"hpc_train: error: the sweep has {size + 1} points but this cluster's "
                                f"MaxArraySize is {size} (scontrol show config); split the sweep or ask the admins")
    assert not (tmp_path / "sweep").exists()
    assert not slurm.run("squeue", "-h").stdout.strip()


SCRIPT = """\
import json, os, socket
from pathlib import Path
import hpc_train

run = hpc_train.init()
Path(run.run_dir, f"seen-{run.rank}.json").write_text(json.dumps(dict(
    lr=run.config.optim.lr, world=run.world_size, port=os.environ["MASTER_PORT"], host=socket.gethostname())))
run.finish({"loss": run.config.optim.lr})
"""


def test_script_sweep_of_two_node_tasks(slurm, tmp_path):
    """--script: the points reach the script as run.config; each task spans both nodes."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    sweep_dir = tmp_path / "sweep"
    r = slurm.cli("submit", "--script", script, "--nodes", "2", "--sweep", "optim.lr=0.2,0.1",
                  "--array-parallelism", "2", "--run-dir", sweep_dir, "--wait", timeout=240)
    assert r.returncode == 0, r.stderr + r.stdout
    tasks = json.loads((sweep_dir / "sweep.json").read_text())["tasks"]
    seen = [[json.loads((Path(t["run_dir"]) / f"seen-{rank}.json").read_text()) for rank in (0, 1)] for t in tasks]
    assert [[s["lr"] for s in ranks] for ranks in seen] == [[0.2, 0.2], [0.1, 0.1]]
    assert all(s["world"] == 2 for ranks in seen for s in ranks)
    assert all(len({s["host"] for s in ranks}) == 2 for ranks in seen)   # two of the cluster's nodes
    assert seen[0][0]["port"] != seen[1][0]["port"]        # each task its own rendezvous port
    st = slurm.cli("status", sweep_dir)
    assert [row[1] for row in _rows(st.stdout).values()] == ["COMPLETED", "COMPLETED"], st.stdout
    summ = slurm.cli("sweep", "summary", sweep_dir)
    assert [int(f[1]) for f in (x.split() for x in summ.stdout.splitlines()) if f and f[0].isdigit()] == [1, 0]
