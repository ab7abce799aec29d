"""docs/own-code.md's epoch-based loop (tests/scripts/epoch_loop.py), stopped at 2 ranks and
resumed at 1: ``loader.epoch`` carries the epoch across the change of world size, the rest of
the epoch is its unseen samples, and each epoch's end-of-epoch work runs exactly once, also when
the stop landed on an epoch's last batch.

Real processes: ``run --script`` with 2 ranks, a stop the script asks for (``run.request_stop``),
then ``run --script`` with 1 rank into the same run directory.
"""

from __future__ import annotations

import json

import pytest
from helpers import REPO, clean_env, hpc, show

# Every test here starts real training processes: not in `make test-fast`.
pytestmark = pytest.mark.procs

SCRIPT = str(REPO / "tests" / "scripts" / "epoch_loop.py")
QUIET = ("--set", "log.tensorboard=false", "--set", "log.progress=lines")
BATCHES = 24   # per epoch at 1 rank: 96 samples in batches of 4 (12 per rank at 2 ranks)


@pytest.mark.slow
@pytest.mark.parametrize("stop_at", [5, 11], ids=["mid-epoch", "last-batch"])
def test_an_epoch_loop_resumes_at_another_world_size(tmp_path, stop_at):
    rd = tmp_path / "run"
    p = hpc("run", "--script", SCRIPT, "--nproc", "2", "--run-dir", rd, *QUIET, env=clean_env(STOP_AT=str(stop_at)))
    assert p.returncode != 0 and (rd / "stopped.json").is_file(), show(p)   # stopped: not finished
    s = json.loads((rd / "stopped.json").read_text())["steps"]   # the stop lands within a step of asking
    epoch, taken = (s - 1) // (BATCHES // 2), (s - 1) % (BATCHES // 2) + 1   # the last batch taken, at 2 ranks
    p = hpc("run", "--script", SCRIPT, "--nproc", "1", "--run-dir", rd, *QUIET)
    assert p.returncode == 0, show(p)
    assert "saved at world size 2, now 1: resharded" in (rd / "logs" / "rank-0.log").read_text()
    # At 1 rank, the epoch goes on after the 2 x taken batches of it already used.
    end = s + BATCHES - 2 * taken
    expected = [f"epoch {e} ended at step {end + (e - epoch) * BATCHES}, lr {0.1 * 0.5 ** (e + 1):g}"
                for e in range(epoch, 3)]
    assert [ln for ln in p.stdout.splitlines() if ln.startswith("epoch ")] == expected, show(p)
    assert json.loads((rd / "result.json").read_text())["steps"] == end + (2 - epoch) * BATCHES
