"""Issue 19 (reliability, round 3: processes and loaders) and issue 20 point 3.

Real processes throughout: `python -m hpc_train run` with real scripts and functions, real signals
to the launcher and to workers, a real pids cgroup for a spawn that fails part-way, a real
RLIMIT_AS for a memory limit, a closed pipe for a closed stdout. The loader tests build the real
ShardedLoader in this process (it needs no process group: rank and world size are arguments).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import REPO, children, clean_env, hpc, metric_lines, show, start, write_config

from hpc_train import rundir
from hpc_train.ckpt import store
from hpc_train.errors import EXIT_STOPPED


def _wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _worker_pid(run_dir: Path, rank: int) -> int:
    from hpc_train.records import ranks
    hb = ranks.path(run_dir, rank)

    def written() -> bool:
        try:
            return "pid" in json.loads(hb.read_text())
        except (OSError, ValueError):
            return False
    _wait_for(written, 60, f"rank {rank}'s heartbeat")
    return json.loads(hb.read_text())["pid"]


def _module(tmp_path: Path, name: str, source: str) -> dict[str, str]:
    """Write a module for --fn into tmp_path; the environment that makes it importable."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    return clean_env(PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path}")


def _failure_line(stderr: str) -> str:
    return next((x for x in stderr.splitlines() if x.startswith("hpc_train: worker rank")), "")


# -- 5: a run is finished only when every rank finished ---------------------------------------------

@pytest.mark.procs
def test_a_script_rank_that_exits_0_first_does_not_finish_a_failed_run(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    time.sleep(3)\n"
                      "    sys.exit('rank 1 gives up')\n")
    rd = tmp_path / "run"
    p = hpc("run", "--script", script, "--nproc", "2", "--run-dir", rd)
    assert p.returncode == 1, show(p)
    assert "worker rank 1 failed (exit code 1)" in p.stderr, show(p)
    assert not (rd / "result.json").exists(), "rank 0's exit 0 marked a failed run finished"
    assert not store.is_finished(rd)   # a rerun or a requeue trains again
    # Every rank exiting 0 still finishes the run.
    script.write_text("print('done')\n")
    p = hpc("run", "--script", script, "--nproc", "2", "--run-dir", rd)
    assert p.returncode == 0, show(p)
    assert json.loads((rd / "result.json").read_text())["exit_code"] == 0


# -- 6: a vanished peer fails the run ---------------------------------------------------------------

LEAVER = """
    import os, time
    import torch
    import hpc_train

    def train():
        run = hpc_train.init()
        torch.manual_seed(0)
        model = run.wrap(torch.nn.Linear(8, 1))
        optim = torch.optim.SGD(model.parameters(), lr=0.01)
        state = {"model": model, "optim": optim, "step": 0}
        run.restore(state)
        total, leave = int(os.environ["STEPS"]), int(os.environ["LEAVE_AT"])
        while state["step"] < total:
            if run.rank == 1 and state["step"] == leave:
                os._exit(0)                       # gone, without a word, with exit code 0
            loss = model(torch.randn(16, 8)).pow(2).mean()
            optim.zero_grad(); loss.backward(); optim.step()
            state["step"] += 1
            run.step_end(state)
            time.sleep(0.01)
        if run.rank == 1 and leave == total:
            os._exit(0)                           # after the last step, before finish()
        run.finish({"loss": loss.item()})
"""


