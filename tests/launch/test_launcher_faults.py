"""Issue 9 (launcher side): one run per directory, no hang past dist.timeout_s + 60 s with the
culprit named, stops that do not come through the launcher, SIGHUP, divergence, unsafe paths.

Real processes throughout: `python -m hpc_train run --nproc 2`, real signals (SIGSTOP freezes a
rank for real: the fault the watchdog exists for), real files. Each hang case prints its measured
time to the end of the run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import REPO, children, clean_env, hpc, load_full, one_line_exit2, show, start, write_config

from hpc_train.ckpt import store
from hpc_train.errors import EXIT_STOPPED


def _wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _worker_pid(run_dir: Path, rank: int) -> int:
    hb = run_dir / "logs" / ".heartbeat" / f"rank-{rank}"

    def written() -> bool:
        try:
            return "pid" in json.loads(hb.read_text())
        except (OSError, ValueError):
            return False
    _wait_for(written, 60, f"rank {rank}'s heartbeat")
    return json.loads(hb.read_text())["pid"]


BIG = {"model": {"name": "mlp", "hidden": 2048, "dropout": 0.1}, "train": {"max_steps": 100000, "log_every": 50},
       "checkpoint": {"every_steps": 1, "keep": 2}, "dist": {"timeout_s": 15}}


@pytest.mark.procs
def test_busy_run_directory_is_refused_and_a_stale_lock_is_not(tmp_path):
    cfg = write_config(tmp_path / "job.yaml", {"train": {"max_steps": 100000}})
    rd = tmp_path / "run"
    first = start("run", cfg, "--nproc", "2", "--run-dir", rd)
    try:
        _wait_for(lambda: (rd / "checkpoints" / "step-5" / "commit.json").exists(), 120, "a first checkpoint")
        for argv in (("run", cfg, "--nproc", "2", "--run-dir", rd), ("run", cfg, "--run-dir", rd, "--resume", "none")):
            line = one_line_exit2(hpc(*argv), f"{rd} is in use by", f"pid {first.pid} on host {os.uname().nodename}")
            assert "python -m hpc_train run" in line
        assert not list(rd.glob("checkpoints.old-*"))      # --resume none moved nothing aside
        assert first.poll() is None                          # the holder trains on, undisturbed
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    assert first.returncode == EXIT_STOPPED and "checkpoint saved at step" in err, err
    # The holder is gone: its lock went with it, though the file still names it.
    assert json.loads((rd / ".lock").read_text())["pid"] == first.pid
    p = hpc("run", cfg, "--nproc", "2", "--run-dir", rd, "--set", "train.max_steps=1")
    assert p.returncode == 0 and "finished" not in p.stderr, show(p)


@pytest.mark.procs
def test_sighup_stops_the_workers_like_ctrl_c(tmp_path):
    cfg = write_config(tmp_path / "job.yaml", {"train": {"max_steps": 100000}})
    rd = tmp_path / "run"
    p = start("run", cfg, "--nproc", "2", "--run-dir", rd)
    _wait_for(lambda: (rd / "checkpoints" / "step-5" / "commit.json").exists(), 120, "a first checkpoint")
    workers = children(p.pid)
    p.send_signal(signal.SIGHUP)                # the terminal closed
    out, err = p.communicate(timeout=120)
    assert p.returncode == EXIT_STOPPED, err
    k = json.loads((rd / "stopped.json").read_text())["steps"]
    assert f"checkpoint saved at step {k}; run the same command to resume" in err
    time.sleep(0.5)
    assert not [w for w in workers if Path(f"/proc/{w}").exists()], "workers left running as orphans"


@pytest.mark.procs
def test_sigterm_to_one_worker_ends_the_run_unfinished_and_says_so(tmp_path):
    cfg = write_config(tmp_path / "job.yaml", {"train": {"max_steps": 100000}})
    rd = tmp_path / "run"
    p = start("run", cfg, "--nproc", "2", "--run-dir", rd)
    os.kill(_worker_pid(rd, 1), signal.SIGTERM)   # not through the launcher
    out, err = p.communicate(timeout=120)
    assert p.returncode != 0, err
    k = json.loads((rd / "stopped.json").read_text())["steps"]
    assert f"checkpoint saved at step {k}; run the same command to resume" in err or \
        "saved nothing this time; run the same command to resume" in err, err
    assert not (rd / "result.json").exists()


FROZEN_RANK = {"step": 1, "save": 0, "load": 1}


def _frozen(pid: int) -> bool:
    """The process is stopped (state T in /proc/PID/stat)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


