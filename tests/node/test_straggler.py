"""Issue 31.3, rank 0's side of a straggler swap, without Slurm: when a named rank is due for a
swap (named for the whole ``dist.straggler_window_s``), where a swap can be asked for at all
(a pure function of the environment, given as a mapping), and the stop it asks for, which a
real signal outranks. The end-to-end swap runs on the real cluster
(tests/slurm/test_preemption.py::test_a_straggler_s_node_is_swapped_for_the_spare_and_resumes_bitwise)."""

from __future__ import annotations

import signal
import time

import pytest

from hpc_train.node.stops import StopRequest
from hpc_train.node.straggler import Stragglers, swap_refusal
from hpc_train.records import ranks
from hpc_train.rundir import ATTEMPT_ENV

STEP = {ATTEMPT_ENV: "1", "SLURM_JOB_NODELIST": "node[1-3]", "SLURM_STEP_NODELIST": "node[1-2]"}


@pytest.mark.parametrize("env,checkpoints,why", [
    (STEP, True, None),
    (STEP, False, "checkpoints are off"),
    ({**STEP, ATTEMPT_ENV: ""}, True, "not a job step of hpc_train's batch script"),
    ({**STEP, "SLURM_STEP_NODELIST": "node[1-3]"}, True, "no node of the allocation is left outside"),
    ({**STEP, "SLURM_STEP_NODELIST": "node[1,3]"}, True, None),       # after a swap: node2 is outside
    ({**STEP, "SLURM_JOB_NODELIST": "node[1-"}, True, "no node of the allocation is left outside"),
    ({ATTEMPT_ENV: "2"}, True, "no node of the allocation is left outside"),
])
def test_a_swap_is_asked_for_only_under_the_batch_script_with_checkpoints_and_a_spare(env, checkpoints, why):
    got = swap_refusal(env, checkpoints)
    assert got == why if why is None else why in got, got


def _named(tmp_path, window_s: float) -> Stragglers:
    ranks.begin(tmp_path, 1, 2)     # where rank 1 runs: its record, as on a node
    s = Stragglers(10, 1.3, 0, 2, True, tmp_path, window_s=window_s, replace=True)
    for step in (10, 20):
        s._history.append([0.010, 0.020])       # rank 1 twice as slow in both gatherings of the window
        s._name(step, 0.015)
    assert s.named == {1: 10}
    return s


def test_a_rank_is_due_for_a_swap_only_once_named_for_the_whole_window(tmp_path):
    s = _named(tmp_path, 0.3)
    assert s._due() is None
    time.sleep(0.35)
    assert s._due() == (1, ranks.read(tmp_path, 1)[0].node)


def test_a_rank_back_within_the_ratio_starts_the_window_again(tmp_path):
    s = _named(tmp_path, 0.3)
    for step in (30, 40):
        s._history.append([0.010, 0.010])
        s._name(step, 0.010)
    assert s.named == {} and s.named_at == {}
    time.sleep(0.35)
    assert s._due() is None


def test_the_straggler_stop_names_the_node_and_a_signal_outranks_it():
    stop = StopRequest()
    stop.straggler(1, "node2")
    assert stop.requested and stop.name == "straggler" and stop.swap == (1, "node2")
    stop._handler(signal.SIGUSR2, None)       # the scheduler's stop, before the step boundary
    assert stop.swap is None and stop.name == "SIGUSR2"
    first = StopRequest()
    first.request(signal.SIGTERM)
    first.straggler(1, "node2")              # a stop asked for already wins
    assert first.swap is None and first.name == "SIGTERM"
