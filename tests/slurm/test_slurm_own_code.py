"""Issue 8 on the real local cluster: a user's own loop (`--script` and `hpc_train.submit(main)`) and
a torchrun-style script that knows nothing of hpc_train, preempted by `high` jobs, requeued, and
finished COMPLETED; the own loop bitwise equal to a local straight run at the same world size."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from slurm_helpers import PY, ROOT, assert_bitwise, damage_shared_tier, export, losses, q

pytestmark = pytest.mark.slurm

CHARLM = str(ROOT / "jobs" / "charlm.py")
STEPS = 1500
SETS = ["--set", "log.tensorboard=false", "--set", "train.log_every=100", "--set", "checkpoint.every_steps=500"]


def _steps(run_dir: Path) -> int:
    try:
        return max(losses(run_dir), default=0)
    except FileNotFoundError:
        return 0


def _preempt_at(slurm, job_id: str, run_dir: Path, at_steps: list[int]) -> None:
    """For each step count: wait until the job runs past it, then take both nodes with a `high` job."""
    for step in at_steps:
        slurm.wait_state(job_id, {"RUNNING"}, 120)
        deadline = time.monotonic() + 240
        while _steps(run_dir) < step:
            assert time.monotonic() < deadline, f"no progress past step {_steps(run_dir)} in {run_dir}"
            time.sleep(0.3)
        slurm.preempt_all()


def _stop_resume_pairs(run_dir: Path) -> list[tuple[int, int]]:
    log = (run_dir / "logs" / "rank-0.log").read_text()
    saved = [int(s) for s in re.findall(r"checkpoint saved by \S+ at step (\d+)", log)]
    resumed = [int(s) for s in re.findall(r"resumed from step (\d+) ", log)]
    return list(zip(saved, resumed))


@pytest.fixture(scope="module")
def local_reference(cluster, tmp_path_factory):
    """The own loop, straight, locally with 2 processes: what every Slurm run must equal."""
    d = tmp_path_factory.mktemp("charlm-ref")
    r = cluster.cli("run", "--script", CHARLM, "--nproc", "2", *SETS, "--run-dir", d / "run", "--",
                    "--steps", str(STEPS), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return losses(d / "run"), export(cluster, d / "run", d / "ref.pt")


def _check_finished_bitwise(slurm, job_id: str, run_dir: Path, tmp_path: Path, ref) -> None:
    assert slurm.wait_done(job_id, 400) == "COMPLETED"
    runs = slurm.sacct(job_id)
    assert [r["State"] for r in runs][-1] == "COMPLETED" and len(runs) == 3, runs
    pairs = _stop_resume_pairs(run_dir)
    assert len(pairs) == 2 and all(s == r for s, r in pairs), pairs
    counts = json.loads((run_dir / "requeue.json").read_text())["counts"]
    assert counts == {"preemption": 2, "timeout": 0, "failure": 0}, counts
    assert not (run_dir / "stopped.json").exists(), "a stale stopped.json after the run finished"
    assert len(json.loads((run_dir / "goodput.json").read_text())["segments"]) >= 3
    ref_losses, ref_weights = ref
    assert losses(run_dir) == ref_losses
    assert_bitwise(ref_weights, export(slurm, run_dir, tmp_path / "job.pt"))


def _kill_rank1_at(slurm, job_id: str, run_dir: Path, step: int, after_kill=None) -> int:
    """Once the job trains past ``step``: kill -9 rank 1's training process (its newest on-node
    line names it), call ``after_kill``, then wait until the batch shell restarts the step in
    place. Returns the newest step in metrics.jsonl just before the kill: rank 0 logs a step
    after its step_end, whose agreement rank 1 had joined, so rank 1 got at least that far."""
    slurm.wait_state(job_id, {"RUNNING"}, 120)
    deadline = time.monotonic() + 240
    while _steps(run_dir) < step:
        assert time.monotonic() < deadline, f"no progress past step {_steps(run_dir)} in {run_dir}"
        time.sleep(0.3)
    line = [x for x in (run_dir / "logs" / "rank-1.log").read_text().splitlines() if "on-node" in x][-1]
    seen = _steps(run_dir)
    os.kill(int(re.search(r"pid (\d+)", line).group(1)), signal.SIGKILL)
    if after_kill is not None:
        after_kill()
    deadline = time.monotonic() + 120
    while not json.loads((run_dir / "requeue.json").read_text()).get("in_place"):
        assert time.monotonic() < deadline, "the killed rank's step was not restarted in place"
        time.sleep(0.5)
    return seen


def test_own_loop_script_preempted_then_killed_is_bitwise(slurm, local_reference, tmp_path):
    """Preempted once (requeued through the queue), then rank 1 killed -9 (restarted in place, in
    the same allocation): COMPLETED, one requeue, and bitwise the straight local run. With the
    node-local tier every 5 steps and the shared tier every 200 (issue 30's crashed rank): the
    requeue, on nodes whose memory holds nothing of the run, resumes from the shared tier; the
    in-place restart from each rank's own node, at most 5 steps back, reading no item of the
    shared tier (each is damaged right after the kill: a read would fail its checksums); nothing
    of the tier is left behind."""
    run_dir = tmp_path / "job"
    r = slurm.cli("submit", "--script", CHARLM, "--nodes", "2", "--partition", "low", *SETS, "--run-dir", run_dir,
                  "--set", "checkpoint.every_steps=200", "--set", "checkpoint.local_every_steps=5",
                  "--set", "job.standby=true", "--", "--steps", str(STEPS))
    assert r.returncode == 0, r.stderr
    job = re.search(r"submitted job (\d+)", r.stdout).group(1)
    _preempt_at(slurm, job, run_dir, [300])
    flipped: list[Path] = []
    seen = _kill_rank1_at(slurm, job, run_dir, 900, lambda: flipped.extend(damage_shared_tier(run_dir)))
    assert any(f.suffix == ".distcp" for f in flipped), flipped
    assert slurm.wait_done(job, 400) == "COMPLETED"
    assert slurm.restarts(job) == 1 and len(slurm.sacct(job)) == 2, slurm.sacct(job)   # the preemption only
    assert len(slurm.job_steps(job)) >= 2, slurm.job_steps(job)     # the killed step and its restart
    rec = json.loads((run_dir / "requeue.json").read_text())
    assert rec["counts"] == {"preemption": 1, "timeout": 0, "failure": 0} and len(rec["in_place"]) == 1, rec
    pairs = _stop_resume_pairs(run_dir)
    assert len(pairs) == 1 and pairs[0][0] == pairs[0][1], pairs
    ref_losses, ref_weights = local_reference
    assert losses(run_dir) == ref_losses
    assert_bitwise(ref_weights, export(slurm, run_dir, tmp_path / "job.pt"))
    assert json.loads((run_dir / "result.json").read_text())["steps"] == STEPS
    log0 = (run_dir / "logs" / "rank-0.log").read_text()
    tiers = re.findall(r"resumed from step (\d+) \(\S+\), saved at world size 2 \((local|shared) tier", log0)
    assert [t for _, t in tiers] == ["shared", "local"], tiers
    log1 = (run_dir / "logs" / "rank-1.log").read_text()
    assert "skipping" not in log0 + log1 and "does not load" not in log0 + log1, (log0 + log1)[-3000:]
    # job.standby: the in-place restart (same nodes) was handed to the standby tasks started
    # beside the requeued run's first step; the requeue itself started afresh (a new job).
    for r, log in ((0, log0), (1, log1)):
        assert len(re.findall(rf"rank {r}: this step's process was a standby, started", log)) == 1, log[-3000:]
    # At most 5 steps redone (issue 30): charlm logs a step before its step_end, so rank 1 had
    # finished step seen - 1 at least, and step_end waits for the last local item's write.
    # (The goodput ledger's count of redone steps, from metrics.jsonl, also counts a step that
    # charlm logged but whose step_end the kill cut short: 6 here at most; the built-in trainer
    # logs after step_end, and tests/slurm/test_preemption.py asserts 5 of it.)
    assert int(tiers[1][0]) >= seen - 1 - 5, (tiers, seen)
    segments = json.loads((run_dir / "goodput.json").read_text())["segments"]
    redone = [s.get("redone_steps") for s in segments if s.get("redone_steps") is not None]
    print(f"local tier: killed at step {seen} or later, resumed in place from step {tiers[1][0]}; "
          f"steps redone per segment: {redone}")
    base = re.search(r"local checkpoint tier: step \d+ to (\S+)/hpc_train-", log0)[1]   # $TMPDIR or /dev/shm
    assert not list(Path(base).glob(f"hpc_train-{job}")), f"the job's local tier was left in {base}"


def test_python_api_callable_preempted_twice_is_bitwise(slurm, local_reference, tmp_path, monkeypatch):
    run_dir = tmp_path / "job"
    for k, v in slurm.env.items():
        monkeypatch.setenv(k, v)
    # The callable is pickled by reference: its module must import on the nodes too.
    monkeypatch.setenv("PYTHONPATH", f"{ROOT / 'jobs'}:{slurm.env['PYTHONPATH']}")
    monkeypatch.syspath_prepend(str(ROOT / "jobs"))
    import charlm

    import hpc_train
    job = hpc_train.submit(charlm.main, ["--steps", str(STEPS)], nodes=2, partition="low", run_dir=run_dir,
                           overrides=[s for s in SETS if s != "--set"])
    _preempt_at(slurm, job.job_id, run_dir, [300, 900])
    result = job.results()[0]          # the final run's return value: run.finish's result
    assert result["steps"] == STEPS and "loss" in result, result
    _check_finished_bitwise(slurm, job.job_id, run_dir, tmp_path, local_reference)


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def test_unaware_torchrun_script_is_requeued_then_restarted_in_place_from_its_snapshot(slurm, tmp_path):
    """A script that knows nothing of hpc_train: preempted (requeued), then, in the requeued job,
    rank 1's script process killed -9 (restarted in place, no second requeue); each restart
    resumes from the script's own snapshot, and the job completes."""
    run_dir, snap = tmp_path / "job", tmp_path / "snap.pt"
    r = slurm.cli("submit", "--script", str(ROOT / "jobs" / "ddp_snapshot.py"), "--nodes", "2", "--partition", "low",
                  "--run-dir", run_dir, "--", "--epochs", "10", "--epoch-sleep", "1.5", "--snapshot", snap)
    assert r.returncode == 0, r.stderr
    job = re.search(r"submitted job (\d+)", r.stdout).group(1)
    slurm.wait_state(job, {"RUNNING"}, 120)
    deadline = time.monotonic() + 120
    while not snap.exists():
        assert time.monotonic() < deadline, "no snapshot written"
        time.sleep(0.2)
    slurm.preempt_all()
    log0 = run_dir / "logs" / "rank-0.log"
    deadline = time.monotonic() + 180      # the requeued run resumed and trains an epoch further
    while not re.search(r"resuming training from snapshot at epoch \d+[\s\S]*epoch \d+ loss", log0.read_text()):
        assert time.monotonic() < deadline, log0.read_text()[-3000:]
        time.sleep(0.3)
    supervisor = int(re.search(r"pid (\d+)", [x for x in (run_dir / "logs" / "rank-1.log").read_text().splitlines()
                                               if "on-node" in x][-1]).group(1))
    script = _children(supervisor)
    assert len(script) == 1, script
    os.kill(script[0], signal.SIGKILL)
    assert slurm.wait_done(job, 400) == "COMPLETED"
    runs = slurm.sacct(job)
    assert len(runs) == 2 and runs[-1]["State"] == "COMPLETED", runs      # one requeue: the preemption
    rec = json.loads((run_dir / "requeue.json").read_text())
    assert rec["counts"]["preemption"] == 1 and rec["counts"]["failure"] == 0 and len(rec["in_place"]) == 1, rec
    log0 = log0.read_text()
    assert len(re.findall(r"resuming training from snapshot at epoch [1-9]", log0)) == 2, log0[-3000:]
    assert "epoch 9 loss" in log0
    for rank in (0, 1):       # torchrun's variables on every rank, under srun, in all three runs
        lines = [x for x in (run_dir / "logs" / f"rank-{rank}.log").read_text().splitlines()
                 if x.startswith("torchrun variables:")]
        assert len(lines) == 3, lines
        assert all(f"RANK={rank} LOCAL_RANK=0 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 GROUP_RANK={rank} MASTER_ADDR=node1 "
                   in x for x in lines), lines
    assert (run_dir / "result.json").exists()
    # A script that knows nothing of hpc_train: its supervisor keeps the run's records all the same.
    assert not (run_dir / "stopped.json").exists(), "a stale stopped.json after the run finished"
    segments = json.loads((run_dir / "goodput.json").read_text())["segments"]
    assert len(segments) == 3 and [bool(s.get("in_place")) for s in segments] == [False, False, True], segments


SAVES_ON_SIGTERM = """\
# A script that knows nothing of hpc_train and saves only when SIGTERM comes, as torchrun users
# are taught; it resumes from that snapshot when it starts again.
import json, os, signal, sys, time
snap, steps, rank = sys.argv[1], int(sys.argv[2]), int(os.environ["RANK"])
snap = snap.replace("{task}", os.environ.get("SLURM_ARRAY_TASK_ID", ""))   # one snapshot per array task
step, came_at = 0, None
def on_term(signum, frame):
    global came_at
    came_at = step
signal.signal(signal.SIGTERM, on_term)
if os.path.exists(snap):
    with open(snap) as f:
        step = json.load(f)["step"]
    print(f"resumed from snapshot at step {step}", flush=True)
while step < steps and came_at is None:
    time.sleep(0.1)
    step += 1
    if rank == 0:
        print(f"step {step}", flush=True)
if came_at is not None:
    if rank == 0:
        with open(snap + ".tmp", "w") as f:
            json.dump({"step": step}, f)
        os.replace(snap + ".tmp", snap)
        print(f"SIGTERM came at step {came_at}; saved snapshot at step {step}", flush=True)
    sys.exit(0)
print(f"done at step {step}", flush=True)
"""


def test_an_unmodified_script_saves_on_sigterm_when_preempted_and_is_requeued_once(slurm, tmp_path):
    """Issue 33.1: preemption sends job.signal (USR2) to every process of the step, the script
    included (preempt_send_user_signal). The script, which has no USR2 handler, is not killed by
    it: it gets SIGTERM from hpc_train, saves the step it had reached (within one), and the job
    is requeued exactly once and resumes from that snapshot to the end."""
    script, snap, run_dir = tmp_path / "saves_on_sigterm.py", tmp_path / "snap.json", tmp_path / "job"
    script.write_text(SAVES_ON_SIGTERM)
    steps = 200     # 15 s of steps left after step 50: the preemption lands within a second or two
    r = slurm.cli("submit", "--script", script, "--nodes", "2", "--partition", "low", "--run-dir", run_dir,
                  "--", snap, str(steps))
    assert r.returncode == 0, r.stderr
    job = re.search(r"submitted job (\d+)", r.stdout).group(1)
    slurm.wait_state(job, {"RUNNING"}, 120)
    log0 = run_dir / "logs" / "rank-0.log"
    deadline = time.monotonic() + 120
    while not (log0.exists() and re.search(r"^step 50$", log0.read_text(), re.M)):
        assert time.monotonic() < deadline, log0.read_text()[-3000:] if log0.exists() else "no rank-0.log"
        time.sleep(0.3)
    slurm.preempt_all()
    assert slurm.wait_done(job, 400) == "COMPLETED"
    runs = slurm.sacct(job)
    assert len(runs) == 2 and runs[-1]["State"] == "COMPLETED", runs       # requeued exactly once
    assert slurm.restarts(job) == 1
    rec = json.loads((run_dir / "requeue.json").read_text())
    assert rec["counts"] == {"preemption": 1, "timeout": 0, "failure": 0}, rec
    text = log0.read_text()
    came, saved = map(int, re.search(r"SIGTERM came at step (\d+); saved snapshot at step (\d+)", text).groups())
    assert 50 <= came <= saved <= came + 1, (came, saved)
    assert f"resumed from snapshot at step {saved}" in text and f"done at step {steps}" in text, text[-3000:]
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        assert "killed by SIGUSR2" not in log, log[-3000:]
        assert "SIGUSR2 received: passing SIGTERM to the script" in log, log[-3000:]
    assert (run_dir / "result.json").exists() and not (run_dir / "stopped.json").exists()


def _saved_stops(text: str) -> list[tuple[int, int]]:
    """The (step SIGTERM came at, step saved) of every stop in a SAVES_ON_SIGTERM script's log:
    at least one, each saved within one step of its signal, and each resumed from by the next run."""
    stops = [tuple(map(int, m)) for m in re.findall(r"SIGTERM came at step (\d+); saved snapshot at step (\d+)", text)]
    assert stops and all(came <= saved <= came + 1 for came, saved in stops), stops
    for _, saved in stops:
        assert f"resumed from snapshot at step {saved}" in text, text[-3000:]
    return stops


def _one_requeue_per_stop(text: str, steps: int, runs: list[dict[str, str]], run_dir: Path) -> dict:
    """A time-limit run of SAVES_ON_SIGTERM ended as it should: every run but the last ended at
    one stop, requeued once as the time limit's, and the last finished. A stop either saved
    (:func:`_saved_stops`) or came where the script could save nothing, as hpc_train's log says:
    - as the script ended ("done" printed, then SIGTERM while the interpreter shut down, its
      handler gone): nothing tells it from a stop mid-step, so the script resumes from its last
      snapshot. The signal's time follows slurmctld's 30-s tick and a requeue takes a fixed time,
      so a run that ended at the tick once ends there again: seen twice in a row in a rehearsal;
    - before the worker had started the script (a slow start): the script is not started.
    Returns requeue.json."""
    stops = _saved_stops(text)
    late = text.count(f"done at step {steps}") - 1
    early = text.count("came before the script started: not starting it")
    rec = json.loads((run_dir / "requeue.json").read_text())
    # What each run said, for a failure's message: the run directory is gone by the time one reads it.
    said = "\n".join([line for line in text.splitlines() if re.search(r"received|came|stopped|resumed|done at|running",
                                                                       line)] + [str(r) for r in runs])
    assert rec["counts"] == {"preemption": 0, "timeout": len(stops) + late + early, "failure": 0}, f"{rec}\n{said}"
    assert len(runs) == len(stops) + late + early + 1 and runs[-1]["State"] == "COMPLETED", said
    assert not rec.get("in_place") and f"done at step {steps}" in text and (run_dir / "result.json").exists(), said
    return rec


def test_unmodified_scripts_save_at_each_time_limit_stop_in_array_tasks_and_under_torchrun(slurm, tmp_path):
    """Issue 33.1, a time limit (1 minute, the signal 20 s ahead; slurmctld's tick moves it by up
    to 30 s) on both launchers at once, as two jobs side by side on the cluster:

    - the srun launcher, in array tasks: a sweep of two points, one node each, both running at
      once. job.signal (USR2) reaches every process of each task's step, the script included;
      the script, which has no USR2 handler, is not killed by it: it gets SIGTERM from hpc_train;
    - the standalone script of `sbatch --launcher torchrun`, submitted with plain sbatch on two
      nodes: Slurm's TERM reaches torchrun, which passes it to its worker, and the script gets
      SIGTERM from hpc_train.

    Each script saves the step it had reached (within one) at each stop that reached it mid-run
    (:func:`_one_requeue_per_stop` names the two stops that cannot save). Each stop is requeued as
    the time limit's (never as a preemption or a failure), once per stop, only that job or task,
    and each finishes from its own snapshots."""
    script, sweep_dir = tmp_path / "saves_on_sigterm.py", tmp_path / "sweep"
    script.write_text(SAVES_ON_SIGTERM)
    steps = 450
    snap = tmp_path / "snap-{task}.json"          # the script names its file by SLURM_ARRAY_TASK_ID
    r = slurm.cli("submit", "--script", script, "--nodes", "1", "--time", "1", "--signal-lead", "20",
                  "--sweep", "optim.lr=0.1,0.2", "--array-parallelism", "2", "--run-dir", sweep_dir,
                  "--", snap, str(steps))
    assert r.returncode == 0, r.stderr
    tasks = re.findall(r"submitted array task (\S+):", r.stdout)
    dirs = [Path(d) for d in re.findall(r" -> (.+)$", r.stdout, re.MULTILINE)]
    assert len(tasks) == 2 == len(dirs) and all("_" in t for t in tasks), r.stdout
    tr_snap, tr_dir, out = tmp_path / "snap.json", tmp_path / "job", tmp_path / "job.sbatch"
    r = slurm.cli("sbatch", "--script", script, "--launcher", "torchrun", "--nodes", "2", "--time", "1",
                  "--signal-lead", "20", "--run-dir", tr_dir, "-o", out, "--", tr_snap, str(steps))
    assert r.returncode == 0, r.stderr
    tr_job = slurm.run("sbatch", "--parsable", out, check=True).stdout.strip().split(";")[0]

    for task, run_dir in zip(tasks, dirs):
        assert slurm.wait_done(task, 600) == "COMPLETED", slurm.sacct(task)
        text = (run_dir / "logs" / "rank-0.log").read_text()
        rec = _one_requeue_per_stop(text, steps, slurm.sacct(task), run_dir)
        assert all(e["key"].startswith(task + ":") for e in rec["events"]), rec
        assert "killed by SIGUSR2" not in text and "SIGUSR2 received: passing SIGTERM to the script" in text, \
            text[-3000:]
        assert not (run_dir / "stopped.json").exists()
    assert (tmp_path / "snap-0.json").exists() and (tmp_path / "snap-1.json").exists()

    assert slurm.wait_done(tr_job, 600) == "COMPLETED", slurm.sacct(tr_job)
    text = (tr_dir / "logs" / "rank-0.log").read_text()
    _one_requeue_per_stop(text, steps, slurm.sacct(tr_job), tr_dir)


# tests/scripts/local_tier_loop.py on hpc_train.init(): shared saves every 4 steps, local every 3.
LOCAL_TIER_WRAPPER = f"""import sys
sys.path.insert(0, {str(ROOT / "tests" / "scripts")!r})
import hpc_train
hpc_train.init(overrides=["checkpoint.every_steps=4", "checkpoint.every_seconds=0", "checkpoint.local_every_steps=3",
                          "checkpoint.local_dir=" + sys.argv[3], "log.tensorboard=false"])
import local_tier_loop
local_tier_loop.main(int(sys.argv[1]), int(sys.argv[2]))
"""


def test_two_srun_steps_of_one_allocation_keep_their_own_local_items(slurm, tmp_path):
    """Issue 49.2 on the real cluster: one allocation (one node, one task) runs two plain
    ``python`` programs on ``hpc_train.init()``, each its own run directory, as ``srun`` steps: A is
    killed at step 7 (local items 3 and 6; its shared tier at 4), B runs to its end (which removes
    B's items: the job id, the tier's ID, is the same for both), then A runs again in the same
    allocation and resumes from its own local step 6, bitwise equal to B (the same loop, never
    killed). Before, both used ``hpc_train-JOB/NODE/rank-0`` and B's end deleted A's items."""
    shm = tmp_path / "shm"
    shm.mkdir()
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "loop.py").write_text(LOCAL_TIER_WRAPPER)
    step = f"srun --ntasks=1 {q(PY)} loop.py 12 7 {q(shm)}"
    script = tmp_path / "two.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=1 --ntasks=1 --time=5\n"
                      f"#SBATCH --output={q(tmp_path / 'job.out')}\n"
                      f"cd {q(tmp_path / 'a')} && LOCAL_TIER_KILL_RANK=0 {step} || echo \"a: $?\"\n"
                      f"cd {q(tmp_path / 'b')} && {step}\n"
                      f"cd {q(tmp_path / 'a')} && {step}\n")
    job = slurm.run("sbatch", "--parsable", str(script), check=True, cwd=tmp_path).stdout.strip()
    assert slurm.wait_done(job, 300) == "COMPLETED", (slurm.sacct(job), (tmp_path / "job.out").read_text()[-3000:])
    rd_a, rd_b = tmp_path / "a" / "runs" / "loop", tmp_path / "b" / "runs" / "loop"
    log_a = "".join(p.read_text() for p in sorted((rd_a / "logs").glob("rank-*.log")))
    assert re.search(r"resumed from step 6 \(\S+/rank-0/step-6\), saved at world size 1 \(local tier", log_a), log_a
    assert_bitwise(torch.load(rd_a / "final.pt", weights_only=True), torch.load(rd_b / "final.pt", weights_only=True))
    assert list(shm.iterdir()) == [], list(shm.rglob("*"))


