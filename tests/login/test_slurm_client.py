"""The one Slurm client (hpc_train/slurm.py) as a table: each way a command can answer, and what
the caller gets. A command that is missing, hangs, fails or says nothing where an answer is needed
is *unknown* (``out`` None, one line in ``why``), never an empty answer. The commands are small
scripts on PATH (a controller that is down or hangs cannot be caused on demand on the shared
dev cluster); the real ones answer in tests/slurm/."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpc_train import slurm


@pytest.fixture
def on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def put(name: str, body: str) -> None:
        f = tmp_path / name
        f.write_text(f"#!/bin/sh\n{body}\n")
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    return put


CASES = [
    # (command, script body, call, expected out, expected why)
    ("squeue", 'echo "5|RUNNING"', lambda: slurm.squeue("-j", "5"), "5|RUNNING\n", ""),
    ("squeue", "exit 0", lambda: slurm.squeue("-j", "5"), None, "squeue answered nothing"),
    ("squeue", "exit 0", lambda: slurm.squeue("-j", "5", empty_ok=True), "", ""),
    ("squeue", 'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1',
     lambda: slurm.squeue("-j", "5"), "", ""),
    ("squeue", 'echo "slurm_load_jobs error: Unable to contact slurm controller" >&2; exit 1',
     lambda: slurm.squeue("-j", "5", empty_ok=True), None,
     "squeue failed: slurm_load_jobs error: Unable to contact slurm controller"),
    ("sacct", "exit 7", lambda: slurm.sacct("-j", "5"), None, "sacct failed: exit status 7"),
    ("sinfo", "exit 0", lambda: slurm.sinfo("-h"), None, "sinfo answered nothing"),
    ("scontrol", "exit 0", lambda: slurm.scontrol("requeue", "5"), "", ""),
    ("scontrol", "exit 0", lambda: slurm.scontrol("show", "config"), None, "scontrol answered nothing"),
    ("scancel", 'echo "scancel: error: Kill job error on job id 5: Access/permission denied" >&2; exit 1',
     lambda: slurm.scancel("5"), None,
     "scancel failed: scancel: error: Kill job error on job id 5: Access/permission denied"),
]


@pytest.mark.parametrize("name, body, call, out, why", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_answer_is_known_or_unknown_with_one_line(on_path, name, body, call, out, why):
    on_path(name, body)
    reply = call()
    assert (reply.out, reply.why) == (out, why)
    assert reply.known == (out is not None)


def test_a_missing_command_is_unknown(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    reply = slurm.sacct("-j", "5", empty_ok=True)
    assert (reply.out, reply.why) == (None, "sacct is not on PATH")
    assert not slurm.installed() and not slurm.can_query()


def test_a_command_that_hangs_is_unknown_after_the_timeout(on_path):
    on_path("sinfo", "exec sleep 30")
    reply = slurm._call(["sinfo", "-h"], empty_ok=False, timeout=0.5)
    assert (reply.out, reply.why) == (None, "sinfo did not answer in 0.5 s")


def test_an_action_reports_the_last_line_it_said(on_path):
    on_path("scontrol", 'echo "first" >&2; echo "requeued 5" >&2; exit 0')
    reply = slurm.scontrol("requeue", "5")
    assert reply.known and reply.last == "requeued 5"
