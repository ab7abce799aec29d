"""One stop record: rank 0's request for the batch shell rides in ``stopped.json``, with the signal
in the one form the hook compares with ``job.signal``; an earlier version's ``requeue.pending``
is still read. The writer is the real one (``stops.record_stop``, after a real StopRequest got a
signal); the environment is a Slurm step's."""

from __future__ import annotations

import json
import os
import signal
import time
from types import SimpleNamespace

import pytest

from hpc_train import requeue as requeue_side
from hpc_train import rundir
from hpc_train.node.stops import StopRequest, record_stop
from hpc_train.records import requeue, stop


@pytest.fixture
def step(monkeypatch):
    for k, v in {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "2", rundir.ATTEMPT_ENV: "3"}.items():
        monkeypatch.setenv(k, v)
    return SimpleNamespace(rank=0, job_id="77", requeue_target="77_4")


def _stopped_by(signum: int) -> StopRequest:
    s = StopRequest()
    s._record(signum)            # what its handler records when the signal comes
    return s


@pytest.mark.parametrize("sig, form", [(signal.SIGUSR2, "USR2"), (signal.SIGTERM, "TERM"), (signal.SIGINT, "INT")])
def test_rank_0_s_stop_record_holds_the_request_and_the_signal_in_one_form(tmp_path, step, sig, form):
    record_stop(step, tmp_path, _stopped_by(sig), 40, True)
    raw = json.loads((tmp_path / stop.NAME).read_text())
    assert raw["stop_signal"] == form and raw["steps"] == 40 and raw["checkpoint"] is True, raw
    assert raw["request"] == {"target": "77_4", "job": "77", "restart": 2, "attempt": 3, "swap": None,
                              "swap_rank": None}, raw
    assert not requeue.pending_path(tmp_path).exists()
    pending, problem = requeue.read_pending(tmp_path)
    assert problem is None and pending is not None
    assert (pending.target, pending.step, pending.signal, pending.attempt) == ("77_4", 40, form, 3)
    assert pending.signal == form == stop.read(tmp_path)[0].signal


def test_a_straggler_stop_names_the_node_to_swap(tmp_path, step):
    s = StopRequest()
    s.straggler(1, "node2")
    record_stop(step, tmp_path, s, 12, True)
    pending, _ = requeue.read_pending(tmp_path)
    assert (pending.signal, pending.swap, pending.swap_rank) == ("straggler", "node2", 1)


def test_the_request_is_this_step_s_only_in_this_step(tmp_path, step, monkeypatch):
    record_stop(step, tmp_path, _stopped_by(signal.SIGUSR2), 40, True)
    assert requeue_side.requested(tmp_path)
    monkeypatch.setenv(rundir.ATTEMPT_ENV, "4")          # the next step of the allocation
    assert not requeue_side.requested(tmp_path)


def test_off_slurm_a_stop_record_holds_no_request(tmp_path):
    record_stop(SimpleNamespace(rank=0, job_id="", requeue_target=""), tmp_path, _stopped_by(signal.SIGTERM), 5, True)
    assert stop.read(tmp_path)[0].request is None and requeue.read_pending(tmp_path) == (None, None)


def test_the_stop_record_s_request_wins_over_an_earlier_version_s_requeue_pending(tmp_path, step):
    requeue.pending_path(tmp_path).write_text(json.dumps({"target": "5", "step": 1, "signal": "SIGTERM", "job": "5"}))
    assert requeue.read_pending(tmp_path)[0].source == requeue.PENDING            # alone: read as before
    assert requeue.read_pending(tmp_path)[0].signal == "TERM"                      # in the one form
    record_stop(step, tmp_path, _stopped_by(signal.SIGUSR2), 40, True)
    pending, _ = requeue.read_pending(tmp_path)
    assert (pending.source, pending.job, pending.step) == (stop.NAME, "77", 40)


def test_a_damaged_stop_record_is_a_problem_only_when_written_since(tmp_path):
    stop.path(tmp_path).write_text('{"stopped": true, "request": {"target": "rm -rf"}}')
    pending, problem = requeue.read_pending(tmp_path, since=time.time() - 60)
    assert pending is None and problem.startswith("stopped.json request.target is 'rm -rf'"), problem
    old = time.time() - 3600
    os.utime(stop.path(tmp_path), (old, old))
    assert requeue.read_pending(tmp_path, since=time.time() - 60) == (None, None)


def test_a_line_says_the_signal_as_sig_and_an_old_record_s_form_reads_the_same(tmp_path):
    stop.path(tmp_path).write_text(json.dumps({"steps": 3, "stop_signal": "SIGUSR2", "checkpoint": True}))
    rec, _ = stop.read(tmp_path)
    assert rec.signal == "USR2" and stop.said(rec.signal) == "SIGUSR2" and stop.said("straggler") == "straggler"


@pytest.mark.parametrize("asked, step, mine", [
    (("77", 2, 3), ("77", 2, 3), True),
    (("77", 2, 3), ("77", 2, 4), False),       # the next step of the allocation (an in-place restart)
    (("77", 2, 3), ("77", 3, 1), False),       # the next incarnation (a requeue)
    (("77", 2, 3), ("78", 2, 3), False),       # another job in the same run directory
    (("77", 2, 0), ("77", 2, 4), True),        # a batch script that did not count its steps ran one
    (("77", 2, 3), ("77", 2, 0), True),
])
def test_which_step_a_request_is_of(asked, step, mine):
    """One rule for the hook (login/gather) and the submitted worker (requeue.requested)."""
    from hpc_train.records.ranks import StepId
    p = requeue.Pending("77", 1, "USR2", None, *asked)
    assert p.is_of(StepId(*step)) is mine
