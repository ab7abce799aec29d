"""Issue 51: Hugging Face Trainer and accelerate scripts, first-class.

jobs/hf_gpt2.py (a tiny GPT-2 built from its config, trained by the Trainer on the repo's text,
2 CPU ranks) with the two lines of hpc_train.huggingface: a stop saves the Trainer's checkpoint at
the step every rank agreed on (0 steps redone), the same command resumes there, and the final
weights are bitwise those of a run that never stopped, under ``run --script`` and under torchrun.
A kill -9 of one rank resumes from the Trainer's newest complete checkpoint (hpc_train keeps no
checkpoint of its own for a Trainer, even when its config asks for one every few steps), bitwise.
The unmodified script (its own ``get_last_checkpoint``) stays bitwise; a plain ``trainer.train()``
is told once what to add. jobs/accelerate_loop.py: accelerate's prepared objects on a Run,
stopped and resumed, bitwise. The Slurm path (submit --script, preempted once) is in
tests/slurm/test_slurm_huggingface.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO, assert_same_weights, children, clean_env, hpc, show, start
from hpc_train.errors import EXIT_STOPPED

pytest.importorskip("transformers")   # the test extra installs it; without it, these say so
pytestmark = pytest.mark.procs       # real training processes: not in `make test-fast`

SCRIPT = str(REPO / "jobs" / "hf_gpt2.py")
STEPS = 40
PACE = "0.1"        # seconds a step sleeps in the runs that are stopped, so a stop lands mid-run


def _args(tmp: Path, *extra: str) -> list[str]:
    return ["--output-dir", str(tmp / "out"), "--steps", str(STEPS), "--weights", str(tmp / "final.pt"), *extra]


def _run(tmp: Path, *extra: str, flags: tuple[str, ...] = ()) -> tuple:
    return ("run", "--script", SCRIPT, "--nproc", "2", "--run-dir", tmp / "run", *flags, "--", *_args(tmp, *extra))


def _weights(tmp: Path) -> dict:
    return torch.load(tmp / "final.pt", weights_only=True)


def _checkpoints(out: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))


def _wait_for(text: str, log: Path, p: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not (log.exists() and text in log.read_text(errors="replace")):
        assert p.poll() is None, f"ended before {text!r}:\n{p.communicate()[1][-4000:]}"
        assert time.monotonic() < deadline, f"{text!r} never in {log}"
        time.sleep(0.05)


def _status(rd: Path) -> str:
    r = hpc("status", rd)
    assert r.returncode == 0, show(r)
    return r.stdout


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Uninterrupted, under `run --script`: the weights every resumed run must equal."""
    d = tmp_path_factory.mktemp("hf-straight")
    p = hpc(*_run(d), timeout=300)
    assert p.returncode == 0, show(p)
    assert json.loads((d / "run" / "result.json").read_text())["steps"] == STEPS
    assert not (d / "run" / "checkpoints").exists()            # the Trainer's checkpoint is the only one
    assert _checkpoints(d / "out") == [STEPS]
    return _weights(d)


