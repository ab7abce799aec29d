"""A long run's logs and ``metrics.jsonl`` grow without bound, and a big one is healthy: it is read
line by line or in pieces, never whole, and never set aside as damage (the size cap of
``rundir.read_text`` is for small JSON records only).

Each file here is a little over that cap (64 MiB) and written in well under a second; memory is
measured as the peak resident size of the real command (a probe runs ``python -m hpc_train`` and
reports it at exit) or, in process, with tracemalloc.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from helpers import REPO, clean_env, show

from hpc_train.logs import truncate_jsonl

BIG = 72 << 20          # past the 64 MiB record cap
PAD = "x" * 16000       # few, long lines: the file is big but parsing it stays quick
# A streaming command stays near the interpreter's own size (about 22 MiB); one that reads the
# file whole holds it at least twice (its bytes, then its text).
MAX_RSS_KIB = 56 << 10

# VmHWM is this process's own peak (getrusage's ru_maxrss would carry the pytest parent's over exec).
PROBE = """import atexit, re, runpy, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(re.search(r"VmHWM:\\s*(\\d+)", open("/proc/self/status").read())[1]))
sys.argv[0] = "python -m hpc_train"
runpy.run_module("hpc_train", run_name="__main__", alter_sys=True)
"""


def _cli(tmp_path: Path, *args: str, stdout=subprocess.PIPE) -> tuple[subprocess.CompletedProcess, int]:
    """``python -m hpc_train ARGS`` and its peak resident size in KiB."""
    rss = tmp_path / "rss"
    p = subprocess.run([sys.executable, "-c", PROBE, str(rss), *map(str, args)], cwd=REPO, env=clean_env(),
                       stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=120)
    return p, int(rss.read_text())


def _metrics_line(step: int, evals: bool = False) -> str:
    """What Monitor.record writes (json.dumps of a flat record), with a long extra field."""
    return (f'{{"step": {step}, "time": 0.0, "loss": {1.0 / step!r}, "note": "{PAD}"'
            + (', "eval_acc": 0.5' if evals else "") + "}\n")


def _big_metrics(path: Path) -> int:
    """Steps 1..N up to BIG bytes, an eval at every 1000th; returns N."""
    n = BIG // len(_metrics_line(1)) + 1
    path.write_text("".join(_metrics_line(step, step % 1000 == 0) for step in range(1, n + 1)))
    return n


def test_a_long_metrics_file_is_truncated_on_resume_never_set_aside(tmp_path):
    path = tmp_path / "metrics.jsonl"
    last = _big_metrics(path)
    with path.open("a") as f:     # a damaged line, then a last line cut short by a kill
        f.write("{not a record\n" + _metrics_line(last + 1)[:50])
    keep = last - 3
    tracemalloc.start()
    try:
        truncate_jsonl(path, keep)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["metrics.jsonl", names[1]] and names[1].startswith("metrics.jsonl.damaged-"), names
    assert (tmp_path / names[1]).read_text() == "{not a record\n"       # only the damaged line goes aside
    with path.open() as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps == list(range(1, keep + 1))
    assert path.stat().st_size > 64 << 20
    assert peak < 8 << 20, f"truncate_jsonl held {peak >> 20} MiB"


@pytest.fixture
def big_run(tmp_path: Path) -> Path:
    """A local run that has ended, with a big rank-0 log."""
    rd = tmp_path / "run"
    (rd / "logs").mkdir(parents=True)
    line = "[rank 0] 12:00:00 INFO step " + PAD + "\n"
    (rd / "logs" / "rank-0.log").write_text(line * (BIG // len(line) + 1) + "the last line\n")
    return rd


@pytest.mark.parametrize("follow", [False, True], ids=["logs", "logs-f"])
def test_logs_prints_a_big_log_streamed(tmp_path, big_run, follow):
    out = tmp_path / "out"
    with out.open("w") as f:
        p, rss = _cli(tmp_path, "logs", big_run, *(["-f"] if follow else []), stdout=f)
    assert p.returncode == 0 and p.stderr == "", f"exit {p.returncode}: {p.stderr}"
    assert out.stat().st_size == (big_run / "logs" / "rank-0.log").stat().st_size
    assert out.read_bytes()[-14:] == b"the last line\n"
    assert rss < MAX_RSS_KIB, f"peak {rss >> 10} MiB: the log was read whole"


def test_status_reads_the_end_of_a_big_metrics_file(tmp_path):
    rd = tmp_path / "run"
    rd.mkdir()
    last = _big_metrics(rd / "metrics.jsonl")
    p, rss = _cli(tmp_path, "status", rd)
    assert p.returncode == 0, show(p)
    assert f"  last step {last}, loss {1.0 / last:.4f}" in p.stdout.splitlines(), show(p)
    assert f"  last eval: accuracy 0.5000 at step {last // 1000 * 1000}" in p.stdout.splitlines(), show(p)
    assert "could not read" not in p.stdout, show(p)
    assert rss < MAX_RSS_KIB, f"peak {rss >> 10} MiB: metrics.jsonl was read whole"


def test_a_line_with_no_end_is_damage_read_in_pieces(tmp_path):
    """A "line" of megabytes (no newline: zeros from a crash, a binary file in its place) is one
    damaged line for the resume and for status, and is never held whole."""
    from hpc_train.logs import metrics_tail
    path = tmp_path / "metrics.jsonl"
    junk = b"\0" * (5 << 20) + b"\n"
    path.write_bytes(_metrics_line(1).encode() + junk + _metrics_line(2).encode())
    tail = metrics_tail(tmp_path)
    assert tail.last_step["step"] == 2
    assert tail.problem == "has 1 line(s) that are not records (an object with an integer step)"
    tracemalloc.start()
    try:
        truncate_jsonl(path, 2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    aside, = tmp_path.glob("metrics.jsonl.damaged-*")
    assert aside.read_bytes() == junk
    assert peak < 4 << 20, f"truncate_jsonl held {peak >> 20} MiB"
