"""Issue 33 (5): a plain PyTorch Lightning script (jobs/lightning_digits.py) under
`run --script --nproc 2`: Lightning trains as the 2 ranks hpc_train started, a real SIGTERM to the
launcher (Ctrl-C's path: SIGTERM to every rank's script) saves through Lightning's own SIGTERM path
(SIGTERMException, then OnExceptionCheckpoint), and the same command resumes from it to weights
bitwise those of an uninterrupted run.

The stop lands on an epoch boundary: every rank waits at an epoch's end while a pause file exists
(``--pause-file``, until a stop comes), and the test signals once rank 0 says the epoch ended.
That is the case Lightning resumes bitwise: a stop inside an epoch restarts that epoch's data from
its beginning (docs/lightning.md).
ModelCheckpoint saves every 10 steps, which falls inside an epoch of 14: the stop's own save is
what makes the resume exact.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
import torch
from helpers import REPO, assert_same_weights, hpc, show, start
from hpc_train.errors import EXIT_STOPPED

# Every test here starts real training processes: not in `make test-fast`.
pytestmark = pytest.mark.procs

SCRIPT = str(REPO / "jobs" / "lightning_digits.py")
EPOCHS = 4          # of 14 steps each on 2 ranks (1792 digits, 64 per rank and step)


def _cmd(tmp, *extra: str, epochs: int = EPOCHS) -> tuple:
    return ("run", "--script", SCRIPT, "--nproc", "2", "--run-dir", tmp / "run", "--", "--root", tmp / "ld",
            "--epochs", str(epochs), "--every-n-steps", "10", "--weights", tmp / "final.pt", *extra)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Uninterrupted: the weights every resumed run must equal."""
    d = tmp_path_factory.mktemp("lightning-straight")
    p = hpc(*_cmd(d), timeout=300)
    assert p.returncode == 0, show(p)
    for rank in (0, 1):
        log = (d / "run" / "logs" / f"rank-{rank}.log").read_text()
        # Lightning took its ranks from hpc_train's variables and made a group of exactly these two.
        assert f"rank {rank} of 2 (LightningEnvironment)" in log, log[-3000:]
        assert log.count("Initializing distributed:") == 1
        assert f"GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/2" in log
    assert json.loads((d / "run" / "result.json").read_text())["world_size"] == 2
    return torch.load(d / "final.pt", weights_only=True)


def _stop_once_logged(p: subprocess.Popen, log, text: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """SIGTERM to the launcher once rank 0's log holds ``text``; then wait for it to exit."""
    deadline = time.monotonic() + timeout
    while not (log.exists() and text in log.read_text()):
        assert p.poll() is None, f"ended before {text!r} was logged:\n{p.communicate()[1][-4000:]}"
        assert time.monotonic() < deadline, f"{text!r} never logged"
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_stopped_at_an_epoch_end_saves_through_lightning_and_resumes_bitwise(straight, tmp_path):
    pause = tmp_path / "pause"
    pause.touch()
    cmd = _cmd(tmp_path, "--pause-file", pause)
    ckpts, logs = tmp_path / "ld" / "checkpoints", tmp_path / "run" / "logs"
    p = _stop_once_logged(start(*cmd), logs / "rank-0.log", "epoch 0 ended at step 14")
    assert p.returncode == EXIT_STOPPED, show(p)
    for rank in (0, 1):     # Lightning's own handler got it on every rank
        assert "Received SIGTERM: 15" in (logs / f"rank-{rank}.log").read_text()
    saved = torch.load(ckpts / "on_exception.ckpt", weights_only=False)
    assert (saved["epoch"], saved["global_step"]) == (1, 14)      # one whole epoch, none begun
    assert torch.load(ckpts / "last.ckpt", weights_only=False)["global_step"] == 10
    rec = json.loads((tmp_path / "run" / "stopped.json").read_text())
    assert rec["stop_signal"] == "TERM" and not (tmp_path / "run" / "result.json").exists()

    pause.unlink()
    p = hpc(*cmd, timeout=300)                                     # the same command
    assert p.returncode == 0, show(p)
    out = p.stdout + p.stderr
    assert f"Restoring states from the checkpoint path at {ckpts / 'on_exception.ckpt'}" in out, show(p)
    assert "ended before the epoch ended" not in out                # Lightning's warning for a mid-epoch resume
    assert "epoch 0 ended" not in out and "epoch 1 ended at step 28" in out      # no epoch trained twice
    assert_same_weights(straight, torch.load(tmp_path / "final.pt", weights_only=True))
    assert (tmp_path / "run" / "result.json").exists()
    assert not (ckpts / "on_exception.ckpt").exists()       # Lightning removes it once fit ends normally


def test_stop_together_stops_inside_an_epoch_without_hanging(tmp_path):
    """Lightning's own SIGTERM path can hang when the stop reaches the ranks at different points of
    a step (docs/lightning.md); the example's StopTogether callback has every rank stop at the same
    step. Stopped inside an epoch: it saves there, exits, and the same command finishes the run."""
    epochs = 12                             # long enough that the stop lands before the end
    cmd = _cmd(tmp_path, "--stop-together", epochs=epochs)
    ckpts = tmp_path / "ld" / "checkpoints"
    p = start(*cmd)
    log = tmp_path / "run" / "logs" / "rank-0.log"
    deadline = time.monotonic() + 240
    while not (log.exists() and "epoch 1 ended at step 28" in log.read_text()):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-4000:]
        time.sleep(0.02)
    time.sleep(0.1)                         # somewhere in epoch 2 or later, mid-step
    signalled = time.monotonic()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == EXIT_STOPPED, err[-4000:]
    assert time.monotonic() - signalled < 60, err[-4000:]
    step = torch.load(ckpts / "on_exception.ckpt", weights_only=False)["global_step"]
    assert 28 < step < epochs * 14, step
    p = hpc(*cmd, timeout=300)
    assert p.returncode == 0, show(p)
    assert f"Restoring states from the checkpoint path at {ckpts / 'on_exception.ckpt'}" in p.stdout + p.stderr
    assert f"epoch {epochs - 1} ended at step {epochs * 14}" in p.stdout + p.stderr