def _training_pid(run_dir: Path, rank: int) -> int:
    """The pid of ``rank``'s own program (charlm.py, on ``init()``): the child of the rank's
    supervisor, whose newest on-node line names it."""
    line = [x for x in (run_dir / "logs" / f"rank-{rank}.log").read_text().splitlines() if "on-node" in x][-1]
    sup = int(re.search(r"pid (\d+)", line).group(1))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            kids = Path(f"/proc/{sup}/task/{sup}/children").read_text().split()
            if kids:
                return int(kids[0])
        time.sleep(0.2)
    raise AssertionError(f"rank {rank}'s supervisor {sup} has no child")


def _in_place_events(run_dir: Path) -> list[dict]:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((run_dir / "requeue.json").read_text()).get("in_place", [])
    return []


def _restarted(run_dir: Path, n: int, bound_s: float = 120) -> dict:
    deadline = time.monotonic() + bound_s
    while len(_in_place_events(run_dir)) < n:
        assert time.monotonic() < deadline, f"restart {n} in place did not come within {bound_s:.0f}s"
        time.sleep(0.3)
    return _in_place_events(run_dir)[n - 1]


def _after(run_dir: Path, step: int) -> None:
    deadline = time.monotonic() + 240
    while _steps(run_dir) < step:
        assert time.monotonic() < deadline, f"no progress past step {_steps(run_dir)} in {run_dir}"
        time.sleep(0.3)


