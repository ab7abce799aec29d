"""Issue 50: JSON integers have no size limit, and ``math.isfinite``/``float`` raise OverflowError
on one beyond a float's range. Every record's reader takes such a number as any other bad value:
one line naming the file and the field, the record's other parts kept, no traceback: ``status``
and the batch shell's requeue hook (whose crash would end a job with no restart and no requeue)
go on."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from helpers import clean_env, hpc, show

from hpc_train import goodput
from hpc_train.records import fields, requeue, stop

HUGE = int("1" * 401)


@pytest.mark.parametrize("value, ok", [
    (0, True), (-3, True), (1.5, True), (1e308, True), (2**1023, True),
    (HUGE, False), (-HUGE, False), (math.inf, False), (math.nan, False), (True, False), ("1", False), (None, False),
])
def test_finite_is_a_float_s_finiteness_for_any_json_number(value, ok):
    assert fields.finite(value) is ok


@given(st.integers())
def test_finite_never_raises_on_an_integer(n):
    assert fields.finite(n) == (abs(n) < 2**1024 - 2**970)


def _requeue_json(rd: Path) -> None:
    state = requeue.RequeueState().requeued(requeue.Incarnation("7", 0), "preemption", 3, 1000.0, None)
    requeue.write(rd, state, print)
    text = (rd / requeue.NAME).read_text()
    (rd / requeue.NAME).write_text(re.sub(r'"time": 1000.0', f'"time": {HUGE}', text).replace(
        '"requeued_at": [\n    1000.0', f'"requeued_at": [\n    {HUGE}, 1000.0'))


def test_the_readers_set_a_huge_number_aside_in_one_line(tmp_path):
    _requeue_json(tmp_path)
    state = requeue.read(tmp_path)
    assert state.requeued_at == (1000.0,)
    assert len(state.problems) == 1 and "time is 1111" in state.problems[0] and len(state.problems[0]) < 200
    (tmp_path / stop.NAME).write_text(json.dumps({"steps": 3, "stop_signal": "SIGTERM", "checkpoint": True,
                                                  "stop_received_at": HUGE}))
    rec, problem = stop.read(tmp_path)
    assert rec is None and problem is not None and "stop_received_at" in problem and len(problem) < 200
    assert goodput._is_num(HUGE) is False


def test_status_and_the_requeue_hook_take_a_401_digit_time(tmp_path):
    rd = tmp_path / "run"
    rd.mkdir()
    _requeue_json(rd)
    p = hpc("status", rd, env=clean_env())
    assert p.returncode == 0 and "Traceback" not in p.stderr + p.stdout, show(p)
    # The hook of a job step that ended with status 0 and no rank records: it decides, in one line.
    p = hpc("requeue-hook", rd, "0", env=clean_env(SLURM_JOB_ID="7", PATH="/usr/bin:/bin"))
    assert "Traceback" not in p.stderr and p.stderr.startswith("hpc_train requeue-hook: "), show(p)


@pytest.mark.parametrize("value, ok", [
    (0, True), (1.7e9, True), (2**34 - 1, True), (2**34, False), (1e300, False), (-1, False), (-1e-9, False),
    (HUGE, False), (math.inf, False), (math.nan, False), (True, False), ("1.7e9", False), (None, False),
])
def test_a_time_is_what_localtime_and_a_duration_can_take(value, ok):
    assert fields.is_time(value) is ok


@given(st.floats(allow_nan=True, allow_infinity=True) | st.integers())
def test_is_time_never_raises_and_every_time_it_takes_is_a_local_time(v):
    import time
    if fields.is_time(v):
        time.localtime(v)
        time.strftime("%H:%M", time.localtime(v))


# A time "finite" for a float but no time at all (1e300 s; a negative one): status once printed a
# wall time of 301 digits from goodput.json. Each record names the field, in one line.
TIMES = {
    stop.NAME: lambda t: {"steps": 3, "stop_signal": "SIGTERM", "checkpoint": True, "stop_received_at": t},
    "job.json": lambda t: {"jobs": [{"job_id": "7", "via": "submit", "submitted": t}]},
    goodput.FILE: lambda t: {"segments": [{"start": t}], "first_submit": 1.7e9},
}


@pytest.mark.parametrize("name", TIMES)
@pytest.mark.parametrize("t", [1e300, -5.0])
def test_a_time_out_of_range_is_named_in_its_record(tmp_path, name, t):
    from hpc_train.records import jobs
    (tmp_path / name).write_text(json.dumps(TIMES[name](t)))
    problem = {stop.NAME: lambda: stop.read(tmp_path)[1], "job.json": lambda: jobs.read(tmp_path)[1],
               goodput.FILE: lambda: goodput.read(tmp_path)[1]}[name]()
    assert problem is not None and ("time" in problem or "start" in problem) and "\n" not in problem, problem
    assert len(problem) < 300
