"""Issue 33 (5): wrong Lightning settings named in one line, from what the script did.

hpc_train cannot read a script's Trainer arguments; :mod:`hpc_train.launch.framework_check` reads
what they caused: the process group Lightning reports making, and ranks a script starts itself.
The lines are Lightning's own (a real run of jobs/lightning_digits.py with `devices=1` under
`run --nproc 2`); the process checks look at real processes: a script that mp.spawns two gloo ranks
on the rendezvous port, and one whose data loader forks workers (which are not ranks).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from helpers import REPO, clean_env, hpc, show

from hpc_train.launch.framework_check import Watch
from hpc_train.node.environment import derive

LOCAL_2 = derive({"HPC_TRAIN_LAUNCHER": "local", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
                  "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611"})
SLURM_2x1 = derive({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                    "SLURM_NODEID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node[1-2]",
                    "SLURM_TASKS_PER_NODE": "1(x2)"})
# As Lightning 2.6.6 prints them (lightning/fabric/utilities/distributed.py).
MEMBER = "Initializing distributed: GLOBAL_RANK: {}, MEMBER: {}/{}"


def _feed(env, lines):
    w = Watch(env)
    said = [m for m in (w.line(x) for x in lines) if m is not None]
    return said


@pytest.mark.parametrize("env, lines, expected", [
    pytest.param(LOCAL_2, ["Seed set to 0", MEMBER.format(1, 2, 2), "epoch 0 ended"], None, id="right"),
    pytest.param(LOCAL_2, [MEMBER.format(1, 2, 1)],
                 "`devices` must equal --nproc (2), and `num_nodes` be 1: Lightning made a process group of 1 "
                 "(devices x num_nodes) where hpc_train started 2 ranks", id="devices=1 under run"),
    pytest.param(LOCAL_2, [MEMBER.format(0, 1, 2), MEMBER.format(1, 2, 2)],
                 "the script of rank 1 started 2 ranks of its own (Lightning's strategy=\"ddp_spawn\", or mp.spawn): "
                 "hpc_train starts every rank itself, so use strategy=\"ddp\" (2 ranks per node here)",
                 id="ddp_spawn"),
    pytest.param(LOCAL_2, [MEMBER.format(0, 1, 2) + MEMBER.format(1, 2, 2)],
                 "the script of rank 1 started 2 ranks of its own (Lightning's strategy=\"ddp_spawn\", or mp.spawn): "
                 "hpc_train starts every rank itself, so use strategy=\"ddp\" (2 ranks per node here)",
                 id="ddp_spawn, lines run together"),
    pytest.param(SLURM_2x1, [MEMBER.format(0, 1, 4)],
                 "`devices` must equal the ranks per node (1) and `num_nodes` the nodes (2): Lightning made a process "
                 "group of 4 (devices x num_nodes) where hpc_train started 2 ranks", id="devices=2 under submit"),
])
def test_lightning_lines(env, lines, expected):
    said = _feed(env, lines)
    assert said == ([] if expected is None else [expected])


def test_said_once():
    w = Watch(LOCAL_2)
    assert w.line(MEMBER.format(0, 1, 1)) is not None
    assert w.line(MEMBER.format(0, 1, 1)) is None and w.line(MEMBER.format(1, 2, 2)) is None


@pytest.mark.procs
def test_devices_1_under_run_is_named_from_lightnings_own_lines(tmp_path):
    """The real thing: `devices=1` with `--nproc 2`: rank 0's own lines (Lightning's group of 1)
    name the setting, and its supervisor ends the run with that line."""
    rd = tmp_path / "run"
    p = hpc("run", "--script", REPO / "jobs" / "lightning_digits.py", "--nproc", "2", "--run-dir", rd, "--",
            "--devices", "1", "--epochs", "1", "--root", tmp_path / "ld", timeout=300)
    assert p.returncode != 0, show(p)
    # The supervisor of rank 0 says it, in one line, on the console and in the rank's error file.
    assert "`devices` must equal --nproc (2)" in p.stderr, show(p)
    assert "`devices` must equal --nproc (2)" in (rd / "logs" / "rank-0.error").read_text()
    # The launcher names that line as the failure (before, rank 1's IndexError from inside
    # Lightning, while rank 0 trained alone at world size 1).
    assert "worker rank 0 failed" in p.stderr and not (rd / "result.json").exists(), show(p)
    rank0 = derive({"HPC_TRAIN_LAUNCHER": "local", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                    "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_PORT": "29611"})
    said = _feed(rank0, (rd / "logs" / "rank-0.log").read_text().splitlines())
    assert said == ["`devices` must equal --nproc (2), and `num_nodes` be 1: Lightning made a process group of 1 "
                    "(devices x num_nodes) where hpc_train started 2 ranks"], said


SPAWNS = """
    import os, time
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def rank(r):
        dist.init_process_group("gloo", rank=r, world_size=2)
        os.write(1, b"joined\\n")      # one write: the two ranks' lines never interleave
        time.sleep(120)

    if __name__ == "__main__":
        mp.spawn(rank, nprocs=2)
"""

FORKS_WORKERS = """
    import time
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    if __name__ == "__main__":
        dist.init_process_group("gloo", rank=0, world_size=1)
        # Forked after the group exists: the workers inherit its sockets, and are not ranks.
        it = iter(DataLoader(list(range(1000)), num_workers=2, persistent_workers=True))
        next(it)
        print("joined", flush=True)
        time.sleep(120)
"""


def _start(tmp_path, body: str, port: int) -> subprocess.Popen:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("body, spawned", [(SPAWNS, True), (FORKS_WORKERS, False)], ids=["mp.spawn", "loader workers"])
@pytest.mark.procs
def test_ranks_a_script_starts_itself_are_seen_and_loader_workers_are_not(tmp_path, body, spawned):
    port = _free_port()
    env = derive({"HPC_TRAIN_LAUNCHER": "local", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                  "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0", "MASTER_PORT": str(port)})
    p = _start(tmp_path, body, port)
    try:
        for _ in range(2 if spawned else 1):      # every rank in its group (or the workers started)
            assert p.stdout.readline().startswith("joined"), f"the script ended ({p.wait()})"
        said = Watch(env).processes(p.pid)
        if spawned:
            assert said == ("the script of rank 0 started 2 ranks of its own (Lightning's strategy=\"ddp_spawn\", or "
                            "mp.spawn): hpc_train starts every rank itself, so use strategy=\"ddp\" "
                            "(1 rank per node here)"), said
        else:
            assert said is None
            assert len(_kids(p.pid)) == 2          # the workers were there to be looked at
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)     # the script's session: it and what it started
        except ProcessLookupError:
            pass
        p.wait()


def _kids(pid: int) -> list[int]:
    return [int(x) for x in open(f"/proc/{pid}/task/{pid}/children").read().split()]
