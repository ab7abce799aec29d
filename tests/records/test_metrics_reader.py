"""``metrics.jsonl`` has one rule for a line (:func:`hpc_train.logs.metric`: an object with an
integer ``step``) and one forward reader (:func:`hpc_train.logs.records`), which the goodput
ledger's redone steps and the sweep reports read through: damaged, cut or overlong lines are
skipped the same way everywhere, and no file is read whole."""

from __future__ import annotations

import json
import os

import pytest

from hpc_train import goodput, logs
from hpc_train.login import sweep_report

GOOD = [{"step": 1, "time": 10.0, "loss": 2.0}, {"step": 2, "time": 11.0, "loss": 1.5},
        {"step": 3, "time": 12.5, "loss": 1.2}]
DAMAGE = ['[]', '3', '{"step": "x", "time": 1}', '{"step": true, "time": 1}', 'not json', '\x00\xff garbage',
          '{"step": 2.0, "time": 1}']


def _write(path, lines, tail=""):
    path.write_bytes(("\n".join(lines) + "\n" + tail).encode("utf-8", "surrogateescape"))
    return path


def test_damaged_lines_are_skipped_and_records_come_in_order(tmp_path):
    lines = [json.dumps(GOOD[0]), *DAMAGE, json.dumps(GOOD[1]), json.dumps(GOOD[2])]
    path = _write(tmp_path / "metrics.jsonl", lines, tail='{"step": 4, "ti')   # cut by a kill
    assert list(logs.records(path)) == GOOD


def test_an_overlong_line_is_skipped_without_being_held_whole(tmp_path):
    huge = '{"step": 9, "pad": "' + "x" * (3 * logs._LINE_MAX) + '"}'
    path = _write(tmp_path / "metrics.jsonl", [json.dumps(GOOD[0]), huge, json.dumps(GOOD[1])])
    assert list(logs.records(path)) == GOOD[:2]


def test_the_tail_starts_at_a_whole_line(tmp_path):
    path = _write(tmp_path / "metrics.jsonl", [json.dumps(r) for r in GOOD])
    last = len(json.dumps(GOOD[2])) + 1
    assert list(logs.records(path, tail_bytes=last + 5)) == GOOD[2:]
    assert list(logs.records(path, tail_bytes=10**6)) == GOOD


@pytest.mark.parametrize("kind", ["missing", "directory", "fifo"])
def test_what_is_not_a_file_gives_no_records_and_no_hang(tmp_path, kind):
    path = tmp_path / "metrics.jsonl"
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    assert list(logs.records(path)) == []


def test_the_ledger_and_the_sweep_report_read_through_the_one_reader(tmp_path):
    lines = [json.dumps(GOOD[0]), *DAMAGE, json.dumps(GOOD[1]), json.dumps(GOOD[2]),
             json.dumps({"step": 4, "time": 10 ** 400}), json.dumps({"step": 5, "time": "nan"})]
    _write(tmp_path / "metrics.jsonl", lines)
    # Steps 2 and 3 come after the kept step 1; the huge and the NaN times are not times.
    assert goodput.dropped_steps(tmp_path / "metrics.jsonl", 1) == (2, 2.5, 12.5)
    assert sweep_report._latest(tmp_path, "loss", tail=False) == (5, 1.2)