def test_a_crash_and_a_hang_each_cost_at_most_one_step_bitwise(slurm, local_reference, tmp_path):
    """Issue 52's acceptance, in one job of the own loop (charlm.py on ``init()``, whose ranks seed
    their own dropout), 2 nodes and a spare, the DEFAULT checkpoint intervals (shared every 10
    minutes, local every 30 s: neither tier saves before a fault): kill -9 of rank 1's program,
    then rank 1 frozen with SIGSTOP (named by the hang watch, its floor lowered to 5 s). Each time
    the survivor saves the step it holds, and rank 1's from the state it kept; the restart resumes
    both from it (rank 1 on the spare after the crash, fetching its item from rank 0's node) and
    at most one step is redone; the job completes with Restarts=0 and ends bitwise equal to the
    straight local run. (A node set DOWN is not here: Slurm then kills every task of the step at
    once, SIGKILL, and the restart loads the tiers, as tests/slurm/test_preemption.py checks.)"""
    run_dir = tmp_path / "job"
    r = slurm.cli("submit", "--script", CHARLM, "--nodes", "2", *SETS, "--set", "checkpoint.every_steps=0",
                  "--set", "job.spare_nodes=1", "--set", "dist.hang_floor_s=5", "--set",
                  "checkpoint.local_on_failure=true", "--run-dir", run_dir,
                  "--", "--steps", str(STEPS))
    assert r.returncode == 0, r.stderr
    job = re.search(r"submitted job (\d+)", r.stdout).group(1)
    slurm.wait_state(job, {"RUNNING"}, 120)
    _after(run_dir, 300)
    os.kill(_training_pid(run_dir, 1), signal.SIGKILL)
    _restarted(run_dir, 1)
    _after(run_dir, _steps(run_dir) + 200)
    frozen = _training_pid(run_dir, 1)
    os.kill(frozen, signal.SIGSTOP)
    try:
        _restarted(run_dir, 2)
    finally:
        with contextlib.suppress(OSError):
            os.kill(frozen, signal.SIGCONT)
    assert slurm.wait_done(job, 400) == "COMPLETED"
    assert slurm.restarts(job) == 0 and len(slurm.sacct(job)) == 1, slurm.sacct(job)
    events = _in_place_events(run_dir)
    assert len(events) == 2, events
    log0 = (run_dir / "logs" / "rank-0.log").read_text()
    logs = log0 + (run_dir / "logs" / "rank-1.log").read_text()
    # The log's own lines (^): a supervisor quotes its script's last lines, indented, when it fails.
    saved = [int(s) for s in re.findall(r"^\[rank 0\] .*: saved step (\d+) to the node-local tier in [0-9.]+s: rank "
                                         r"0's item, and rank 1's from its state kept here", log0, re.M)]
    assert len(saved) == 2 and "rank 1 hung: saved step" in log0, log0[-3000:]
    resumed = re.findall(r"\[rank (\d)\] .*resumed from step (\d+) \(\S+\), saved at world size 2 \((\w+) tier", logs)
    assert sorted(resumed) == sorted((r, str(s), "local") for r in "01" for s in saved), (resumed, saved)
    assert re.search(rf"fetched step {saved[0]} of rank 1 from \S+ \(rank 0, its copy\)", logs), logs[-3000:]
    redone = [s.get("redone_steps", 0) for s in json.loads((run_dir / "goodput.json").read_text())["segments"]]
    # charlm logs a step before its step_end: one step logged and cut short counts as redone.
    assert len(redone) == 3 and max(redone) <= 1, redone
    print(f"issue 52 on Slurm: steps redone per fault {redone[:2]}, saved at steps {saved}")
    ref_losses, ref_weights = local_reference
    assert losses(run_dir) == ref_losses
    assert_bitwise(ref_weights, export(slurm, run_dir, tmp_path / "job.pt"))
