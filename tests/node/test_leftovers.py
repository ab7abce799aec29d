"""What a run killed with -9 leaves in node memory is removed by the next process that uses the
base (hpc_train.config_local: enter, sweep, leftovers), and nothing else is: another user's
directory, a Slurm job's, a symlink, a live launcher's, or one a live program still holds after
its shell is gone. Real directories, real processes, real flocks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpc_train import config_local
from hpc_train.config_local import ALIVE, PREFIX


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _tree(base: Path, name: str) -> Path:
    job = base / name
    (job / "run-x" / "node1" / "rank-0" / "step-5").mkdir(parents=True)
    (job / "run-x" / "node1" / "rank-0" / "step-5" / "rank-0.pt").write_bytes(b"state")
    return job


# (name, a real directory, owned by this user, its pid alive) -> a leftover candidate
ROWS = [
    ("p100", True, True, False, True),
    ("p100", True, True, True, False),      # its launcher, agent or shell lives
    ("p100", False, True, False, False),    # a symlink or a file in its place
    ("p100", True, False, False, False),    # another user's
    ("12345", True, True, False, False),    # a Slurm job's: its batch script removes it
    ("p", True, True, False, False),
    ("p12x", True, True, False, False),
    ("p٣", True, True, False, False),       # a non-ASCII digit
    ("p0", True, True, False, False),
]


@pytest.mark.parametrize("pid, is_dir, mine, alive, want", ROWS)
def test_leftover_candidates_as_a_table(pid, is_dir, mine, alive, want):
    got = config_local.leftovers([(PREFIX + pid, is_dir, 1000 if mine else 1001)], 1000, lambda _: alive)
    assert got == ([PREFIX + pid] if want else [])


@given(st.lists(st.tuples(st.text(max_size=12), st.booleans(), st.integers(0, 3)), max_size=8),
       st.sets(st.integers(0, 1 << 22)))
def test_a_candidate_is_always_this_users_directory_of_a_gone_process(entries, alive):
    names = [(PREFIX + n, d, u) for n, d, u in entries]
    for name in config_local.leftovers(names, 0, lambda pid: pid in alive):
        i = [n for n, _, _ in names].index(name)
        _, is_dir, owner = names[i]
        pid = int(name[len(PREFIX) + 1:])
        assert is_dir and owner == 0 and pid not in alive and name.startswith(PREFIX + "p")


def test_the_next_user_of_a_base_removes_only_what_gone_runs_left(tmp_path):
    base = tmp_path / "shm"
    base.mkdir()
    # A program that outlives its shell: its ID's pid is gone, but it holds the directory. (It
    # enters first: its own enter sweeps the base too.)
    held = base / f"{PREFIX}p{_dead_pid()}"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from hpc_train import config_local as c; "
        f"node = Path({str(held)!r}) / 'run-y' / 'node1'; assert c.enter(node, node / 'rank-0') is None; "
        "print('held', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        gone = _tree(base, f"{PREFIX}p{_dead_pid()}")           # a launcher killed with -9
        live = _tree(base, f"{PREFIX}p{os.getpid()}")            # a live launcher's
        job = _tree(base, f"{PREFIX}4242")                        # a Slurm job's
        target = _tree(tmp_path, "elsewhere")
        (base / f"{PREFIX}p{_dead_pid()}").symlink_to(target)   # never followed
        theirs = _tree(base, f"{PREFIX}p{_dead_pid()}")
        os.chown(theirs, 65534, 65534)                            # another user's (this test runs as root)
        assert config_local.sweep(base) == [gone]
        assert not gone.exists()
        for kept in (live, job, theirs, held / "run-y" / "node1" / "rank-0", target / "run-x"):
            assert kept.exists(), kept
    finally:
        holder.kill()
        holder.wait()
    # Its holder gone (SIGKILL), the directory is a leftover like the others.
    assert config_local.sweep(base) == [held]


def test_a_process_that_leaves_takes_its_alive_file_and_directories_with_it(tmp_path):
    """enter -> remove_empty leaves nothing under the base; two users in one process (a tier and
    a supervisor's beats) and two processes keep the directory until the last one leaves."""
    base = tmp_path / "shm"
    base.mkdir()
    node = base / f"{PREFIX}p{os.getpid()}" / "run-x" / "node1"
    assert config_local.enter(node, node / "rank-0") is None
    assert config_local.enter(node, node / ".beats") is None
    assert (node.parent.parent / ALIVE).exists()
    other = subprocess.Popen([sys.executable, "-c", (
        "import time; from pathlib import Path; from hpc_train import config_local as c; "
        f"node = Path({str(node)!r}); assert c.enter(node, node / 'rank-1') is None; print('in', flush=True); "
        "input(); (node / 'rank-1').rmdir(); c.remove_empty(node); print('out', flush=True)")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "in"
        (node / ".beats").rmdir()
        config_local.remove_empty(node)                     # the beats leave; the tier stays
        (node / "rank-0").rmdir()
        config_local.remove_empty(node)                     # this process leaves; the other stays
        assert (node.parent.parent / ALIVE).exists() and (node / "rank-1").exists()
        other.stdin.write("\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == "out"
    finally:
        other.kill()
        other.wait()
    assert list(base.iterdir()) == [], list(base.rglob("*"))


def test_a_run_launcher_killed_with_9_leaves_node_memory_that_the_next_run_clears(tmp_path):
    """The guarantee through the public path: `run --script` of a loop on init() with the
    node-local tier, its launcher killed with -9 mid-run (its supervisors and programs die with
    it, leaving items and heartbeats); the next run on this base removes all of it."""
    from helpers import clean_env, write_config
    base = tmp_path / "shm"
    base.mkdir()
    cfg = write_config(tmp_path / "job.yaml", {"checkpoint": {"local_dir": str(base), "local_every_steps": 1}})
    root = Path(__file__).resolve().parents[2]
    loop = str(root / "tests" / "scripts" / "own_loop.py")
    env = clean_env(OWN_LOOP_STEPS="400", OWN_LOOP_SLEEP="0.05")
    p = subprocess.Popen([sys.executable, "-m", "hpc_train", "run", cfg, "--script", loop, "--nproc", "2",
                          "--run-dir", str(tmp_path / "a"), "--", "400", "0.05"], env=env, cwd=root,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while not list(base.glob(f"{PREFIX}p{p.pid}/*/*/rank-*/step-*")) and time.time() < deadline:
        time.sleep(0.2)
    assert list(base.glob(f"{PREFIX}p{p.pid}/*/*/rank-*/step-*")), list(base.rglob("*"))
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    time.sleep(1.0)
    assert (base / f"{PREFIX}p{p.pid}").exists()             # left behind by the kill
    q = subprocess.run([sys.executable, "-m", "hpc_train", "run", cfg, "--script", loop, "--nproc", "2",
                        "--run-dir", str(tmp_path / "b"), "--", "3", "0"], env=clean_env(OWN_LOOP_STEPS="3"),
                       cwd=root, capture_output=True, text=True, timeout=180)
    assert q.returncode == 0, q.stderr[-3000:]
    assert list(base.iterdir()) == [], list(base.rglob("*"))


def test_a_process_is_alive_until_it_exits_even_unreaped():
    """One answer to "is that process gone" (the sweep's, and the lost-peer search's): a zombie
    whose parent has not reaped it has exited, and its directory is a leftover."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{dead.pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z":
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.02)
        assert config_local.pid_alive(live.pid) and config_local.pid_alive(os.getpid())
        assert not config_local.pid_alive(dead.pid)      # exited, not yet reaped
        name = f"{PREFIX}p{dead.pid}"
        assert config_local.leftovers([(name, True, os.getuid())], os.getuid(), config_local.pid_alive) == [name]
    finally:
        live.kill()
        live.wait()
        dead.wait()
    assert not config_local.pid_alive(dead.pid)
