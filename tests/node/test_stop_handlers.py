"""Stop handlers are given back, compose with the program's own, and a late stop is no stop.

Issue 28 (5): after ``finish()``/``close()`` the handlers found at ``init()`` are back, so a program
that goes on after training (an evaluation, an upload) can be interrupted again; a handler the
program installed before ``init()`` is called with every stop and given back (Lightning's signal
connector does the same). Issue 29: a SIGTERM that arrives after ``finish()`` wrote ``result.json``
leaves the run finished: exit 0, no ``stopped.json``, ``status`` says finished.

Real processes and real signals, sent from here (tests/scripts/after_finish.py is the program).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import clean_env

# Every test here starts real training processes: not in `make test-fast`.
pytestmark = pytest.mark.procs

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
SCRIPT = str(ROOT / "tests" / "scripts" / "after_finish.py")


def _as_from_a_terminal() -> None:
    """The child starts with SIGINT at its default, as a program started from a terminal does
    (Python then installs its KeyboardInterrupt handler), whatever this pytest process inherited:
    one started in the background by a shell without job control has SIGINT ignored, and its
    children would inherit that (a fresh-clone rehearsal failed these tests so)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(argv: list[str], tmp: Path, **knobs: str) -> tuple[subprocess.Popen, Path]:
    """The process, its stderr going to a file the test can read while it runs."""
    err = tmp / "stderr.txt"
    p = subprocess.Popen(argv, cwd=tmp, env=clean_env(**knobs), stdout=subprocess.DEVNULL, stderr=err.open("w"),
                         start_new_session=True, preexec_fn=_as_from_a_terminal)
    return p, err


def wait_for(what, p: subprocess.Popen, err: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert p.poll() is None, f"ended ({p.returncode}) before it was time to signal:\n{err.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"never time to signal:\n{err.read_text()[-3000:]}"
        time.sleep(0.02)


def ended(p: subprocess.Popen, err: Path, timeout: float = 60) -> tuple[int, str]:
    try:
        code = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise AssertionError(f"still running {timeout}s after the signal:\n{err.read_text()[-3000:]}") from None
    return code, err.read_text()


def said(err: Path, line: str):
    return lambda: line in err.read_text()


def test_after_finish_ctrl_c_interrupts_the_program_again_and_sigterm_ends_it(tmp_path):
    """`python train.py` stopped once, then resumed to its finish, evaluates after finish(): Ctrl-C
    raises KeyboardInterrupt there, SIGTERM ends the process as it would any program, and the run
    stays finished (the first stop's record is gone though the exit handlers never ran)."""
    rd = tmp_path / "runs" / "after_finish"
    p, err = start([PY, SCRIPT], tmp_path, AFTER_STEPS="600", AFTER_SLEEP="0.05")
    try:
        wait_for(said(err, " INFO step 10 "), p, err)
        p.send_signal(signal.SIGTERM)
        assert ended(p, err)[0] == 3 and (rd / "stopped.json").is_file()
        p, err = start([PY, SCRIPT], tmp_path, AFTER_STEPS="20", AFTER_WORK_S="60")
        wait_for(said(err, "evaluating\n"), p, err)
        p.send_signal(signal.SIGINT)
        wait_for(said(err, "evaluating again"), p, err, timeout=20)
        p.send_signal(signal.SIGTERM)
        code, text = ended(p, err, timeout=20)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert "handlers after finish: TERM=SIG_DFL INT=default_int_handler USR2=SIG_IGN" in text, text[-3000:]
    assert "KeyboardInterrupt during the evaluation" in text, text[-3000:]
    assert code == -signal.SIGTERM, (code, text[-3000:])
    assert json.loads((rd / "result.json").read_text())["steps"] == 20
    assert not (rd / "stopped.json").exists()


@pytest.mark.parametrize("sig", ["TERM", "USR2", "INT"])
def test_own_handler_is_called_with_the_stop_and_given_back(sig, tmp_path):
    """The program's own SIGTERM and SIGUSR2 handlers (installed before init()) are called when that
    signal stops the run, which still saves and stops; Python's SIGINT handler is not called (it
    would raise KeyboardInterrupt mid-step). After close() each handler is the one found."""
    p, err = start([PY, SCRIPT], tmp_path, AFTER_HANDLERS="1", AFTER_STEPS="600", AFTER_SLEEP="0.05")
    rd = tmp_path / "runs" / "after_finish"
    try:
        wait_for(said(err, " INFO step 10 "), p, err)   # own_loop's first console line
        p.send_signal(getattr(signal, f"SIG{sig}"))
        code, text = ended(p, err)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert code == 3, (code, text[-3000:])   # errors.EXIT_STOPPED
    called = [ln for ln in text.splitlines() if ln.startswith("user handler:")]
    assert called == ([] if sig == "INT" else [f"user handler: SIG{sig}"]), text[-3000:]
    assert "KeyboardInterrupt" not in text, text[-3000:]
    rec = json.loads((rd / "stopped.json").read_text())
    assert rec["stop_signal"] == sig and rec["checkpoint"] is True, rec
    assert "handlers after close: TERM=mine INT=default_int_handler USR2=mine" in text, text[-3000:]


def _config(tmp: Path) -> str:
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump({
        "data": {"name": "synthetic", "synthetic_size": 64, "batch_size": 16},
        "model": {"name": "tests.scripts.after_finish:slow_exit_model"}, "train": {"max_steps": 4, "eval": False},
        "log": {"tensorboard": False, "progress": "lines"}}))
    return str(path)


def _command(path: str, tmp: Path) -> tuple[list[str], Path]:
    hpc = [PY, "-m", "hpc_train", "run", "--nproc", "1", "--run-dir", str(tmp / "run")]
    return {"python": ([PY, SCRIPT], tmp / "runs" / "after_finish"),
            "run-script": ([*hpc, "--script", SCRIPT], tmp / "run"),
            "run-fn": ([*hpc, "--fn", "tests.scripts.after_finish:fn"], tmp / "run"),
            "run-config": ([*hpc, _config(tmp)], tmp / "run")}[path]


@pytest.mark.parametrize("path", ["python", "run-script", "run-fn", "run-config"])
def test_a_stop_signal_after_finish_is_no_stop(path, tmp_path):
    """SIGTERM to the top process while the finished run's process exits (the interpreter's
    teardown of `python train.py`, a script's under `run --script`, an exit handler under `run`):
    exit 0, no stopped.json, and status says finished."""
    argv, rd = _command(path, tmp_path)
    marks = tmp_path / "marks"
    marks.mkdir()
    p, err = start(argv, tmp_path, HPC_TEST_MARK_DIR=str(marks), HPC_TEST_EXIT_S="1.5", AFTER_STEPS="4")
    try:
        wait_for((marks / "exiting-rank0").exists, p, err)
        assert (rd / "result.json").is_file()
        p.send_signal(signal.SIGTERM)
        code, text = ended(p, err)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert code == 0, (code, text[-3000:])
    assert (rd / "result.json").is_file()
    assert not (rd / "stopped.json").exists(), text[-3000:]
    status = subprocess.run([PY, "-m", "hpc_train", "status", str(rd)], env=clean_env(), capture_output=True, text=True,
                            timeout=60)
    assert "finished" in status.stdout and "stopped" not in status.stdout, status.stdout + status.stderr
