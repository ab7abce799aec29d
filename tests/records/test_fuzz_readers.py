"""Issue 50.2: every reader of a run directory takes whatever it finds there. Hypothesis writes
damaged records of every kind in a record's place (random bytes, truncated JSON, JSON of any shape
with huge, non-finite and wrong-typed values, non-UTF-8 text, deep nesting) and the special files
(a directory, a FIFO, a symbolic link, a link to a device) and calls each reader: it returns (a value, or a problem
in one line), never raises and never blocks. Slurm's command output goes through its parsers the
same way. A reader broken on purpose (a bare ``json.loads`` on a record) fails here."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from damage import CONTENT, RECORDS, SPECIAL, VALUES, make_special, within
from hypothesis import strategies as st

import hpc_train.login.jobs
from hpc_train import config, config_local, goodput, logs, rundir
from hpc_train.ckpt import compat, store, tiers
from hpc_train.login import nodes
from hpc_train.records import jobs, keeper, ranks, requeue, result, stop

def _commit(rd: Path) -> Path:
    return store.ckpt_root(rd) / "step-5" / "commit.json"


def _metrics(rd: Path) -> Path:
    return rd / rundir.METRICS


def _local_node(rd: Path) -> Path:
    return config_local.node_dir(rd / "shm" / "hpc_train-1", rd, {}, "node0")


def _local_commit(rd: Path) -> Path:
    return _local_node(rd) / "rank-0" / "step-3" / "commit.json"


def _trainer_state(rd: Path) -> Path:
    return rd / "out" / "checkpoint-5" / "trainer_state.json"


def _read_trainer_checkpoints(rd: Path) -> object:
    kept = keeper.Keeper(keeper.TRAINER, rd / "out", 2)
    return keeper.trainer_checkpoints(kept), keeper.newest_complete(kept)


def _read_metrics(rd: Path) -> object:
    return (list(logs.records(_metrics(rd))), list(logs.records(_metrics(rd), tail_bytes=100)),
            logs.metrics_tail(rd), goodput.dropped_steps(_metrics(rd), 1))


# (the file a reader reads, the reader): each call must return, whatever the file holds.
READERS: dict[str, tuple[Callable[[Path], Path], Callable[[Path], object]]] = {
    "requeue.json": (requeue.path, requeue.read),
    "requeue.pending": (requeue.pending_path, requeue.read_pending),
    "stopped.json": (stop.path, lambda rd: (stop.read(rd), stop.written_since(rd, 0.0), requeue.read_pending(rd))),
    "result.json": (result.path, lambda rd: (result.read(rd), result.finished(rd))),
    "job.json": (jobs.path, lambda rd: (jobs.read(rd), jobs.first_submit(rd))),
    "rank record": (lambda rd: ranks.path(rd, 0),
                    lambda rd: (ranks.read(rd, 0), ranks.last_step(rd), ranks.present(rd))),
    "goodput.json": (lambda rd: rd / goodput.FILE, lambda rd: (goodput.read(rd), goodput.breakdown(rd, 1e9),
                                                               goodput.summary_line(rd))),
    "commit.json": (_commit, lambda rd: (store.scan(rd), store.newest_complete(rd, warn=lambda m: None))),
    "metrics.jsonl": (_metrics, _read_metrics),
    "keeper.json": (keeper.path, lambda rd: (keeper.read(rd), hpc_train.login.outcome.kept_point(rd))),
    "a Trainer checkpoint's trainer_state.json": (_trainer_state, _read_trainer_checkpoints),
    "local item's commit.json": (_local_commit, lambda rd: tiers.local_items(rd, str(rd / "shm"), env={})),
    "rank error": (lambda rd: rundir.rank_error(rd, 1), lambda rd: (ranks.error_times(rd), ranks.error_line(rd, 1, 0))),
    # Read for one value by status, logs and a resume's comparison (config.load, which names each
    # bad field, is the config test's).
    "config.yaml": (lambda rd: rd / rundir.CONFIG,
                    lambda rd: (config.read_saved(rd), hpc_train.login.jobs.resume_point(rd, None),
                                hpc_train.login.jobs._rank_count(rd, submitted=True), compat._old_config(rd))),
}

# Names another hand could give a step or rank directory (or a record's file): any characters a
# file name may hold, non-ASCII digits, leading zeros, numbers too big for anything.
NAMES = st.one_of(
    st.text(st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)), min_size=1, max_size=40),
    st.integers(0, 10**40).map(str), st.sampled_from(["007", "-1", "٣", "３", "1e3", " 4", "4 ", "0x10", "+5"]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=NAMES)
def test_listings_take_any_step_or_rank_name(tmp_path, name):
    if name in (".", ".."):
        return
    rd = tmp_path / "run"
    made = [store.ckpt_root(rd) / f"step-{name}", _local_node(rd) / f"rank-{name}" / "step-2",
            _local_node(rd) / "rank-0" / f"step-{name}", rundir.rank_error(rd, 0).parent]
    for d in made:
        d.mkdir(parents=True, exist_ok=True)
    (rundir.rank_error(rd, 0).parent / f"rank-{name}.error").write_text("RuntimeError: x\n")
    ranks.path(rd, 0).parent.mkdir(parents=True, exist_ok=True)
    (ranks.path(rd, 0).parent / f"rank-{name}").write_text("{}")
    try:
        _call(lambda r: (store.scan(r), tiers.local_items(r, str(r / "shm"), env={}), ranks.error_times(r),
                         ranks.present(r), ranks.last_step(r)), rd)
    finally:
        import shutil
        shutil.rmtree(rd)


def _call(reader: Callable[[Path], object], rd: Path) -> None:
    """The reader, given 10 s: a FIFO read without O_NONBLOCK would block for good."""
    with within(10):
        reader(rd)


@pytest.mark.parametrize("name", READERS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=CONTENT)
def test_a_reader_takes_any_bytes_in_its_record_s_place(tmp_path, name, content):
    where, reader = READERS[name]
    rd = tmp_path / "run"
    f = where(rd)
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_bytes(content)
    try:
        _call(reader, rd)
    finally:
        f.unlink()


@pytest.mark.parametrize("kind", SPECIAL)
@pytest.mark.parametrize("name", READERS)
def test_a_reader_takes_a_special_file_in_its_record_s_place(tmp_path, name, kind):
    where, reader = READERS[name]
    rd = tmp_path / "run"
    f = where(rd)
    f.parent.mkdir(parents=True, exist_ok=True)
    make_special(f, kind, tmp_path)
    _call(reader, rd)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400), st.none() | st.integers(0, 5))
@example("|¹", None)   # isdigit() is true for '¹', which int() refuses
def test_sacct_s_output_of_any_text_parses(text, restart):
    runs = nodes.parse_runs(text, restart)
    assert [r.restart for r in runs] == list(range(len(runs)))


@pytest.mark.parametrize("name, number", [
    ("step-5", 5), ("step-0", 0), ("step-12", 12), ("step-05", None), ("step-²", None), ("step-٣", None),
    ("step-５", None), ("step-5\n", None), ("step-", None), ("step-" + "9" * 19, None), ("step--1", None),
    ("step-1e3", None), ("step- 4", None), ("Step-4", None), ("step-4.skipped-1", None),
])
def test_a_step_name_is_parsed_one_way_as_its_writer_spells_it(name, number):
    from hpc_train.ckpt import store
    assert rundir.name_number(name, "step-") == number == store.step_of(name)


@pytest.mark.parametrize("raw, digits, number", [
    ("7", 18, 7), ("0", 18, 0), ("00012", 18, 12), ("9" * 18, 18, 10**18 - 1), ("9" * 19, 18, None),
    ("1234567890", 9, None), ("", 18, None), ("¹", 18, None), ("1²", 18, None), ("٣", 18, None),
    ("５", 18, None), (" 4", 18, None), ("4\n", 18, None), ("-1", 18, None), ("+1", 18, None), ("1_000", 18, None),
    ("1e3", 18, None), ("max", 18, None),
])
def test_a_number_from_the_environment_slurm_or_the_kernel_is_ascii_digits_or_none(raw, digits, number):
    """sacct's '|¹' passed str.isdigit() and crashed int() in nodes.parse_runs (found by the fuzz
    above); every such reader now parses through rundir.decimal."""
    assert rundir.decimal(raw, digits) == number


@given(st.text(max_size=30), st.integers(1, 20))
def test_decimal_is_int_of_ascii_digits_or_none(raw, digits):
    n = rundir.decimal(raw, digits)
    ascii_digits = 0 < len(raw) <= digits and all(c in "0123456789" for c in raw)
    assert (n is not None) == ascii_digits and (n is None or n == int(raw))


def test_a_rank_name_with_a_non_ascii_digit_is_no_rank(tmp_path):
    """'rank-²' passed str.isdigit() and crashed int() in ranks.present (found by the fuzz above)."""
    d = ranks.path(tmp_path, 0).parent
    d.mkdir(parents=True)
    for name in ("rank-²", "rank-٣", "rank-007", "rank-3"):
        (d / name).write_text("{}")
    assert ranks.present(tmp_path) == [3]


# squeue's, sinfo's and sacct's output as the hook and status parse it: any text the commands could
# print (a changed format, a wrapper's noise, another locale) gives an answer or "unknown", never an
# exception. The commands are replaced by their reply (hpc_train.slurm is the one client).
SLURM_TEXT = st.one_of(st.text(max_size=200),
                       st.text(max_size=12).map(lambda lim: f"2026-01-01T00:00:00|{lim}|node1"),   # squeue %S|%l|%N
                       st.lists(st.lists(st.text(st.characters(blacklist_characters="|\n"), max_size=20),
                                         max_size=6).map("|".join), max_size=5).map("\n".join))


@settings(max_examples=200, deadline=None)
@given(SLURM_TEXT)
def test_squeue_sinfo_and_sacct_output_of_any_text_parses(text):
    from unittest import mock

    from hpc_train import slurm
    from hpc_train.login import scheduler
    reply = slurm.Reply(text)
    with mock.patch.object(slurm, "squeue", return_value=reply), mock.patch.object(slurm, "sinfo", return_value=reply), \
            mock.patch.object(slurm, "sacct", return_value=reply):
        view = nodes.job_view("7")
        assert view.nodes is None or all(view.nodes)
        states, why = nodes.node_states(["node1", "node2"])
        assert (states is None) == bool(why)
        answer = scheduler.query(["7", "8"])
        assert all(isinstance(st_.state, str) for st_ in answer.states.values())
        scheduler.query_tasks(["7_0", "7_1"])


@settings(max_examples=200, deadline=None)
@given(st.one_of(SLURM_TEXT, st.lists(st.sampled_from(["debug*|2|4|(null)|up", "gpu|1|8+|gpu:a100:4|up", "x|٣|4|g|up",
                                                        "y|" + "9" * 20 + "|1|g|up", "z|1|2", "|||||"]),
                                      max_size=6).map("\n".join)))
def test_sinfo_and_scontrol_output_of_any_text_is_an_answer_or_one_line(text):
    """What submit asks before it submits: the partitions (sinfo) and MaxArraySize (scontrol)."""
    from unittest import mock

    from hpc_train import slurm
    from hpc_train.config import load
    from hpc_train.errors import UsageError
    from hpc_train.login import scheduler
    job = load(None, []).job
    with mock.patch.object(slurm, "sinfo", return_value=slurm.Reply(text)), \
            mock.patch.object(slurm, "scontrol", return_value=slurm.Reply(text)):
        try:
            scheduler.check_resources(job)
        except UsageError as e:
            assert "\n" not in str(e)
        limit = scheduler.max_array_size()
        assert limit is None or 0 <= limit < 10**9


MANIFESTS = st.fixed_dictionaries({"node": VALUES, "record": RECORDS | VALUES,
                                   "files": VALUES | st.lists(st.lists(VALUES, max_size=3), max_size=3)}).map(
    lambda m: json.dumps(m).encode())


@settings(max_examples=300, deadline=None)
@given(CONTENT | MANIFESTS)
def test_a_peer_s_manifest_of_any_bytes_is_an_item_or_one_error(raw):
    """The node-local tier's copies arrive with a manifest the peer wrote (ckpt/local/wire.py):
    parsed like a record, any bytes give the manifest or an OSError saying it is malformed."""
    from hpc_train.ckpt.local import wire
    try:
        m = wire.manifest(raw)
        wire.Incoming(m, 0, None)
    except OSError as e:
        assert "\n" not in str(e)
