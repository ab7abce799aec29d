"""A reader that goes away (``status | head -1``) ends a command quietly, as it ends ``cat`` or
``grep``: nothing on stderr, exit status 141 (128 + SIGPIPE).

Each command writes into a pipe whose read end is already closed, so its first write fails
whatever the timing; the last case is the pipeline a user types.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, clean_env


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A local run that has ended, with a log of some length and a logged step."""
    rd = tmp_path / "run"
    (rd / "logs").mkdir(parents=True)
    (rd / "logs" / "rank-0.log").write_text("".join(f"[rank 0] line {i}\n" for i in range(200000)))
    (rd / "metrics.jsonl").write_text('{"step": 3, "loss": 1.5}\n')
    return rd


def _into_closed_pipe(args: list[str], buffered: bool) -> subprocess.CompletedProcess:
    """Buffered, the first write to fail is the last flush; unbuffered (PYTHONUNBUFFERED, common
    in batch jobs), every write fails at once."""
    env = clean_env()
    env.pop("PYTHONUNBUFFERED", None)
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([sys.executable, "-m", "hpc_train", *args], cwd=REPO, env=env,
                              stdout=w, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w)


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("argv", [("status", "{run}"), ("logs", "{run}"), ("logs", "{run}", "-f"),
                                  ("config", "jobs/digits.yaml"), ("env",), ("--help",), ("status", "--help")],
                         ids=lambda a: " ".join(a).replace("{run}", "RUN"))
def test_a_closed_stdout_ends_the_command_quietly(run_dir, argv, buffered):
    p = _into_closed_pipe([a.replace("{run}", str(run_dir)) for a in argv], buffered)
    assert (p.returncode, p.stderr) == (141, ""), p.stderr


def test_logs_piped_into_head(run_dir):
    p = subprocess.run(["bash", "-c", f'{sys.executable} -m hpc_train logs {run_dir} | head -1; '
                                      'echo "exit ${PIPESTATUS[0]}" >&2'],
                       cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert p.stdout == "[rank 0] line 0\n"
    assert p.stderr == "exit 141\n", p.stderr