def test_run_script_stop_saves_the_trainer_checkpoint_at_its_step_and_resumes_bitwise(straight, tmp_path):
    p = start(*_run(tmp_path, "--pace", PACE))
    _wait_for("step 12", tmp_path / "run" / "logs" / "rank-0.log", p)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == EXIT_STOPPED, err[-4000:]
    stop = json.loads((tmp_path / "run" / "stopped.json").read_text())
    step = stop["steps"]
    assert 12 <= step < STEPS and stop["stop_signal"] == "TERM", stop
    assert _checkpoints(tmp_path / "out") == [step]               # saved at the step reached: 0 redone
    assert "exited with code 3" in err and "Traceback" not in err, err[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()
    st = _status(tmp_path / "run")
    assert f"the same command resumes from step {step}: the Trainer's {tmp_path / 'out'}/checkpoint-{step}" in st, st
    lst = hpc("ckpt", "list", tmp_path / "run")
    assert lst.returncode == 0 and f"checkpoint-{step}" in lst.stdout and "complete" in lst.stdout, show(lst)

    p = hpc(*_run(tmp_path, "--pace", PACE), timeout=300)        # the same command
    assert p.returncode == 0, show(p)
    assert f"resuming from step {step}: the Trainer's" in p.stderr, show(p)
    log = (tmp_path / "run" / "logs" / "rank-0.log").read_text()
    assert f"resuming from the Trainer's {tmp_path / 'out'}/checkpoint-{step} (step {step})" in log
    assert f"step {step + 1}\n" in log and log.count(f"step {step}\n") == 1    # no step trained twice
    assert_same_weights(straight, _weights(tmp_path))
    assert (tmp_path / "run" / "result.json").exists() and not (tmp_path / "run" / "stopped.json").exists()


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_torchrun_stop_saves_at_its_step_and_the_same_command_resumes_bitwise(straight, tmp_path):
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", _port(),
            SCRIPT, *_args(tmp_path, "--pace", PACE)]
    rd = tmp_path / "runs" / "hf_gpt2"             # init()'s default run directory: runs/<script name>
    p = subprocess.Popen(argv, cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    deadline = time.monotonic() + 180
    while not any(json.loads(x).get("step", 0) >= 10 for x in _lines(rd / "metrics.jsonl")):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-4000:]
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)                  # torchrun passes it to both ranks
    _, err = p.communicate(timeout=120)
    assert p.returncode != 0, err[-4000:]
    step = json.loads((rd / "stopped.json").read_text())["steps"]
    assert _checkpoints(tmp_path / "out") == [step], err[-4000:]
    assert "resume with:" in err and "torch.distributed.run" in err.split("resume with:")[1], err[-3000:]
    argv[argv.index("--master_port") + 1] = _port()
    r = subprocess.run(argv, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert f"resuming from the Trainer's {tmp_path / 'out'}/checkpoint-{step} (step {step})" in r.stderr
    assert_same_weights(straight, _weights(tmp_path))


def _lines(path: Path) -> list[str]:
    try:
        return [x for x in path.read_text().splitlines() if x.strip()]
    except OSError:
        return []


def _script_pid(launcher: int, rank: int) -> int:
    """The pid of rank ``rank``'s script under a `run --script` launcher (its supervisor's child)."""
    for sup in children(launcher):
        for pid in children(sup):
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in env:
                return pid
    raise AssertionError(f"no script of rank {rank} under {launcher}")


def test_kill9_of_one_rank_resumes_from_one_consistent_step_bitwise(straight, tmp_path):
    """hpc_train is asked for a checkpoint every 5 steps and a node-local one every step; with a
    Trainer it keeps neither (the Trainer's every 10 is the run's only checkpoint), so the rerun
    has one step to resume from, not two that disagree (the UsageError of the issue)."""
    flags = ("--set", "checkpoint.every_steps=5", "--set", "checkpoint.local_every_steps=1")
    cmd = _run(tmp_path, "--pace", PACE, "--save-steps", "10", flags=flags)
    p = start(*cmd)
    _wait_for("step 14", tmp_path / "run" / "logs" / "rank-0.log", p)
    os.kill(_script_pid(p.pid, 1), signal.SIGKILL)
    _, err = p.communicate(timeout=180)
    assert p.returncode not in (0, EXIT_STOPPED), err[-4000:]
    assert "rank 1" in err, err[-3000:]                           # the culprit, not its victim
    assert _checkpoints(tmp_path / "out")[-1] == 10
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert "the same command resumes from step 10: the Trainer's" in _status(tmp_path / "run")
    r = hpc(*cmd, timeout=300)
    assert r.returncode == 0, show(r)
    assert "resuming from the Trainer's" in (tmp_path / "run" / "logs" / "rank-0.log").read_text()
    assert_same_weights(straight, _weights(tmp_path))


def test_unmodified_script_with_its_own_last_checkpoint_stays_bitwise(straight, tmp_path):
    cmd = _run(tmp_path, "--pace", PACE, "--save-steps", "10", "--unmodified")
    p = start(*cmd)
    _wait_for("step 12", tmp_path / "run" / "logs" / "rank-0.log", p)
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=120)
    assert _checkpoints(tmp_path / "out") == [10]                 # nothing saved at the stop: it redoes 2+
    r = hpc(*cmd, timeout=300)
    assert r.returncode == 0, show(r)
    assert_same_weights(straight, _weights(tmp_path))


