"""TensorBoard's event file, written through one file kept open (issue 32).

``torch.utils.tensorboard.SummaryWriter`` writes through tensorboard's ``EventFileWriter``,
whose file object, without TensorFlow installed, is tensorboard's stub ``GFile``: each record
(one per scalar) is written by opening the file in append mode, writing and closing it again
(``LocalFileSystem.append``), whatever ``flush_secs`` and ``max_queue`` say (they govern the
queue in front of it). Measured on a 2-rank digits run: 44 ``openat`` a second on the event file,
each a metadata request to a shared file system's server. No setting of either library keeps the
file open, so this module writes the same file itself: the same records (tensorboard's own
``RecordWriter`` and protos), one ``open``, and a buffer flushed by its owner on a clock.

What it writes is what ``SummaryWriter(log_dir, purge_step=...)`` writes: the version event, at
a resume the purge step's version and ``SessionLog.START`` events (TensorBoard drops the events
at or after that step from earlier files: no doubled segments), then one event per scalar.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from hpc_train.rundir import open_nofollow

# TensorBoard's own name: it finds event files by this prefix; time, host and pid keep two
# writers' files apart, the trailing counter is EventFileWriter's (always 0 here: one per process).
_PREFIX = "events.out.tfevents"
_BUFFER = 1 << 20   # larger than a flush interval's records: a write syscall per flush, not per 8 KiB


class EventFile:
    """One event file in ``log_dir``, open until :meth:`close`. Not thread-safe: the caller
    serialises :meth:`scalar` and :meth:`flush` (the monitor does, under its lock)."""

    def __init__(self, log_dir: Path, purge_step: int | None = None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog, SourceMetadata
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter
        self._Event, self._Summary = Event, Summary
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / f"{_PREFIX}.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.0"
        fd = open_nofollow(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        self.file = os.fdopen(fd, "ab", buffering=_BUFFER)
        self._records = RecordWriter(self.file)
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2",
                          source_metadata=SourceMetadata(writer="hpc_train.node.tb_events")))
        if purge_step is not None:
            self._write(Event(step=purge_step, file_version="brain.Event:2"))
            self._write(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))
        self.flush()   # a reader (tensorboard --logdir) sees a valid file from the start

    def _write(self, event) -> None:
        self._records.write(event.SerializeToString())

    def scalar(self, tag: str, value: float, step: int, wall_time: float | None = None) -> None:
        summary = self._Summary(value=[self._Summary.Value(tag=tag, simple_value=float(value))])
        self._write(self._Event(summary=summary, step=step, wall_time=time.time() if wall_time is None else wall_time))

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        if not self.file.closed:
            self.file.close()
