"""The Run API refuses misuse at the call that makes it, in one line naming the call and the value
(a user's own loop, through ``hpc_train.init()`` in a real process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import clean_env

# Every test here starts real training processes: not in `make test-fast`.
pytestmark = pytest.mark.procs

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "run_api_misuse.py")


def misuse(case: str, tmp_path: Path) -> tuple[str, str, Path]:
    r = subprocess.run([sys.executable, SCRIPT, case], cwd=tmp_path, env=clean_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout, r.stderr, tmp_path / "runs" / "run_api_misuse"


def test_log_takes_numbers_and_one_element_tensors_and_refuses_the_rest(tmp_path):
    out, _, rd = misuse("log-values", tmp_path)
    rec = json.loads((rd / "metrics.jsonl").read_text().splitlines()[0])
    assert rec["loss"] == 1.5 and rec["acc"] == 0.25 and rec["n"] == 3, rec
    refused = [ln for ln in out.splitlines() if ln.startswith("REFUSED")]
    assert len(refused) == 3, out
    assert "run.log: note='abc' is not a number" in refused[0]
    assert "run.log: loss=" in refused[1] and "run.log: flag=True" in refused[2]
    assert len((rd / "metrics.jsonl").read_text().splitlines()) == 1, "a refused value reached the record"


@pytest.mark.parametrize("case, why", [("negative", "is -3, below 0"), ("backwards", "is 4, below the previous step 5")])
def test_step_end_refuses_a_step_below_zero_or_going_backwards(tmp_path, case, why):
    out, _, rd = misuse(case, tmp_path)
    assert f"REFUSED run.step_end: state['step'] {why}" in out, out
    assert not list(rd.glob("checkpoints/step--*")), "a checkpoint below step 0 was written"


def test_finish_twice_changes_nothing_and_says_so(tmp_path):
    out, err, rd = misuse("finish-twice", tmp_path)
    assert "SAME True" in out, out
    assert json.loads((rd / "result.json").read_text())["loss"] == 1.0
    assert "finish() called again" in err, err[-2000:]