@pytest.mark.parametrize("phase", ["step", "save", "load"])
@pytest.mark.procs
def test_a_stopped_rank_is_named_and_the_run_ends_in_time(tmp_path, phase):
    """SIGSTOP one rank: the run must end in time, naming that rank, with its Python stack in its
    log. "step" freezes rank 1 between steps with the default dist.timeout_s (600 s): the hang
    watch (issue 32) names it within 30 s (rank 1's heartbeat age when named), from rank 0's steps
    (no step ended for the 20-s floor) and rank 1's silent heartbeat, and the run ends within 45 s
    (the launcher's grace for the others included). The other phases have dist.timeout_s=15 and must end within
    75 s. "save" and "load" freeze the rank inside that phase: the user's own
    state object (tests/plugins_for_tests.py:FreezeIn, in the state of the `claims_loop` function)
    stops its process from its state_dict(), which the checkpointer calls while it saves (rank 0:
    `stateful` objects are saved from rank 0), or from its load_state_dict(), called while a
    checkpoint loads; the stack dump shows the frozen frame inside the checkpointer."""
    rank = FROZEN_RANK[phase]
    rd = tmp_path / "run"
    if phase == "step":
        cfg = write_config(tmp_path / "job.yaml", {**BIG, "checkpoint": {"every_steps": 0}, "dist": {}})
        argv = ("run", cfg, "--nproc", "2", "--run-dir", rd)
        env = clean_env()
    else:
        cfg = write_config(tmp_path / "job.yaml", {"train": {"max_steps": 100000}, "dist": {"timeout_s": 15},
                                                   "checkpoint": {"every_steps": 1, "keep": 2}})
        argv = ("run", "--fn", "tests.plugins_for_tests:claims_loop", cfg, "--nproc", "2", "--run-dir", rd)
        env = clean_env(HPC_TEST_SIGSTOP_IN=phase, HPC_TEST_SIGSTOP_RANK=str(rank),
                        HPC_TEST_SIGSTOP_AFTER="3" if phase == "save" else "1")
    if phase == "load":
        # The same state (FreezeIn included: the keys must match), with no phase: nothing freezes.
        first = hpc(*argv, "--set", "train.max_steps=3", env=clean_env(HPC_TEST_SIGSTOP_IN="none"))
        assert first.returncode == 0, show(first)
        (rd / "result.json").unlink()            # not finished: the next run resumes, loading step 3
        for hb in (rd / "logs" / ".heartbeat").iterdir():   # the first run's: _worker_pid must see the new one
            hb.unlink()
    p = start(*argv, env=env)
    pid = _worker_pid(rd, rank)
    if phase == "step":
        log0 = rd / "logs" / "rank-0.log"
        _wait_for(lambda: log0.exists() and "step 50/" in log0.read_text(), 120, "training")
        os.kill(pid, signal.SIGSTOP)
    else:
        marker = rd / f"frozen-{phase}-rank{rank}"
        def frozen() -> bool:
            assert p.poll() is None, f"the run ended before rank {rank} froze in {phase}: {p.communicate()[1][-3000:]}"
            return marker.exists() and bool(marker.read_text()) and _frozen(pid)
        _wait_for(frozen, 120, f"rank {rank} frozen in {phase}")
        assert int(marker.read_text()) == pid
    t0 = time.monotonic()
    try:
        out, err = p.communicate(timeout=90)
    finally:
        os.kill(pid, signal.SIGCONT) if Path(f"/proc/{pid}").exists() else None
    took = time.monotonic() - t0
    print(f"SIGSTOP during {phase}: the run ended {took:.1f} s later")
    assert took <= (45 if phase == "step" else 75), err   # a bound on a hang, not a speed
    assert p.returncode == 1, err
    assert f"worker rank {rank} failed (stopped responding): WatchdogError: rank {rank} (pid {pid} on " in err, err
    log = (rd / "logs" / f"rank-{rank}.log").read_text()
    assert "most recent call first" in log and "hpc_train/node/beats.py" in log   # faulthandler's stack dump (the heartbeat thread)
    if phase == "step":
        log0 = (rd / "logs" / "rank-0.log").read_text()
        named = re.search(rf"rank 1 \(pid {pid} on \S+\) hung: no heartbeat for (\d+)s while rank 0 waited \d+s in "
                          r"step \d+ \(limit 20s: dist.hang_floor_s", log0)
        assert named and int(named[1]) <= 30, log0[-3000:]      # named within 30 s of the freeze
    if phase != "step":
        # The frozen main thread's stack: inside the checkpointer's save or load, in the object's hook.
        hook, inside = {"save": ("state_dict", "_save"), "load": ("load_state_dict", "load")}[phase]
        assert re.search(rf'plugins_for_tests\.py", line \d+ in {hook}\n', log), log[-3000:]
        module = {"_save": "shared/save", "load": "load"}[inside]   # ckpt/shared/save.py's Checkpointer._save, ckpt/load.py's load
        assert re.search(rf'hpc_train/ckpt/{module}\.py", line \d+ in {inside}\n', log), log[-3000:]
    assert "Traceback" not in err
    complete = [info for info in store.scan(rd) if info.complete]
    if phase != "step":
        assert complete, "the saves before the freeze (or the checkpoint being loaded) are complete"
    for info in complete:                        # nothing half-written counts as complete
        load_full(info.path)