@pytest.mark.parametrize("leave_at", [3, 40], ids=["mid-training", "before-finish"])
@pytest.mark.procs
def test_a_rank_that_leaves_with_exit_0_fails_the_run(tmp_path, leave_at):
    env = _module(tmp_path, "leaver", LEAVER)
    env.update(STEPS="40", LEAVE_AT=str(leave_at))
    rd = tmp_path / "run"
    p = hpc("run", "--fn", "leaver:train", "--nproc", "2", "--run-dir", rd, "--set", "checkpoint.enabled=false",
            env=env)
    assert p.returncode == 1, show(p)
    assert not (rd / "result.json").exists(), show(p)
    line = _failure_line(p.stderr)
    assert line.startswith("hpc_train: worker rank 1 failed (exit code 0"), show(p)
    assert "before its work ended" in line, show(p)
    if leave_at < 40:   # rank 0 did not train on alone: its all-reduce failed
        log0 = (rd / "logs" / "rank-0.log").read_text()
        assert "step 40" not in log0 and "lost a peer" in log0, log0[-3000:]


# -- 9: workers die with their launcher, and the lock is held while they live ------------------------

@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGQUIT], ids=["kill-9", "ctrl-backslash"])
@pytest.mark.procs
def test_killing_the_launcher_ends_its_workers(tmp_path, sig):
    cfg = write_config(tmp_path / "job.yaml", {"train": {"max_steps": 100000}})
    rd = tmp_path / "run"
    p = start("run", cfg, "--nproc", "2", "--run-dir", rd)
    workers: list[int] = []
    try:
        _wait_for(lambda: (rd / "checkpoints" / "step-5" / "commit.json").exists(), 120, "a first checkpoint")
        workers = children(p.pid)
        assert len(workers) == 2
        p.send_signal(sig)
        p.wait(timeout=30)
        deadline = time.monotonic() + 15
        while any(_alive(w) for w in workers):
            # While a worker of the run lives, the run directory is not free for another run.
            assert rundir.busy(rd) is not None or not any(_alive(w) for w in workers), "lock free, workers alive"
            assert time.monotonic() < deadline, "workers outlived their launcher"
            time.sleep(0.05)
    finally:
        for w in workers:     # orphans of a launcher that died are no longer its children
            if _alive(w):
                os.killpg(w, signal.SIGKILL)
        p.kill()
        p.communicate()
    assert rundir.busy(rd) is None


@pytest.mark.procs
def test_killing_the_launcher_ends_a_script_and_its_supervisor(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import os, time\n"
                      "open(os.path.join(os.environ['HPC_TRAIN_RUN_DIR'], f\"pid-{os.environ['RANK']}\"), 'w')"
                      ".write(str(os.getpid()))\n"
                      "time.sleep(300)\n")
    rd = tmp_path / "run"
    p = start("run", "--script", script, "--nproc", "2", "--run-dir", rd)
    pids: list[int] = []
    try:
        _wait_for(lambda: all((rd / f"pid-{r}").exists() and (rd / f"pid-{r}").read_text() for r in (0, 1)), 120,
                  "the scripts")
        pids = children(p.pid) + [int((rd / f"pid-{r}").read_text()) for r in (0, 1)]
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        _wait_for(lambda: not any(_alive(x) for x in pids), 15, "the supervisors and their scripts to die")
    finally:
        for x in pids:
            if _alive(x):
                os.kill(x, signal.SIGKILL)
        p.kill()
        p.communicate()


