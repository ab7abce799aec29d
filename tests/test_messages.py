"""Issue 29.4: messages about a run, met as a user meets them (real processes).

* a resume hint comes only from the process that owns the command line, never from a script
  that hpc_train's launcher supervises.

Usage errors are one line on stderr, exit 2, no traceback, nothing written.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from ckpt_helpers import REPO, clean_env, show

OWN_LOOP = str(REPO / "tests" / "scripts" / "own_loop.py")
QUIET = ("--set", "log.tensorboard=false", "--set", "log.progress=lines")


def _one_line(p: subprocess.CompletedProcess) -> str:
    """The single line of a usage error (exit 2, nothing else on stderr or stdout)."""
    assert p.returncode == 2 and "Traceback" not in p.stderr, show(p)
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and p.stdout == "", show(p)
    return lines[0]


# -- the resume hint -------------------------------------------------------------------------

def test_a_supervised_script_prints_no_resume_hint_of_its_own(tmp_path):
    """SIGTERM to `run --script`: the launcher says how to resume; the script's own init(),
    whose command line (`python -u own_loop.py ...`) the user never typed, says nothing of it."""
    rd = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "hpc_train", "run", "--script", OWN_LOOP, "--run-dir", str(rd),
                          *QUIET, "--", "6000", "0.05"], cwd=REPO, env=clean_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    log = rd / "logs" / "rank-0.log"
    try:
        deadline = time.monotonic() + 120
        while not (log.is_file() and " step 10 " in log.read_text()):   # the script is in its loop
            assert p.poll() is None, p.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no step logged in 120 s"
            time.sleep(0.1)
        os.kill(p.pid, signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert json.loads((rd / "stopped.json").read_text())["checkpoint"] is True, err[-3000:]
    assert "resume with:" not in err, err[-3000:]
    assert "; run the same command to resume" in err, err[-3000:]