@pytest.mark.procs
def test_divergence_stops_the_run_and_saves_nothing_non_finite(tmp_path):
    cfg = write_config(tmp_path / "job.yaml", {"optim": {"lr": 1e30, "warmup_steps": 0}, "train": {"max_steps": 30},
                                               "checkpoint": {"every_steps": 1}})
    rd = tmp_path / "run"
    p = hpc("run", cfg, "--nproc", "2", "--run-dir", rd)
    assert p.returncode == 1, show(p)
    line = next(x for x in p.stderr.splitlines() if x.startswith("hpc_train: worker rank"))
    assert "NonFiniteError: training diverged at step" in line and "Lower optim.lr (now 1e+30)" in line
    assert "Traceback" not in p.stderr
    assert not (rd / "result.json").exists()
    diverged = int(re.search(r"training diverged at step (\d+)", line).group(1))
    # Nothing was saved for the diverged step, and the checkpoints before it are there: a loop
    # over none would pass on nothing.
    assert not (rd / "checkpoints" / f"step-{diverged}").exists(), sorted(os.listdir(rd / "checkpoints"))
    scanned = store.scan(rd)
    assert scanned and all(info.step < diverged for info in scanned), [i.step for i in scanned]
    assert [info for info in scanned if info.complete], "no complete checkpoint before the divergence"
    import torch
    for info in scanned:
        state = load_full(info.path)
        floats = [v for v in state.values() if torch.is_tensor(v) and v.is_floating_point()]
        assert floats and all(torch.isfinite(v).all() for v in floats)


@pytest.mark.parametrize("cmd", ["run", "sbatch", "submit --dry-run"])
def test_a_run_directory_with_a_newline_is_refused(tmp_path, cmd):
    rd = tmp_path / "a\nb"
    line = one_line_exit2(hpc(*cmd.split(), str(REPO / "jobs" / "digits.yaml"), "--run-dir", rd), "a\\nb")
    assert "single line" in line or "control characters" in line
    assert not rd.exists()


def test_a_run_directory_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    one_line_exit2(hpc("run", str(REPO / "jobs" / "digits.yaml"), "--run-dir", f), "is a file")
    assert f.read_text() == "x"


