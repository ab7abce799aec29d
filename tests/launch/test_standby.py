"""job.standby (hpc_train.launch.standby): a task started ahead of its step, torch imported,
waiting on its standard input for the go; and the batch shell's lines that start it and hand it
the step. The standby's own behaviour is tested here on real processes; the hand-over through
real srun steps, on the dev cluster, is in tests/slurm/test_slurm_own_code.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_train.config import from_dict
from hpc_train.login import batch
from hpc_train.login.sbatch import SbatchScript

REPO = Path(__file__).resolve().parents[2]

# A task's worker, reduced to the standby's part: it installs a handler of its own first (as
# submitit does), waits, then reports what the go set.
PROGRAM = r"""
import os, signal, sys, time
from hpc_train.config import from_dict
from hpc_train.launch import standby
from hpc_train import goodput
mine = lambda *a: None
signal.signal(signal.SIGUSR2, mine)
cfg = from_dict({"dist": {"strategy": "ddp"}, "train": {"script": sys.argv[1]} if sys.argv[1] else {}})
was = standby.active()
started = goodput.own_start_time()
waited = standby.await_go(cfg)
print("attempt", os.environ["HPC_TRAIN_ATTEMPT"], "resume", os.environ["HPC_TRAIN_RESUME"],
      "standby", was, "env", os.environ.get("HPC_TRAIN_STANDBY"), "handler", signal.getsignal(signal.SIGUSR2) is mine,
      "process-mark-moved", goodput.own_start_time() - started > 0.3, "waited", waited > 0.3,
      "torch-loaded", "torch" in sys.modules, flush=True)
"""


def _start(script: str = "run.sh", program: str = PROGRAM) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HPC_TRAIN_STANDBY": "1", "HPC_TRAIN_ATTEMPT": "1",
           "HPC_TRAIN_RESUME": "stale", "HPC_TRAIN_LOCAL_STEP": "99"}
    return subprocess.Popen([sys.executable, "-c", program, script], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _waiting(p: subprocess.Popen, maps: str | None = None, timeout: float = 60.0) -> None:
    """Until the process sleeps (in its read of stdin), with ``maps`` among its mappings."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert p.poll() is None, p.communicate()
        try:
            state = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            mapped = maps is None or maps in Path(f"/proc/{p.pid}/maps").read_text()
        except OSError:
            state, mapped = "?", False
        if state == "S" and mapped:
            time.sleep(0.3)     # and still asleep: not between two imports
            if Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "S":
                return
        time.sleep(0.05)
    raise AssertionError("the standby never waited")


@pytest.mark.procs
def test_the_standby_waits_with_torch_loaded_and_the_go_sets_the_step():
    p = _start(script="")
    _waiting(p, maps="libtorch")        # torch is loaded before the go, not after it
    time.sleep(0.4)
    p.send_signal(signal.SIGUSR2)       # the job's time-limit signal, before its go: not its concern
    time.sleep(0.3)
    assert p.poll() is None
    out, err = p.communicate("go 3 latest\n", timeout=60)
    assert p.returncode == 0, err
    assert out.split() == ["attempt", "3", "resume", "latest", "standby", "True", "env", "None", "handler", "True",
                           "process-mark-moved", "True", "waited", "True", "torch-loaded", "True"], (out, err)


def test_a_go_within_the_hold_is_taken_before_any_import():
    """A standby holds its imports for HOLD_S (its step's own start-up comes first); a go in
    that time (a failure right after the start) is taken at once, torch not loaded by it."""
    p = _start(script="")
    out, err = p.communicate("go 2 latest\n", timeout=60)
    assert p.returncode == 0, err
    assert out.split()[:4] == ["attempt", "2", "resume", "latest"] and out.split()[-2:] == ["torch-loaded", "False"], out


@pytest.mark.parametrize("go, local", [("go 2 latest 205\n", "205"), ("go 2 latest -\n", ""), ("go 2 latest\n", "")])
def test_the_go_carries_the_hook_s_node_local_step(go, local):
    """The requeue hook's choice (restore the node-local tier's step N) reaches a standby with
    its go, as it reaches an srun step in HPC_TRAIN_LOCAL_STEP; "-" or none: no choice (a stale
    value from the task's start is not kept)."""
    p = _start(script="", program=PROGRAM + 'print("local", repr(os.environ.get("HPC_TRAIN_LOCAL_STEP")))\n')
    out, err = p.communicate(go, timeout=60)
    assert p.returncode == 0, err
    assert out.splitlines()[-1] == f"local {local!r}", out


@pytest.mark.parametrize("feed,code,says", [("", 0, ""), ("go now\n", 1, "not a go line"),
                                             ("go 2 two words\n", 1, "not a go line")])
def test_a_standby_without_a_go_leaves_without_running(feed, code, says):
    p = _start()
    _waiting(p)
    out, err = p.communicate(feed, timeout=60)
    assert p.returncode == code and out == "" and says in err, (p.returncode, out, err)


def test_a_stop_before_the_go_ends_the_standby():
    p = _start()
    _waiting(p)
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGTERM


def _script(cfg: dict, launcher: str = "srun") -> str:
    return SbatchScript(from_dict(cfg), "/tmp/run dir", launcher=launcher).materialize()


def test_the_batch_script_hands_a_restart_on_the_same_nodes_to_the_standby(tmp_path):
    text = _script({"job": {"standby": True, "nodes": 2}})
    (tmp_path / "job.sh").write_text(text)
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sh")]).returncode == 0
    assert "\nhpc_train_step --kill-on-bad-exit=1 " in text
    assert "HPC_TRAIN_STANDBY=1 command srun --overlap --input=all --open-mode=append $step_nodes" in text
    assert '[ "$standby_nodes" = "$step_nodes" ]' in text and "exec 8>&-   # the standby's" in text
    # Off (the default), and under torchrun (an agent, not a worker): the plain srun line.
    for plain in (_script({"job": {"nodes": 2}}), _script({"job": {"standby": True, "nodes": 2}}, "torchrun")):
        assert "hpc_train_step" not in plain and "srun $step_nodes --kill-on-bad-exit=1" in plain
    loop = batch.Loop(from_dict({"job": {"standby": True}}).job)
    assert loop.srun() == "hpc_train_step" and any("exec 8>&-" in x for x in loop.after())


@pytest.mark.parametrize("sets,calls", [(["job.spare_nodes=1"], "program --nodes=2 --ntasks=2 a b"),
                                        (["job.standby=true"], "hpc_train_step a b")])
def test_the_submitted_script_s_srun_function_reaches_srun_once(tmp_path, sets, calls):
    """submit's batch script calls srun through a shell function named srun (nodes after a lost
    node, or the standby): run as bash runs it, the function must reach the program srun (or
    the standby's step function) once, not call itself."""
    from hpc_train.config import load
    from hpc_train.login.submission import dry_run_text, make_executor

    text = dry_run_text(make_executor(load(None, sets), tmp_path, dry_run=True))
    [fn] = [x for x in text.splitlines() if x.startswith("srun() {")]
    # A stand-in program named srun records how it is called: this is the shell function's own
    # logic; real sruns through it are in tests/slurm (the straggler swap, the killed rank).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/sh\necho program "$@"\n')
    (bin_dir / "srun").chmod(0o755)
    script = (f"FUNCNEST=20; step_nodes='--nodes=2 --ntasks=2'\nhpc_train_step() {{ echo hpc_train_step \"$@\"; }}\n"
              f"{fn}\nsrun a b\n")
    out = subprocess.run(["bash", "-c", script], env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == calls, (fn, out.stdout, out.stderr)
