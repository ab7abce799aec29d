"""Damaged checkpoints met by a user's own loop (``python train.py``, ``torchrun train.py``), where no
launcher of hpc_train's checked them first: the ranks find the damage as they load.

Real processes, real checkpoints, real damage on disk. The script is tests/scripts/own_loop.py (the
README's loop) behind a three-line wrapper that asks for a save every 2 steps.
"""

from __future__ import annotations

import random
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, clean_env, snapshot

# Every test here starts real training processes: not in `make test-fast`.
pytestmark = pytest.mark.procs

WRAPPER = f"""import sys
sys.path.insert(0, {str(REPO / "tests" / "scripts")!r})
import hpc_train
hpc_train.init(overrides=["checkpoint.every_steps=2", "checkpoint.keep=3", "log.tensorboard=false"])
import own_loop
own_loop.main(int(sys.argv[1]))
"""


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def loop(cwd: Path, steps: int, nproc: int = 1) -> subprocess.CompletedProcess:
    """``python loop.py STEPS`` (nproc 1) or ``torchrun --nproc_per_node N loop.py STEPS`` in ``cwd``."""
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                                      "--master_port", _port()]
    return subprocess.run([sys.executable, *launcher, "loop.py", str(steps)], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=180)


def out(p: subprocess.CompletedProcess) -> str:
    return f"exit {p.returncode}\n--- stderr\n{p.stderr[-6000:]}"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Checkpoints step-2 and step-4 of a 2-rank ``torchrun`` run of 4 steps, marked unfinished."""
    d = tmp_path_factory.mktemp("own-loop")
    (d / "loop.py").write_text(WRAPPER)
    p = loop(d, 4, nproc=2)
    assert p.returncode == 0, out(p)
    (d / "runs" / "loop" / "result.json").unlink()     # a finished run would not start again
    return d


@pytest.fixture
def copy(base, tmp_path):
    shutil.copytree(base, tmp_path / "d")
    return tmp_path / "d", tmp_path / "d" / "runs" / "loop" / "checkpoints"


def _flip(path: Path, seed: int) -> None:
    data = bytearray(path.read_bytes())
    rng = random.Random(seed)
    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


def test_a_damaged_metadata_falls_back_on_every_rank_in_one_line(copy):
    """The damaged ``.metadata`` is named once, and every rank goes on from the older step: DCP
    never falls back to an unchecked per-rank ``__R.metadata`` (which a planted file would answer)."""
    d, root = copy
    _flip(root / "step-4" / ".metadata", 4)
    p = loop(d, 6, nproc=2)
    assert p.returncode == 0, out(p)
    assert "Traceback" not in p.stderr and "__0.metadata" not in p.stderr and "__1.metadata" not in p.stderr, out(p)
    skips = [ln for ln in p.stderr.splitlines() if "skipping" in ln]
    assert len(skips) == 1 and "checkpoint step 4 (" in skips[0] and ".metadata fails its crc32c check" in skips[0], out(p)
    for r in (0, 1):   # every rank resumed from step 2
        log = (d / "runs" / "loop" / "logs" / f"rank-{r}.log").read_text()
        assert "resumed from step 2 (runs/loop/checkpoints/step-2)" in log, log[-3000:]


def test_every_checkpoint_damaged_under_plain_python_is_one_line(copy):
    """Plain ``python train.py`` with every checkpoint damaged: one line that names each and says
    what to do (as ``run`` does), exit non-zero, no traceback, nothing deleted or moved."""
    d, root = copy
    _flip(root / "step-4" / "__1_0.distcp", 1)
    _flip(root / "step-2" / ".metadata", 2)
    before = snapshot(root)
    p = loop(d, 6)
    assert p.returncode != 0, out(p)
    assert "Traceback" not in p.stderr, out(p)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("hpc_train:")]
    assert len(errors) == 1, out(p)
    assert re.search(r"step 4: .*__1_0\.distcp.* fails its crc32c check", errors[0]), out(p)
    assert re.search(r"step 2: \.metadata fails its crc32c check", errors[0]), out(p)
    assert "HPC_TRAIN_RESUME=none" in errors[0], out(p)
    assert snapshot(root) == before