@pytest.mark.procs
def test_resume_with_a_changed_config_names_the_changes_and_refuses_what_cannot_load(tmp_path):
    cfg = write_config(tmp_path / "job.yaml", {"train": {"max_steps": 6}, "checkpoint": {"every_steps": 3}})
    rd = tmp_path / "run"
    p = hpc("run", cfg, "--nproc", "2", "--run-dir", rd)
    assert p.returncode == 0, show(p)
    (rd / "result.json").unlink()                       # so that the next command resumes
    before = sorted(str(x.relative_to(rd)) for x in rd.rglob("*") if x.is_file() and ".heartbeat" not in str(x))
    for change, name in (("optim.name=sgd", "optim.name: 'adam' -> 'sgd'"),
                         ("model.hidden=64", "model.hidden: 32 -> 64")):
        p = hpc("run", cfg, "--nproc", "2", "--run-dir", rd, "--set", change)
        line = one_line_exit2(p, name, "checkpoints cannot load")
        assert "Traceback" not in p.stderr and "KeyError" not in line
    after = sorted(str(x.relative_to(rd)) for x in rd.rglob("*") if x.is_file() and ".heartbeat" not in str(x))
    assert after == before                              # nothing written: no worker started
    # A hyperparameter change is named and applies from the resumed step on.
    p = hpc("run", cfg, "--nproc", "2", "--run-dir", rd, "--set", "optim.lr=0.0005", "--set", "train.max_steps=9",
            "--set", "optim.schedule=constant", "--set", "optim.warmup_steps=0")
    assert p.returncode == 0, show(p)
    assert "resuming with a changed config: optim.lr: 0.003 -> 0.0005 (applies from the resumed step on)" in p.stderr
    lrs = {m["step"]: m["lr"] for m in map(json.loads, (rd / "metrics.jsonl").read_text().splitlines()) if "lr" in m}
    assert [lrs[s] for s in (7, 8, 9)] == [0.0005] * 3, lrs


@pytest.fixture
def small_disk(tmp_path):
    """A real 700 KiB filesystem (tmpfs), and a read-only one: a full disk and a read-only mount
    are faults only a real filesystem gives."""
    if os.geteuid() != 0:
        # Like the Slurm tests (tests/slurm/conftest.py): under CI=true a missing privilege fails.
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true, but mounting a small tmpfs needs root: run the suite as root in CI")
        pytest.skip("mounting a small tmpfs needs root")
    full, ro = tmp_path / "full", tmp_path / "ro"
    full.mkdir()
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=700k", "tmpfs", str(full)], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(ro)], check=True)
    yield full, ro
    subprocess.run(["umount", "-l", str(full)])
    subprocess.run(["umount", "-l", str(ro)])


@pytest.mark.procs
def test_full_and_read_only_disks_are_one_line(small_disk):
    full, ro = small_disk
    p = hpc("run", str(REPO / "jobs" / "digits.yaml"), "--run-dir", ro / "run", "--set", "train.max_steps=2")
    one_line_exit2(p, str(ro / "run"), "Read-only file system", "writable --run-dir")
    p = hpc("run", str(REPO / "jobs" / "digits.yaml"), "--nproc", "2", "--run-dir", full / "run",
            "--set", "model.name=mlp", "--set", "model.hidden=256", "--set", "train.max_steps=30",
            "--set", "checkpoint.every_steps=5", "--set", "log.tensorboard=false")
    assert p.returncode == 1, show(p)
    assert "Traceback" not in p.stderr and "Logging error" not in p.stderr, show(p)
    line = next(x for x in p.stderr.splitlines() if x.startswith("hpc_train: worker rank"))
    assert "No space left on device" in line or "could not be recorded" in line, show(p)
    assert "No space left on device" in p.stderr, show(p)
    # The save that filled the disk left a step directory, which must not count as complete (a loop
    # over the complete ones alone would pass on nothing: here none is, the first save fails).
    scanned = store.scan(full / "run")
    assert [i for i in scanned if not i.complete], [(i.step, i.complete) for i in scanned]
    for info in scanned:         # nothing half-written counts as complete
        if info.complete:
            load_full(info.path)


