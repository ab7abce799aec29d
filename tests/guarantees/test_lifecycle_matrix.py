"""One lifecycle on every path: the guarantees × the ways in, on real processes.

Paths: ``run CONFIG`` (the built-in trainer), ``run --script``, ``run --fn``, a user's own
``python train.py`` and ``torchrun train.py`` (tests/scripts/own_loop.py: the README's loop).
Slurm's paths (``submit``, ``sbatch``, a plain ``srun python train.py``) are in
tests/slurm/test_lifecycle_slurm.py.

Guarantees, each checked on every path in one sequence per path:

* busy: a second process into a run directory in use is refused at once (exit 2 where the
  process is ours, naming the holder), and the first is unharmed;
* stop: a real SIGTERM saves, exits non-zero and prints that path's resume hint;
* goodput: ``goodput.json`` exists for the stopped run and for the finished run;
* crash: a rank whose code raises fails the run, named as the culprit by the launcher and by
  ``status``, and loses nothing: the same command then resumes from the stop's checkpoint;
* no stale stop record: the same command resumes and finishes, and ``stopped.json`` is gone;
* finished: a finished run never trains again: exit 0, one line, nothing in its directory changes.

It is also the exit-code table test on these paths (a refusal, a stop, a crash, a finish): each
exit code is the one docs/faults.md documents (read from its table, :func:`documented_exit`), and
``status`` reads the same outcome from the records.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import clean_env, documented_exit, metric_lines, rank_records, snapshot

# Every test here starts real training processes: not in `make test-fast`.
pytestmark = pytest.mark.procs

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
SCRIPT = str(ROOT / "tests" / "scripts" / "own_loop.py")
STEPS = 600


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _config(tmp: Path) -> str:
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump({
        "data": {"name": "tests.plugins_for_tests:slow_data", "synthetic_size": 4096, "batch_size": 8},
        "model": {"name": "linear"}, "train": {"max_steps": STEPS, "eval": False, "log_every": 1},
        "log": {"tensorboard": False, "progress": "lines"}}))
    return str(path)


def command(path: str, tmp: Path, rd: Path, slow: bool, **extra: str) -> tuple[list[str], dict[str, str], Path]:
    """(argv, environment, cwd) of one start of ``path``; ``slow``: slow enough to be stopped mid-run;
    ``extra``: more environment (``HPC_TEST_CRASH_RANK``)."""
    sleep = "0.2" if slow else "0"
    env = clean_env(HPC_TEST_SLOW_S="0.025" if slow else "0", OWN_LOOP_STEPS=str(STEPS), OWN_LOOP_SLEEP=sleep,
                    **extra)
    hpc = [PY, "-m", "hpc_train", "run"]
    if path == "run-config":
        return [*hpc, _config(tmp), "--nproc", "2", "--run-dir", str(rd)], env, ROOT
    if path == "run-script":
        return [*hpc, "--script", SCRIPT, "--nproc", "2", "--run-dir", str(rd), "--", str(STEPS), sleep], env, ROOT
    if path == "run-fn":
        return [*hpc, "--fn", "tests.scripts.own_loop:fn", "--nproc", "2", "--run-dir", str(rd)], env, ROOT
    if path == "python":
        return [PY, SCRIPT, str(STEPS), sleep], env, tmp
    if path == "torchrun":
        return ([PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", _port(), SCRIPT,
                 str(STEPS), sleep], env, tmp)
    raise AssertionError(path)


def run_dir_of(path: str, tmp: Path) -> Path:
    return tmp / "runs" / "own_loop" if path in ("python", "torchrun") else tmp / "run"


def column(path: str) -> str:
    """The path's column in docs/faults.md's exit-code table."""
    return "run" if path.startswith("run-") else path


def status(rd: Path) -> tuple[str, str]:
    """(the outcome's word, the whole answer) of ``hpc_train status RD``: its line is
    ``local run: failed: rank 1: ...``."""
    r = subprocess.run([PY, "-m", "hpc_train", "status", str(rd)], env=clean_env(), cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    line = r.stdout.splitlines()[1].strip()
    return line.split(": ", 1)[1].split()[0].rstrip(":"), r.stdout


def start(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(p: subprocess.Popen, timeout: float = 180) -> tuple[int, str]:
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        _, err = p.communicate()
        raise AssertionError(f"hung past {timeout}s: {p.args}\n{err[-4000:]}") from None
    return p.returncode, err


def wait_for_step(rd: Path, step: int, p: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert p.poll() is None, f"ended early ({p.returncode}): {p.communicate()[1][-4000:]}"
        try:
            if any(json.loads(ln).get("step", 0) >= step for ln in metric_lines(rd)):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"step {step} not reached in {timeout}s")


HINTS = {"run-config": "run the same command to resume", "run-script": "run the same command to resume",
         "run-fn": "run the same command to resume", "python": f"resume with: {PY} {SCRIPT} {STEPS} 0.2",
         "torchrun": "resume with:"}


@pytest.mark.slow
@pytest.mark.parametrize("path", ["run-config", "run-script", "run-fn", "python", "torchrun"])
def test_every_guarantee_on_every_local_path(path, tmp_path):
    rd = run_dir_of(path, tmp_path)
    argv, env, cwd = command(path, tmp_path, rd, slow=True)
    first = start(argv, env, cwd)
    try:
        wait_for_step(rd, 3, first)
        # busy: refused at once, naming the holder; the first goes on, its records untouched
        records = rank_records(rd)
        argv2, env2, cwd2 = command(path, tmp_path, rd, slow=True)
        code2, err2 = finish(start(argv2, env2, cwd2), timeout=120)
        assert rank_records(rd) == records, "the refused process rewrote the running one's rank records"
        assert code2 == documented_exit("refused", column(path)) and "is in use by" in err2, (code2, err2[-3000:])
        assert "Traceback" not in err2 or path == "torchrun", err2[-3000:]   # torchrun prints its own
        assert first.poll() is None, "the first run was harmed by the refused second one"
        # stop: a real SIGTERM to the top process saves, exits non-zero, says how to resume
        before = max(json.loads(ln)["step"] for ln in metric_lines(rd))
        os.kill(first.pid, signal.SIGTERM)
        code, err = finish(first)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert code == documented_exit("stopped", column(path)), (code, err[-3000:])
    assert HINTS[path] in err, err[-3000:]
    if path.startswith("run-"):   # what the launcher says it does with the signal, true for the path
        said = "sending SIGTERM to every rank's script" if path == "run-script" else "asking every rank to stop"
        assert said in err, err[-3000:]
    if path == "torchrun":
        assert "torch.distributed.run" in err.split("resume with:")[1].splitlines()[0], err[-3000:]
    stopped = json.loads((rd / "stopped.json").read_text())
    assert stopped["stopped"] is True and stopped["checkpoint"] is True and stopped["steps"] >= before, stopped
    assert (rd / "checkpoints" / f"step-{stopped['steps']}" / "commit.json").is_file()
    assert (rd / "goodput.json").is_file() and not (rd / "result.json").exists()
    assert status(rd)[0] == "stopped", status(rd)
    a_crash_is_the_culprit_s_failure(path, tmp_path, rd, stopped["steps"])
    # the same command resumes and finishes: no stale stop record, a goodput record
    argv, env, cwd = command(path, tmp_path, rd, slow=False)
    code, err = finish(start(argv, env, cwd))
    assert code == documented_exit("finished", column(path)), err[-3000:]
    assert status(rd)[0] == "finished", status(rd)
    result = json.loads((rd / "result.json").read_text())
    assert not (rd / "stopped.json").exists(), "a stale stopped.json after the run finished"
    assert json.loads((rd / "goodput.json").read_text())["segments"], "no goodput segment"
    metrics = [json.loads(ln) for ln in metric_lines(rd)]
    assert [m["step"] for m in metrics if "loss" in m] == list(range(1, STEPS + 1)), "steps redone or lost"
    if path != "run-script":
        assert result.get("steps") == STEPS, result
    # finished: never trains again, one line, exit 0, nothing changes
    before_files = snapshot(rd)
    code, err = finish(start(argv, env, cwd))
    assert code == 0, err[-3000:]
    lines = [ln for ln in err.splitlines() if "finished" in ln]
    assert len(lines) == 1 and "nothing to do" in lines[0] and "starts over" in lines[0], err[-3000:]
    assert "Traceback" not in err
    assert snapshot(rd) == before_files, "the finished run's directory changed"


def a_crash_is_the_culprit_s_failure(path: str, tmp: Path, rd: Path, saved: int) -> None:
    """The last rank's code raises at its first step: the run fails with the documented code, the
    launcher and ``status`` name that rank (not a victim), and nothing is lost: no step is
    logged, the stop's checkpoint is still the newest."""
    culprit = 0 if path == "python" else 1
    argv, env, cwd = command(path, tmp, rd, slow=False, HPC_TEST_CRASH_RANK=str(culprit))
    code, err = finish(start(argv, env, cwd))
    assert code == documented_exit("failed", column(path)), (code, err[-3000:])
    assert "crashes, as the test asked" in err, err[-3000:]
    if path.startswith("run-"):
        assert f"rank {culprit} failed" in err, err[-3000:]
    word, said = status(rd)
    assert word == "failed" and re.search(rf"failed: rank {culprit}\b", said), said
    assert "crashes, as the test asked" in said, said
    assert max(json.loads(ln)["step"] for ln in metric_lines(rd)) == saved, "a step logged by a crashed run"
    newest = max(int(p.name.split("-")[1]) for p in (rd / "checkpoints").glob("step-*"))
    assert newest == saved, newest


def signal_rank_1(path: str, tmp: Path, rd: Path, sig: int) -> tuple[int, str, int]:
    """``path`` started slow; at step 3, ``sig`` to rank 1's process alone (its pid from its
    heartbeat). (exit code, stderr, that pid); nothing is left running."""
    argv, env, cwd = command(path, tmp, rd, slow=True)
    p = start(argv, env, cwd)
    try:
        wait_for_step(rd, 3, p)
        pid = json.loads((rd / "logs" / ".heartbeat" / "rank-1").read_text())["pid"]
        os.kill(pid, sig)
        code, err = finish(p)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return code, err, pid


@pytest.mark.slow
def test_a_lost_peer_is_one_line_naming_it_under_torchrun(tmp_path):
    """kill -9 of rank 1 under torchrun: rank 0's failed collective is reported in one line that
    names rank 1, its pid and host, not gloo's raw traceback (issue: "Connection reset by peer")."""
    rd = run_dir_of("torchrun", tmp_path)
    code, err, pid = signal_rank_1("torchrun", tmp_path, rd, signal.SIGKILL)
    assert code != 0
    lines = [ln for ln in err.splitlines() if "lost a peer" in ln]
    assert len(lines) == 1 and f"rank 1 (pid {pid} on {socket.gethostname()}) exited" in lines[0], err[-4000:]
    assert lines[0].startswith("hpc_train: rank 0 on "), lines
    rest = err.replace(lines[0], "")
    assert "Connection reset by peer" not in rest and "Connection closed by peer" not in rest, err[-4000:]
    assert "lost a peer" in (rd / "logs" / "rank-0.error").read_text()


@pytest.mark.parametrize("path", ["torchrun", "run-fn"])
def test_a_stop_that_reached_rank_1_only_names_its_signal(tmp_path, path):
    """Issue 51: a SIGTERM to rank 1 alone is a stop of every rank at one step (the agreement);
    rank 0, which writes the stop record and says the line, learned of it from its peer and
    said "checkpoint saved by none", and stopped.json held "stop_signal": "none"."""
    rd = run_dir_of(path, tmp_path)
    code, err, _ = signal_rank_1(path, tmp_path, rd, signal.SIGTERM)
    assert code == documented_exit("stopped", column(path)), err[-4000:]
    rec = json.loads((rd / "stopped.json").read_text())
    assert rec["stop_signal"] == "TERM" and rec["checkpoint"] is True, rec
    assert f"checkpoint saved by SIGTERM at step {rec['steps']}" in (rd / "logs" / "rank-0.log").read_text()
    assert "by none" not in err and "by none" not in status(rd)[1], err[-3000:]