@pytest.mark.procs
def test_killing_torchrun_ends_the_workers_of_a_users_loop(tmp_path):
    """``torchrun train.py`` with a loop through ``hpc_train.init()``: torchrun killed with -9
    forwards nothing, and its workers, orphaned, would train on holding the run directory. They
    end with it, as the workers of hpc_train's own launchers do; the run directory is free."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rd = tmp_path / "runs" / "own_loop"
    # Output to a file: a pipe nobody reads would fill and stall the orphans' logging.
    err = (tmp_path / "torchrun.err").open("w")
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(port), str(REPO / "tests" / "scripts" / "own_loop.py"), "100000", "0.02"],
                         cwd=tmp_path, env=clean_env(), stdout=subprocess.DEVNULL, stderr=err)
    workers: list[int] = []
    try:
        # Past the start-up, whose groups are made through torchrun's store: a kill during it fails
        # the workers by itself.
        _wait_for(lambda: (rd / "metrics.jsonl").exists() and len(metric_lines(rd)) >= 30 or p.poll() is not None,
                  120, "30 steps")
        assert p.poll() is None, (tmp_path / "torchrun.err").read_text()[-3000:]
        workers = children(p.pid)
        assert len(workers) == 2 and rundir.busy(rd) is not None
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        _wait_for(lambda: not any(_alive(w) for w in workers), 10, "the workers to end with torchrun")
    finally:
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
        p.kill()
        p.wait()
        err.close()
    # A killed process shows as a zombie before its last threads have let go of its files.
    _wait_for(lambda: rundir.busy(rd) is None, 10, "the run directory's lock to be free")


# -- 10: a closed stdout does not stop the supervisor draining the script's output -------------------

def test_a_closed_stdout_does_not_hang_a_script_run(tmp_path):
    script = tmp_path / "chatty.py"
    script.write_text("for i in range(5000):\n    print(f'line {i:05d} ' + 'x' * 100)\nprint('the end')\n")
    rd = tmp_path / "run"
    with open(tmp_path / "stderr", "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "hpc_train", "run", "--script", str(script), "--run-dir", str(rd),
                              "--set", "dist.timeout_s=20"], cwd=REPO, env=clean_env(), stdout=subprocess.PIPE,
                             stderr=err)
        p.stdout.readline()      # `| head -1`
        p.stdout.close()
        try:
            p.wait(timeout=90)
        except subprocess.TimeoutExpired:
            for w in children(p.pid):
                os.killpg(w, signal.SIGKILL)
            p.kill()
            pytest.fail("the script run hung on its closed stdout")
    log0 = (rd / "logs" / "rank-0.log").read_text()
    assert "line 04999" in log0 and "the end" in log0      # every line still reached the log
    assert (rd / "result.json").exists(), (tmp_path / "stderr").read_text()


# -- 12: an empty loader is refused; a stop ends a loop that never reaches step_end --------------------

def test_a_loader_without_one_batch_per_rank_is_refused():
    import torch
    from torch.utils.data import TensorDataset

    from hpc_train.errors import UsageError
    from hpc_train.node.loader import ShardedLoader
    with pytest.raises(UsageError) as e:
        ShardedLoader(TensorDataset(torch.zeros(10, 1)), 8, rank=1, world_size=2)
    msg = str(e.value)
    assert "10 samples" in msg and "batch size 8" in msg and "world size 2" in msg and "\n" not in msg, msg
    assert len(ShardedLoader(TensorDataset(torch.zeros(16, 1)), 8, rank=1, world_size=2)) == 1


SPINNER = """
    import time
    import torch
    import hpc_train
    from torch.utils.data import DataLoader

    def train():
        run = hpc_train.init()
        state = {"model": torch.nn.Linear(2, 2), "step": 0}
        run.restore(state)
        open(run.run_dir / "spinning", "w").close()
        while state["step"] < 10:                 # the README's loop over a loader that yields nothing
            for x in DataLoader(list(range(3)), batch_size=8, drop_last=True):
                state["step"] += 1
                run.step_end(state)