@pytest.mark.procs
def test_a_full_disk_is_named_in_the_files_torch_writes(small_disk, tmp_path):
    """torch's own file writer reports a full disk as "enforce fail ... unexpected pos": the
    per-rank files of a save and `ckpt export` say "No space left on device" instead, and export
    leaves no partial file behind."""
    import torch
    from hpc_train.ckpt import common
    full, _ = small_disk
    big = {"w": torch.zeros(1 << 18)}                                   # 1 MiB > the 700 KiB disk
    with pytest.raises(RuntimeError, match="enforce fail|unexpected pos"):   # control: torch alone
        torch.save(big, full / "plain.pt")
    (full / "plain.pt").unlink()
    with pytest.raises(OSError) as e:
        common.save_pt(big, full / "rank-0.pt")
    assert "No space left on device" in str(e.value)
    (full / "rank-0.pt").unlink()            # partial; in a save it lies in an uncommitted step dir

    cfg = write_config(tmp_path / "job.yaml", {"model": {"hidden": 512}, "checkpoint": {"every_steps": 2}})
    p = hpc("run", cfg, "--nproc", "1", "--run-dir", tmp_path / "run", "--set", "train.max_steps=2")
    assert p.returncode == 0, show(p)
    out = full / "model.pt"
    p = hpc("ckpt", "export", tmp_path / "run", out)
    one_line_exit2(p, str(out), "No space left on device")
    assert list(full.iterdir()) == [], list(full.iterdir())             # no partial model.pt.tmp


def test_a_lost_peer_on_another_node_is_named_at_once_by_the_address_gloo_reports(tmp_path):
    """Issue 30 (8): a rank whose peer vanished names it and leaves at once, not after the peer's
    heartbeat goes stale (that wait was most of the 4 s from a kill to the step's end). Rank 1's
    record, as it began on another node, holds that node's address; gloo's error names it."""
    from hpc_train.node import watchdog
    from hpc_train.records import ranks
    from hpc_train.records.ranks import StepId
    step = StepId.from_env()
    beat = ranks.path(tmp_path, 1)
    beat.parent.mkdir(parents=True)
    rec = {"rank": 1, "host": "elsewhere", "node": "node2", "pid": 4242, "job": step.job, "restart": step.restart,
           "attempt": step.attempt, "launch": step.launch, "world_size": 2, "started": time.time(),
           "addr": "10.99.0.12"}
    beat.write_text(json.dumps(rec))
    error = ("RuntimeError: [../gloo/transport/tcp/pair.cc:537] Read error [10.99.0.12]:40595: "
             "Connection reset by peer")
    t0 = time.monotonic()
    line = watchdog.lost_peer_line(error, tmp_path, 2, 0)
    assert time.monotonic() - t0 < 0.5, "waited for a heartbeat to go stale"
    assert line.startswith("lost a peer: rank 1 (pid 4242 on node2) dropped its connection (RuntimeError"), line
    # An address no record holds names nobody, after at most the short wait for a local reaping.
    t0 = time.monotonic()
    other = watchdog.lost_peer_line(error.replace("10.99.0.12", "10.99.0.13"), tmp_path, 2, 0)
    assert time.monotonic() - t0 < 2 and other.startswith("lost a peer: a peer left (no record names it yet)"), other
    assert ranks.read(tmp_path, 1)[0].addr == "10.99.0.12"
    ranks.begin(tmp_path, 0, 2)
    assert ranks.read(tmp_path, 0)[0].addr == ranks.host_address()


