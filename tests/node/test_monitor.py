"""metrics.jsonl and the TensorBoard events are written through files kept open and flushed on a
clock (issue 32): no open of either file per record (TensorBoard's own writer opened its event
file once per scalar), everything on disk after close, a running run's records on disk within
one flush interval, and a resume's purge marker as ``SummaryWriter(purge_step=...)`` wrote it.
In-process: the monitor is rank 0's reporter, and nothing in it needs a process group."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

from hpc_train import rundir
from hpc_train.node import monitor as monitor_mod
from hpc_train.node.monitor import Monitor
from tests.helpers import tb_scalar_steps


def _monitor(run_dir: Path, start_step: int = 0) -> Monitor:
    return Monitor(run_dir, 100, start_step, enabled=True, tensorboard=True, progress="off")


def _event_steps(run_dir: Path, tag: str = "train/loss") -> list[int]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    return [ev.step for f in sorted((run_dir / rundir.TB).glob("events.out.tfevents.*"))
            for ev in EventFileLoader(str(f)).Load() for v in ev.summary.value if v.tag == tag]


def _metric_steps(run_dir: Path) -> list[int]:
    return [json.loads(ln)["step"] for ln in (run_dir / rundir.METRICS).read_text().splitlines()]


def test_no_open_per_record_and_everything_on_disk_after_close(tmp_path, monkeypatch):
    m = _monitor(tmp_path)
    metrics_file, events_file = m._f, m._tb.file
    inode = os.fstat(events_file.fileno()).st_ino
    opened: list[str] = []
    real_os_open, real_io_open = os.open, io.open

    def spy_os_open(path, *a, **kw):
        opened.append(os.fsdecode(path))
        return real_os_open(path, *a, **kw)

    def spy_io_open(file, *a, **kw):
        opened.append(os.fsdecode(file) if isinstance(file, (str, bytes, os.PathLike)) else str(file))
        return real_io_open(file, *a, **kw)

    monkeypatch.setattr(os, "open", spy_os_open)
    monkeypatch.setattr(io, "open", spy_io_open)   # what TensorBoard's stub GFile opened per record
    for step in range(1, 201):
        m.record(step, {"loss": 1.0 / step, "acc": 0.5, "lr": 1e-3})
        if step % 50 == 0:
            m.scalar("goodput/training", 0.9, step)
            m.flush()
    m.record(200, {"eval_loss": 0.1, "eval_acc": 0.9})
    assert m._f is metrics_file and m._tb.file is events_file      # the same file objects throughout
    assert not [p for p in opened if str(tmp_path) in p], opened    # and nothing opened again
    monkeypatch.undo()
    assert os.stat(m._tb.path).st_ino == inode
    m.close()
    assert events_file.closed and metrics_file.closed
    assert _event_steps(tmp_path) == list(range(1, 201))
    assert _event_steps(tmp_path, "eval/acc") == [200]
    assert _event_steps(tmp_path, "goodput/training") == [50, 100, 150, 200]
    assert _metric_steps(tmp_path) == [*range(1, 201), 200]
    m.close()   # idempotent


def test_records_reach_the_disk_on_a_clock_without_close(tmp_path, monkeypatch):
    """The first step at once; later steps within a flush interval, though the loop logs nothing
    more (a long evaluation, a hang): a crash then loses at most one interval."""
    monkeypatch.setattr(monitor_mod, "FLUSH_S", 0.2)
    m = _monitor(tmp_path)
    try:
        m.record(1, {"loss": 1.0})
        assert _metric_steps(tmp_path) == [1] and _event_steps(tmp_path) == [1]   # the first step at once
        for step in range(2, 6):
            m.record(step, {"loss": 1.0})
        deadline = time.monotonic() + 10
        while _metric_steps(tmp_path)[-1] != 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _metric_steps(tmp_path) == [1, 2, 3, 4, 5]
        assert _event_steps(tmp_path) == [1, 2, 3, 4, 5]
    finally:
        m.close()


def test_eval_is_on_disk_at_once(tmp_path):
    m = _monitor(tmp_path)   # FLUSH_S of 5 s: only the eval's own flush can put step 3 there now
    try:
        m.record(1, {"loss": 1.0})
        m.record(2, {"loss": 1.0})
        m.record(3, {"eval_acc": 0.5})
        assert _metric_steps(tmp_path) == [1, 2, 3]
        assert _event_steps(tmp_path, "eval/acc") == [3]
    finally:
        m.close()


def test_resume_purges_later_events_as_summary_writer_did(tmp_path):
    first = _monitor(tmp_path)
    for step in range(1, 11):
        first.record(step, {"loss": float(step)})
    first.close()
    time.sleep(1.1)   # event files are named by the second; TensorBoard reads them in name order
    second = _monitor(tmp_path, start_step=6)
    for step in range(7, 13):
        second.record(step, {"loss": float(step)})
    second.close()
    shown, written = tb_scalar_steps(tmp_path)
    assert shown == written == list(range(1, 13))
    assert _metric_steps(tmp_path) == list(range(1, 13))


def test_other_ranks_open_nothing(tmp_path):
    m = Monitor(tmp_path, 10, 0, enabled=False, tensorboard=True, progress="off")
    m.record(1, {"loss": 1.0})
    m.flush()
    m.close()
    assert list(tmp_path.iterdir()) == []


def test_a_checkpointed_step_and_every_record_before_it_are_on_disk_at_once(tmp_path):
    """A restart resumes after the step it loads and never logs the steps before it again: their
    records must not wait for the clock (FLUSH_S) in a buffer a crash would lose. Before a save
    of step 4 the records up to it go to disk; step 4's own, logged after its step_end (as the
    built-in trainer does), at once; later steps wait for the clock again."""
    from hpc_train.config import Config
    from hpc_train.node.report import Reporter
    cfg = Config()
    cfg.log.tensorboard = False
    r = Reporter(cfg.log, tmp_path, is_main=True)
    try:
        for step in (1, 2, 3):
            r.record(step, {"loss": 1.0}, 100, 0, epoch=None, console=False)
        assert _metric_steps(tmp_path) == [1]          # the first step is flushed at once, then the clock
        r.checkpointed(4)
        assert _metric_steps(tmp_path) == [1, 2, 3]
        r.record(4, {"loss": 1.0}, 100, 0, epoch=None, console=False)
        assert _metric_steps(tmp_path) == [1, 2, 3, 4]
        r.record(5, {"loss": 1.0}, 100, 0, epoch=None, console=False)
        assert _metric_steps(tmp_path) == [1, 2, 3, 4]
    finally:
        r.close()
