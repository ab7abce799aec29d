"""What a damaged disk, a restored backup, a rename by hand or another user's file can leave where a
record should be: the byte strategies (hypothesis), the special files and a time limit, shared by
the readers' fuzz (test_fuzz_readers) and the commands' fuzz (test_fuzz_commands)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hypothesis import strategies as st

# JSON values of any shape: huge integers, non-finite floats, any text, nested lists and objects.
SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(min_value=10**300, max_value=10**500)
           | st.floats() | st.text(max_size=30))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner,
                                                                                           max_size=6), max_leaves=30)
KEYS = ["steps", "stop_signal", "stop_received_at", "checkpoint", "events", "in_place", "requeued_at", "counts",
        "target", "step", "signal", "received_at", "rank", "pid", "world_size", "started", "job", "job_id",
        "submitted", "time", "key", "cause", "final", "segments", "config_hash", "world", "files", "ended",
        "request", "restart", "attempt", "swap", "swap_rank", "framework", "directory", "model_only",
        "global_step"]
# Objects whose keys are the records' own, with values of any kind: they reach each field's check.
RECORDS = st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=12)


def _json(v: object) -> bytes:
    return json.dumps(v).encode()


CONTENT = st.one_of(
    st.binary(max_size=300),
    RECORDS.map(_json),
    RECORDS.map(lambda r: _json({"stop_signal": "USR2", "request": r})),    # the stop record's request
    VALUES.map(_json),
    RECORDS.map(_json).flatmap(lambda b: st.integers(0, max(0, len(b) - 1)).map(lambda n: b[:n])),   # truncated
    st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.integers(1, 5).map(lambda k: (b"[" * 10**k + b"]" * 10**k)),          # nesting deeper than the parser's stack
    st.integers(200, 600).map(lambda n: (b'{"steps": ' + b"9" * n + b"}")),
)

# Not a regular file where one should be. "device" is a link to /dev/zero: endless bytes.
SPECIAL = ("directory", "fifo", "symlink-to-dir", "dangling-symlink", "device")


def make_special(f: Path, kind: str, elsewhere: Path) -> None:
    """``kind`` in the place of ``f`` (whose parent exists); ``elsewhere`` is a directory outside."""
    if kind == "directory":
        f.mkdir()
        (f / "x").write_text("x")
    elif kind == "fifo":
        os.mkfifo(f)
    elif kind == "symlink-to-dir":
        f.symlink_to(elsewhere)
    elif kind == "dangling-symlink":
        f.symlink_to(elsewhere / "nowhere")
    elif kind == "device":
        f.symlink_to("/dev/zero")
    else:
        raise ValueError(kind)


class Blocked(Exception):
    pass


@contextmanager
def within(seconds: int) -> Iterator[None]:
    """The block, given ``seconds`` (SIGALRM, main thread): a reader that blocks (a FIFO opened
    without O_NONBLOCK) or loops fails the test instead of hanging it."""
    def alarm(*_: object) -> None:
        raise Blocked(f"did not return within {seconds} s")
    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