def test_plain_trainer_train_is_told_once_what_to_add(straight, tmp_path):
    cmd = _run(tmp_path, "--pace", PACE, "--plain-train")
    p = start(*cmd)
    _wait_for("step 12", tmp_path / "run" / "logs" / "rank-0.log", p)
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=120)
    step = _checkpoints(tmp_path / "out")[-1]
    r = hpc(*cmd, timeout=300)
    assert r.returncode == 0, show(r)
    told = [x for x in (tmp_path / "run" / "logs" / "rank-0.log").read_text().splitlines()
            if "trainer.train() starts at step 0" in x]
    assert len(told) == 1, told
    assert f"holds the Trainer's checkpoint of step {step}" in told[0]
    assert "resume_from_checkpoint=hpc_train.huggingface.checkpoint_to_resume(args)" in told[0]
    assert_same_weights(straight, _weights(tmp_path))             # it started over, as it said


def test_resume_none_starts_a_trainer_run_over_and_moves_its_checkpoints_aside(tmp_path):
    cmd = _run(tmp_path, "--save-steps", "20")
    assert hpc(*cmd, timeout=300).returncode == 0
    before = (tmp_path / "out" / "checkpoint-40" / "trainer_state.json").read_bytes()
    r = hpc(*cmd[:7], "--resume", "none", *cmd[7:], timeout=300)
    assert r.returncode == 0, show(r)
    log = (tmp_path / "run" / "logs" / "rank-0.log").read_text()
    assert "resuming from the Trainer's" not in log.split("moved the Trainer's 2 checkpoint(s) aside")[1], log
    [aside] = (tmp_path / "out").glob("old-*")
    assert (aside / "checkpoint-40" / "trainer_state.json").read_bytes() == before    # nothing lost
    assert _checkpoints(tmp_path / "out") == [20, 40]


ACCEL = str(REPO / "jobs" / "accelerate_loop.py")


def test_accelerate_loop_on_run_stopped_and_resumed_is_bitwise(tmp_path):
    ref = hpc("run", "--script", ACCEL, "--nproc", "2", "--run-dir", tmp_path / "ref", "--", "--steps", "40",
              "--pace", PACE, "--weights", tmp_path / "ref.pt", timeout=300)
    assert ref.returncode == 0, show(ref)
    cmd = ("run", "--script", ACCEL, "--nproc", "2", "--run-dir", tmp_path / "run", "--", "--steps", "40",
           "--pace", PACE, "--weights", tmp_path / "final.pt")
    p = start(*cmd)
    _wait_for("step 10 loss", tmp_path / "run" / "logs" / "rank-0.log", p)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == EXIT_STOPPED and "checkpoint saved at step" in err, err[-3000:]
    r = hpc(*cmd, timeout=300)
    assert r.returncode == 0 and "resuming from step" in r.stderr, show(r)
    assert_same_weights(torch.load(tmp_path / "ref.pt", weights_only=True),
                        torch.load(tmp_path / "final.pt", weights_only=True))


def test_plain_python_stop_exits_3_saves_at_its_step_and_resumes_bitwise(tmp_path):
    """One process, no launcher: ``python jobs/hf_gpt2.py`` (its run directory runs/hf_gpt2)."""
    def argv(d: Path, *extra: str) -> list[str]:
        return [sys.executable, SCRIPT, "--output-dir", str(d / "out"), "--steps", "20", "--weights",
                str(d / "final.pt"), *extra]
    ref, d = tmp_path / "ref", tmp_path / "stopped"
    ref.mkdir(), d.mkdir()
    r = subprocess.run(argv(ref, "--pace", PACE), cwd=ref, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    p = subprocess.Popen(argv(d, "--pace", PACE), cwd=d, env=clean_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    rd = d / "runs" / "hf_gpt2"
    deadline = time.monotonic() + 180
    while not any(json.loads(x).get("step", 0) >= 10 for x in _lines(rd / "metrics.jsonl")):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-4000:]
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 3, err[-4000:]                         # a stop that saved: run.exit_code
    step = json.loads((rd / "stopped.json").read_text())["steps"]
    assert _checkpoints(d / "out") == [step] and "resume with:" in err, err[-3000:]
    r = subprocess.run(argv(d, "--pace", PACE), cwd=d, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert f"resuming from the Trainer's {d / 'out'}/checkpoint-{step} (step {step})" in r.stderr
    assert_same_weights(_weights(ref), _weights(d))