"""


@pytest.mark.procs
def test_a_stop_ends_a_loop_that_never_reaches_step_end(tmp_path):
    env = _module(tmp_path, "spinner", SPINNER)
    rd = tmp_path / "run"
    p = start("run", "--fn", "spinner:train", "--run-dir", rd, env=env)
    try:
        _wait_for(lambda: (rd / "spinning").exists() or p.poll() is not None, 120, "the loop")
        p.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        out, err = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            for w in children(p.pid):
                os.killpg(w, signal.SIGKILL)
            p.kill()
    print(f"the stop ended the spinning loop {time.monotonic() - t0:.1f} s later")
    assert p.returncode == EXIT_STOPPED, err
    assert "stopped before the code reached a step boundary" in err, err
    assert not (rd / "result.json").exists()


# -- 13: --nproc is bounded; a spawn that fails part-way leaves nothing behind ------------------------

@pytest.fixture
def pids_cgroup(tmp_path):
    """A real pids cgroup (v1): processes started in it get EAGAIN from fork past pids.max."""
    root = Path("/sys/fs/cgroup/pids")
    if os.geteuid() != 0 or not root.is_dir():
        pytest.skip("a pids cgroup needs root and cgroup v1's pids controller")
    cg = root / f"hpc_train_test_{os.getpid()}_{tmp_path.name}"
    try:
        cg.mkdir()
    except OSError as e:
        pytest.skip(f"cannot make a pids cgroup: {e}")
    yield cg
    (cg / "pids.max").write_text("max")
    for pid in (cg / "cgroup.procs").read_text().split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    _wait_for(lambda: not (cg / "cgroup.procs").read_text().split(), 30, "the cgroup to empty")
    cg.rmdir()


def _in_cgroup(cg: Path):
    def enter() -> None:
        (cg / "cgroup.procs").write_text(str(os.getpid()))
    return enter


def test_nproc_beyond_the_cpus_is_refused_in_one_line(tmp_path, pids_cgroup):
    (pids_cgroup / "pids.max").write_text("40")   # the code before the bound would start 10000 workers
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    p = subprocess.run([sys.executable, "-m", "hpc_train", "run", "--script", str(script), "--nproc", "10000",
                        "--run-dir", str(tmp_path / "run")], cwd=REPO, env=clean_env(), capture_output=True,
                       text=True, timeout=120, preexec_fn=_in_cgroup(pids_cgroup))
    cpus = len(os.sched_getaffinity(0))
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and len(lines) == 1, show(p)
    assert "--nproc 10000" in lines[0] and f"{cpus} CPU" in lines[0], show(p)
    assert not (tmp_path / "run").exists()


def test_a_spawn_that_fails_part_way_ends_the_workers_it_started(tmp_path, pids_cgroup):
    (pids_cgroup / "pids.max").write_text("2")   # the launcher and one worker: the second fork fails
    script = tmp_path / "s.py"
    script.write_text("import time\ntime.sleep(60)\n")
    p = subprocess.run([sys.executable, "-m", "hpc_train", "run", "--script", str(script), "--nproc", "2",
                        "--run-dir", str(tmp_path / "run")], cwd=REPO, env=clean_env(), capture_output=True,
                       text=True, timeout=120, preexec_fn=_in_cgroup(pids_cgroup))
    (pids_cgroup / "pids.max").write_text("max")   # a worker left behind could now go on
    time.sleep(1.0)
    left = (pids_cgroup / "cgroup.procs").read_text().split()
    assert p.returncode != 0 and not left, f"left running: {left}\n{show(p)}"
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert "Traceback" not in p.stderr and "could not start worker rank 1 of 2" in lines[-1], show(p)


# -- 18: a worker killed by a signal, or out of memory, is named as such ------------------------------

def _limit_as(nbytes: int):
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))
    return limit


@pytest.mark.procs
def test_a_worker_killed_by_a_signal_is_named(tmp_path):
    cfg = write_config(tmp_path / "job.yaml", {"train": {"max_steps": 100000}, "checkpoint": {"every_steps": 0}})
    rd = tmp_path / "run"
    limit = 48 << 30
    for sig in (signal.SIGUSR1, signal.SIGKILL):
        for hb in rd.glob("logs/.heartbeat/rank-*"):   # the first run's: _worker_pid must see the new one
            hb.unlink()
        p = subprocess.Popen([sys.executable, "-m", "hpc_train", "run", str(cfg), "--nproc", "2", "--run-dir", str(rd)],
                             cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=_limit_as(limit))
        os.kill(_worker_pid(rd, 1), sig)
        _, err = p.communicate(timeout=120)
        line = _failure_line(err)
        assert p.returncode == 1 and line.startswith(f"hpc_train: worker rank 1 failed (signal {sig.name})"), err
        assert "could not be recorded" not in line, line
        assert f"killed by {sig.name}" in line, line
        if sig == signal.SIGKILL:     # what the out-of-memory killer sends: the memory limit is named
            assert "RLIMIT_AS" in line and "48 GiB" in line, line


MEMORY_HOG = """
    def train():
        import hpc_train
        hpc_train.init()
        return bytearray(1 << 42)   # 4 TiB