@pytest.mark.quiet
@pytest.mark.procs
def test_the_hang_watch_names_no_slow_step_save_or_first_step(tmp_path):
    """Issue 32's false alarms, with the floor lowered to 3 s so that it could fire (and issue 31's:
    no straggler is named, at the default ratio and every 50 steps): over 1000
    steps on this (loaded) machine, every 100th step 20x longer, two 4-s saves (rank 0's: rank 1
    waits for it in the next step); then, resumed, a 4-s first step and a 4-s pause inside
    run.long_phase(): nothing is named and both runs finish. The unmarked 4-s pause is seen
    (a warning per rank that names nobody) and ends nothing."""
    rd = tmp_path / "run"
    cfg = write_config(tmp_path / "job.yaml", {"train": {"max_steps": 1000}, "dist": {"hang_floor_s": 3},
                                               "checkpoint": {"every_steps": 500}})
    argv = ("run", "--fn", "tests.plugins_for_tests:uneven_steps", cfg, "--nproc", "2", "--run-dir", rd)
    first = hpc(*argv, env=clean_env(HPC_TEST_SLOW_SAVE_S="4"))
    assert first.returncode == 0, show(first)
    (rd / "result.json").unlink()            # not finished: the next run resumes from step 1000
    second = hpc(*argv, "--set", "train.max_steps=1100", env=clean_env(
        HPC_TEST_FIRST_STEP_S="4", HPC_TEST_PAUSE_S="4", HPC_TEST_UNMARKED_AT="1040", HPC_TEST_MARKED_AT="1070"))
    assert second.returncode == 0, show(second)
    logs = "".join((rd / "logs" / f"rank-{r}.log").read_text() for r in (0, 1))
    assert "resumed from step 1000" in logs and "hung" not in logs and "HangError" not in logs, logs[-3000:]
    assert "straggler:" not in logs, logs[-3000:]     # issue 31: no rank slowed, none named over 1000 steps
    warned = [ln for ln in logs.splitlines() if "no step ended for" in ln]
    assert warned and all("in step 1040" in ln and "every peer still beats" in ln for ln in warned), warned
    assert len(warned) <= 2, warned          # once per rank at most


@pytest.mark.quiet
@pytest.mark.procs
def test_a_rank_slowed_by_half_is_named_as_a_straggler_about_2x_slower(tmp_path):
    """Issue 31: rank 1 of a 2-rank loop (DDP through run.wrap) is stopped half of the time, in
    20 ms slices, by this test (SIGSTOP/SIGCONT: a throttled node, for real). Rank 0 names it,
    slower than the other rank by the threshold or more, within 2 gatherings (every 20 steps here); the spread
    goes to metrics.jsonl. Its steps are still its own: the run finishes."""
    rd = tmp_path / "run"
    cfg = write_config(tmp_path / "job.yaml", {"train": {"max_steps": 100000}, "dist": {"straggler_every_steps": 20},
                                               "checkpoint": {"every_steps": 0}})
    p = start("run", "--fn", "tests.plugins_for_tests:run_api_loop", cfg, "--nproc", "2", "--run-dir", rd,
              env=clean_env())
    pid = _worker_pid(rd, 1)
    metrics, log0 = rd / "metrics.jsonl", rd / "logs" / "rank-0.log"

    def steps() -> int:
        rows = metrics.read_text().splitlines() if metrics.exists() else []
        return max((json.loads(x).get("step", 0) for x in rows if '"loss"' in x), default=0)
    try:
        _wait_for(lambda: steps() >= 60, 120, "60 steps")
        assert "straggler" not in log0.read_text()          # nobody slow yet
        began = steps()
        deadline = time.monotonic() + 60
        while "straggler: rank 1" not in log0.read_text():
            assert time.monotonic() < deadline and p.poll() is None, "rank 1 was never named"
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.02)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.02)
        os.kill(pid, signal.SIGCONT)
        _wait_for(lambda: "straggler_max_s" in metrics.read_text(), 30, "the spread in metrics.jsonl")
        st = hpc("status", rd)                              # the running run's slowest rank
        assert re.search(r"slowest rank at step \d+: rank \d on \S+, own step time [\d.]+ ms, median", st.stdout), show(st)
    finally:
        os.kill(pid, signal.SIGCONT)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    line = next(ln for ln in log0.read_text().splitlines() if "straggler: rank 1" in ln)
    m = re.search(r"rank 1 on (\S+) is ([\d.]+)x slower than the median of the other ranks .* since step (\d+)", line)
    assert m, line
    # Slower by the stops' share of its own time: 1.4-1.6x seen here (the loop's 10-ms sleep, which a
    # stop mostly overlaps, is own time too), less on a loaded machine; named at the 1.3 threshold.
    assert 1.3 <= float(m[2]) <= 3.5, line
    assert int(m[3]) <= began + 2 * 20, (line, began)       # within 2 gatherings of the slowing
    assert "straggler: rank 0" not in log0.read_text()
    spread = [json.loads(x) for x in metrics.read_text().splitlines() if "straggler_median_s" in x]
    assert spread and {"straggler_max_s", "straggler_slowest_rank"} <= set(spread[-1]), spread[-1:]
