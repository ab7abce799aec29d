"""A finished program on init() leaves no live process group to the interpreter's teardown,
whoever made the group: torch's teardown of a live gloo group can abort a finished process
(SIGABRT, "terminate called without an active exception"; seen on a Trainer's ranks, whose
group the Trainer makes and never destroys), a finished run looking crashed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import clean_env

# Every test here starts real training processes: not in `make test-fast`.
pytestmark = pytest.mark.procs

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "program_group.py")


@pytest.mark.parametrize("maker", ["program", "hpc"])
def test_a_finished_program_leaves_no_process_group_to_the_teardown(tmp_path, maker):
    out = tmp_path / "after.json"
    r = subprocess.run([sys.executable, SCRIPT, str(out), maker], cwd=tmp_path, env=clean_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "runs" / "program_group" / "result.json").exists(), r.stderr[-3000:]
    # The exit handler registered before init() runs after hpc_train's: the group is gone by then.
    assert json.loads(out.read_text()) == {"initialized": False}, (maker, r.stderr[-3000:])
