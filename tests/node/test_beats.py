"""Heartbeats through the rendezvous store (issue 32, item 1), against a real ``TCPStore`` served
by another process: beats are read back as ages, a rank that never beat is counted from the
watch's start, a stale one is named, and a store whose host is frozen (SIGSTOP: it then answers
nothing, with no timeout of its own) names its host within the read's wait instead of hanging
the watcher. A run's rank records are not touched while it trains."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_train.launch.local import free_port
from hpc_train.node import beats, liveness

SERVE = ("import sys, time, torch.distributed as d; "
         "s = d.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=True, wait_for_workers=False); "
         "print('up', flush=True); time.sleep(120)")


@pytest.fixture
def store():
    port = free_port()
    p = subprocess.Popen([sys.executable, "-c", SERVE, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
        yield p, port
    finally:
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.wait()


@pytest.mark.procs
def test_store_beats_are_read_as_ages_and_a_silent_peer_is_named(store, monkeypatch):
    _, port = store
    monkeypatch.setattr(liveness, "BEAT_S", 0.1)
    one = beats.StoreBeats("127.0.0.1", port, 1, "hpc_train/beats/", 0).start()
    two = beats.StoreBeats("127.0.0.1", port, 2, "hpc_train/beats/", 0).start()
    watcher = beats.StoreBeats("127.0.0.1", port, 0, "hpc_train/beats/", 0)   # reads; never started
    since = time.time()
    time.sleep(0.5)
    ages = watcher.ages([1, 2, 3])
    assert 0 <= ages[1] < 0.5 and 0 <= ages[2] < 0.5 and ages[3] is None, ages
    assert beats.stale(watcher, [1, 2], 1.0, since) is None
    # Rank 3 never beat: counted from the watch's start, and named once that is past the limit.
    assert beats.stale(watcher, [1, 2, 3], 0.4, since)[0] == 3
    two.stop()
    time.sleep(1.5)
    found = beats.stale(watcher, [1, 2], 1.0, since)
    assert found is not None and found[0] == 2 and found[1] > 1.0, found
    one.stop()


def test_reads_make_no_thread_each(store):
    """Every read goes through one reader thread, made at the first read and kept, also past
    stop(): a process stopped while it was making a thread once crashed faulthandler's stack
    dump (the frozen rank's stack, which the watchdog asks for), on the half-made thread's state."""
    import threading
    _, port = store
    watcher = beats.StoreBeats("127.0.0.1", port, 0, "hpc_train/beats/", 0)
    made = []
    real = threading.Thread.start

    def counted(self):
        made.append(self)
        return real(self)
    threading.Thread.start = counted
    try:
        for _ in range(20):
            assert watcher.ages([1]) == {1: None}
    finally:
        threading.Thread.start = real
    assert [t.name for t in made] == ["hpc_train-beats-read"], made
    # stop() ends the beating, not the reads: rank 0's Slurm watchdog reads on after its Run closed.
    watcher.stop()
    assert watcher.ages([1]) == {1: None}
    assert made[0].is_alive()


def _stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped: kill() returns when the
    signal is sent, and on a loaded machine the store's server thread could still answer one
    more request after that."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = []
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            try:
                states.append(stat.read_text().rpartition(")")[2].split()[0])
            except OSError:
                continue
        if states and all(st in ("T", "t") for st in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} did not stop within 10 s")


@pytest.mark.procs
def test_a_frozen_store_names_its_host_instead_of_hanging_the_watcher(store):
    server, port = store
    watcher = beats.StoreBeats("127.0.0.1", port, 1, "hpc_train/beats/", 0)
    beats.StoreBeats("127.0.0.1", port, 0, "hpc_train/beats/", 0).start().stop()
    _stop(server.pid)
    t0 = time.monotonic()
    found = beats.stale(watcher, [0], 60.0, time.time())
    took = time.monotonic() - t0
    assert found == (0, liveness.READ_WAIT_S), found
    assert took < liveness.READ_WAIT_S + 2, took
    # torchrun's agent hosts the store: no rank to blame, so the caller hears of it.
    agent = beats.StoreBeats.__new__(beats.StoreBeats)
    agent.__dict__.update(watcher.__dict__, host_rank=None)
    with pytest.raises(beats.Silent, match=f"127.0.0.1:{port} did not answer"):
        beats.stale(agent, [0], 60.0, time.time())


@pytest.mark.procs
def test_a_training_run_touches_no_rank_record_while_it_trains(tmp_path):
    """The records are written at a rank's start and end only: their mtimes do not move while
    the ranks train (the beats go to the store)."""
    from helpers import clean_env, start, write_config
    cfg = write_config(tmp_path / "job.yaml", {"train": {"max_steps": 100000}, "checkpoint": {"every_steps": 0}})
    rd = tmp_path / "run"
    p = start("run", cfg, "--nproc", "2", "--run-dir", rd, env=clean_env())
    try:
        log0 = rd / "logs" / "rank-0.log"
        deadline = time.monotonic() + 120
        while not (log0.exists() and "step 50/" in log0.read_text()):
            assert p.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.1)
        recs = sorted((rd / "logs" / ".heartbeat").iterdir())
        assert [r.name for r in recs] == ["rank-0", "rank-1"]
        before = [r.stat().st_mtime_ns for r in recs]
        time.sleep(3 * liveness.BEAT_S)
        assert p.poll() is None
        assert [r.stat().st_mtime_ns for r in recs] == before
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)


@pytest.mark.procs
def test_a_script_s_supervisors_beat_in_node_memory_not_on_the_run_directory(tmp_path):
    """``run --script``: the supervising workers beat in the job's private directory in node
    memory (here: $TMPDIR), not on their rank records: the records' mtimes do not move over three
    beats while the beats there are fresh; the launcher, reading them, lets the run go on; nothing
    of it is left in node memory after the run (issue 48.4)."""
    from helpers import clean_env, start
    script = tmp_path / "loop.py"
    script.write_text("import os, pathlib, sys, time\npathlib.Path(sys.argv[1] + os.environ['RANK']).touch()\n"
                      "while True:\n    time.sleep(0.2)\n")
    node_mem, rd, up = tmp_path / "mem", tmp_path / "run", tmp_path / "up"
    node_mem.mkdir()
    p = start("run", "--script", script, "--nproc", "2", "--run-dir", rd, "--", up, env=clean_env(TMPDIR=str(node_mem)))
    try:
        deadline = time.monotonic() + 60
        while not all(Path(f"{up}{r}").exists() for r in (0, 1)):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate(timeout=30)
            time.sleep(0.1)
        recs = sorted((rd / "logs" / ".heartbeat").iterdir())
        assert [r.name for r in recs] == ["rank-0", "rank-1"]
        before = [r.stat().st_mtime_ns for r in recs]
        time.sleep(3 * liveness.BEAT_S)
        assert p.poll() is None, p.communicate(timeout=30)
        assert [r.stat().st_mtime_ns for r in recs] == before
        found = sorted(node_mem.glob("hpc_train-p*/run-*/*/.beats/rank-*"))
        assert [f.name for f in found] == ["rank-0", "rank-1"], found
        assert all(time.time() - f.stat().st_mtime < 2 * liveness.BEAT_S for f in found)
        assert oct(found[0].parent.stat().st_mode & 0o777) == "0o700"
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
    assert list(node_mem.iterdir()) == []


def test_node_beats_are_read_back_and_a_missing_one_from_the_record(tmp_path):
    """Two ranks beat in node memory; a third that never made its file there is read from its
    rank record (where it beats when node memory is refused)."""
    from hpc_train.records import ranks
    node, rd = tmp_path / "mem" / "hpc_train-p1" / "run-a" / "n1", tmp_path / "run"
    (tmp_path / "mem").mkdir()
    ranks.begin(rd, 2, 3)
    ranks_here = [beats.NodeBeats(node, rd, r).start() for r in (0, 1)]
    assert sorted(f.name for f in (node / ".beats").iterdir()) == ["rank-0", "rank-1"]
    assert not (rd / "logs" / ".heartbeat" / "rank-0").exists()
    ages = beats.NodeBeats(node, rd, -1).ages([0, 1, 2, 3], now=time.time() + 10)
    assert all(9 < ages[r] < 12 for r in (0, 1, 2)) and ages[3] is None
    # Each rank's end removes its file, and the last one the directories left empty; a local
    # tier's item beside them keeps its own.
    (node / "rank-0").mkdir()
    ranks_here[0].stop()
    assert [f.name for f in (node / ".beats").iterdir()] == ["rank-1"]
    ranks_here[1].stop()
    assert [f.name for f in node.iterdir()] == ["rank-0"]
    (node / "rank-0").rmdir()
    beats.NodeBeats(node, rd, 0).start().stop()
    assert list((tmp_path / "mem").iterdir()) == []


def test_node_memory_that_is_not_ours_is_refused_and_the_rank_beats_on_its_record(tmp_path, caplog):
    """Another user's symlink planted where the job's directory goes: nothing is written through
    it; the rank beats on its record instead, and says so once."""
    from hpc_train.records import ranks
    mem, elsewhere, rd = tmp_path / "mem", tmp_path / "elsewhere", tmp_path / "run"
    mem.mkdir()
    elsewhere.mkdir()
    (mem / "hpc_train-p1").symlink_to(elsewhere)
    ranks.begin(rd, 0, 1)
    rec = ranks.path(rd, 0)
    os.utime(rec, (1, 1))
    with caplog.at_level("WARNING", logger="hpc_train"):
        b = beats.NodeBeats(mem / "hpc_train-p1" / "run-a" / "n1", rd, 0).start()
    b.stop()
    assert list(elsewhere.iterdir()) == []
    assert rec.stat().st_mtime > 1
    assert "is a symlink" in caplog.text and "beating on the run directory's files instead" in caplog.text
    assert 0 <= b.ages([0])[0] < 5