"""


@pytest.mark.procs
def test_a_worker_out_of_memory_names_the_memory_limit(tmp_path):
    env = _module(tmp_path, "hog", MEMORY_HOG)
    p = subprocess.run([sys.executable, "-m", "hpc_train", "run", "--fn", "hog:train", "--run-dir",
                        str(tmp_path / "run")], cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                       preexec_fn=_limit_as(48 << 30))
    line = _failure_line(p.stderr)
    assert p.returncode == 1 and "could not be recorded" not in line, show(p)
    assert "MemoryError" in line and "RLIMIT_AS" in line and "48 GiB" in line, show(p)


# -- 19: an iterable dataset is refused with the way to checkpoint one --------------------------------

def test_an_iterable_dataset_is_refused_with_advice():
    import torch
    from torch.utils.data import IterableDataset

    from hpc_train.errors import UsageError
    from hpc_train.node.loader import ShardedLoader

    class It(IterableDataset):
        def __iter__(self):
            return iter(torch.arange(10))
    with pytest.raises(UsageError) as e:
        ShardedLoader(It(), 2, rank=0, world_size=1)
    msg = str(e.value)
    assert "map-style" in msg and "It" in msg and "StatefulDataLoader" in msg and "state" in msg, msg


# -- issue 20.3: peeking at a batch does not take it ---------------------------------------------------

def _tutorial_epochs(loader, epochs: int) -> list[list[int]]:
    """pytorch/examples ddp-tutorial-series multinode.py's loop: each epoch peeks at a batch for its size."""
    seen = []
    for _ in range(epochs):
        b_sz = len(next(iter(loader))[0])
        assert b_sz == 4
        seen.append([int(v) for (x,) in loader for v in x])
    return seen


def test_peeking_at_a_batch_takes_nothing_and_resume_stays_exact():
    import torch
    from torch.utils.data import TensorDataset

    from hpc_train.node.loader import ShardedLoader
    ds = TensorDataset(torch.arange(64))

    def make():
        return ShardedLoader(ds, 4, rank=1, world_size=2, seed=5)
    plain = make()
    reference = [[int(v) for (x,) in plain for v in x] for _ in range(4)]
    peeked = make()
    seen = _tutorial_epochs(peeked, 4)
    assert sum(len(s) for s in seen) // 4 == 4 * len(peeked)       # epochs * batches steps, exactly
    assert seen == reference and peeked.epoch == 4
    # A checkpoint mid-epoch, a restore, a peek: the epoch goes on with exactly the unseen batches.
    a = make()
    it = iter(a)
    taken = [int(v) for _ in range(3) for v in next(it)[0]]
    sd = a.state_dict()
    b = make()
    b.load_state_dict(sd)
    next(iter(b))
    assert taken + [int(v) for (x,) in b for v in x] == reference[0]
    assert b.epoch == 1


def test_a_signal_without_a_name_is_named_by_its_number():
    """A --script's program killed by a real-time signal (hpc_train's stack dump through Slurm is
    one, which a program that does not handle it dies of): its rank's line says "signal 41"; the
    supervisor's conclusion raised ValueError there and the culprit's line was lost."""
    import signal
    from hpc_train.errors import signal_name
    from hpc_train.launch.supervise import _how
    rt = signal.SIGRTMIN + 7
    assert _how(-rt) == f"was killed by signal {int(rt)}" and _how(-9) == "was killed by SIGKILL"
    assert signal_name(15) == "SIGTERM"
