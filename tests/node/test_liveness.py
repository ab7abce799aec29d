"""Every watcher's threshold lives in hpc_train/node/liveness.py, and docs/faults.md's table says the
same figures: the table is read here row by row and compared with the module."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from hpc_train import config as config_mod
from hpc_train.node import liveness

ROOT = Path(__file__).resolve().parents[2]
SECONDS = st.floats(min_value=0, max_value=1e7, allow_nan=False)


def _table() -> dict[str, tuple[str, str]]:
    """docs/faults.md's liveness table: threshold -> (value, what follows)."""
    text = (ROOT / "docs/faults.md").read_text()
    section = text.split("## How long a silence may last", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `([^`]+)` \| ([^|]+) \| (.+) \|$", line)
        if m:
            rows[m.group(1)] = (m.group(2).strip(), m.group(3))
    return rows


def _seconds(value: str) -> float:
    m = re.fullmatch(r"([0-9.]+)( s)?", value)
    assert m, f"not a plain figure: {value!r}"
    return float(m.group(1))


def _public() -> tuple[set[str], set[str]]:
    constants = {n for n, v in vars(liveness).items() if n.isupper() and isinstance(v, (int, float))}
    functions = {n for n, v in vars(liveness).items()
                 if inspect.isfunction(v) and v.__module__ == liveness.__name__ and not n.startswith("_")}
    return constants, functions


def test_the_table_names_every_threshold_and_only_those():
    constants, functions = _public()
    rows = _table()
    named = {name.split("(")[0] for name in rows}
    assert named == constants | (functions - {"age", "silent"}), named ^ (constants | functions)


@pytest.mark.parametrize("name", sorted(_public()[0]))
def test_each_constant_s_figure_in_the_table_is_the_module_s(name):
    value, _ = _table()[name]
    assert _seconds(value) == getattr(liveness, name), (name, value)


def test_the_functions_figures_in_the_table():
    rows = _table()
    assert rows["heartbeat_limit(T)"][0] == (f"max({liveness.FROZEN_AFTER_S:g} s, T / 2): "
                                            f"{liveness.heartbeat_limit(config_mod.DistSection().timeout_s):g} s")
    assert rows["look_every(limit)"][0] == f"max({liveness.BEAT_S:g} s, limit / 10): {liveness.look_every(300):g} s"


def test_the_straggler_defaults_the_table_names_are_the_config_s():
    d = config_mod.DistSection()
    said = _table()["STRAGGLER_GATHERINGS"][1]
    assert f"`dist.straggler_ratio` ({d.straggler_ratio:g})" in said
    assert f"`dist.straggler_every_steps` ({d.straggler_every_steps})" in said
    assert f"`dist.straggler_window_s` ({d.straggler_window_s:g} s)" in said


def test_no_watcher_keeps_a_threshold_of_its_own():
    """A limit written as a multiple of a beat, or a watcher's constant assigned outside the module."""
    constants, _ = _public()
    own = re.compile(r"^(%s)\s*=" % "|".join(sorted(constants | {"K", "WARMUP", "WINDOW", "CHECK_S", "FLOOR_S"})),
                     re.M)
    multiple = re.compile(r"\d\s*\*\s*(\w+\.)?BEAT_S\b")
    found = []
    for path in sorted((ROOT / "hpc_train").rglob("*.py")):
        if path.name == "liveness.py":
            continue
        text = path.read_text()
        found += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in (*own.finditer(text), *multiple.finditer(text))]
    assert not found, found


def test_the_thresholds_order():
    """A beat is missed before anyone is named; a lost peer (a collective already failed) is named
    sooner than a frozen one; the long limit is never shorter than a frozen one's."""
    assert liveness.BEAT_S < liveness.LOST_AFTER_S <= liveness.FROZEN_AFTER_S <= liveness.heartbeat_limit(0)


@given(SECONDS)
def test_the_heartbeat_limit_comes_before_the_collectives_time_out(timeout_s):
    limit = liveness.heartbeat_limit(timeout_s)
    assert limit >= liveness.FROZEN_AFTER_S
    if timeout_s >= 2 * liveness.FROZEN_AFTER_S:
        assert limit <= timeout_s / 2
    assert liveness.BEAT_S <= liveness.look_every(limit) <= max(liveness.BEAT_S, limit)


@given(st.one_of(st.none(), SECONDS), SECONDS, SECONDS)
def test_an_age_is_never_older_than_the_watch_and_silence_is_monotone(beat_age, watched_s, limit_s):
    age = liveness.age(beat_age, watched_s)
    assert age <= watched_s
    assert age == (watched_s if beat_age is None else min(beat_age, watched_s))
    if liveness.silent(age, limit_s):
        assert liveness.silent(age + 1, limit_s) and not liveness.silent(age, age)
    assert not liveness.silent(None, limit_s)
