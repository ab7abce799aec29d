"""Issue 3, bad input: each case gives a clear one-line message, and nothing in the run directory
is deleted or overwritten (a snapshot of every file's name, size and mtime before and after).

Real runs and real damage: checkpoints are written by `python -m hpc_train run --nproc 2`, then
a shard is truncated, `.metadata` deleted or `commit.json` overwritten with garbage on disk.
"""

from __future__ import annotations

import json
import shutil

import pytest

from helpers import (assert_same_weights, export, hpc, run, show, snapshot, steps, tb_scalar_steps,
                          train_losses, write_config)
from hpc_train.errors import EXIT_STOPPED

# Every test here starts real training processes: not in `make test-fast`.
pytestmark = pytest.mark.procs


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got:\n{text}"
    return lines[0]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A 2-rank run stopped by SIGTERM at step 3, whose only checkpoint is step-3."""
    d = tmp_path_factory.mktemp("base")
    cfg = write_config(d / "job.yaml", {"checkpoint": {"every_steps": 0}, "train": {"max_steps": 8}})
    p = run(cfg, d / "run", stop_at=3)
    assert p.returncode == EXIT_STOPPED, show(p)
    assert steps(d / "run") == [3]
    return cfg, d / "run"


@pytest.fixture
def copy(base, tmp_path):
    cfg, rd = base
    dst = tmp_path / "run"
    shutil.copytree(rd, dst)
    return cfg, dst


def _truncate(path, keep_fraction=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep_fraction)])


DAMAGE = {
    "truncated-shard": (lambda ck: _truncate(ck / "__0_0.distcp"), "__0_0.distcp has"),
    "deleted-metadata": (lambda ck: (ck / ".metadata").unlink(), ".metadata is missing"),
    "garbage-commit-record": (lambda ck: (ck / "commit.json").write_bytes(b"\x00garbage{not json"),
                              "commit record is unreadable"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_only_checkpoint_refuses_to_start_over_it(copy, damage):
    cfg, rd = copy
    breaker, problem = DAMAGE[damage]
    breaker(rd / "checkpoints" / "step-3")
    before = snapshot(rd)

    p = run(cfg, rd)
    assert p.returncode == 2, show(p)
    msg = one_line(p.stderr)
    assert "step 3: " in msg and problem in msg and "none is complete" in msg, msg
    assert "--resume none" in msg, msg          # says what to do
    assert snapshot(rd) == before               # nothing deleted, nothing overwritten, nothing written

    v = hpc("ckpt", "verify", rd)
    assert v.returncode == 1, show(v)
    assert f"step 3: BAD: {problem}" in v.stdout, show(v)
    e = hpc("ckpt", "export", rd, rd.parent / "out.pt")
    assert e.returncode == 2 and "no complete checkpoint" in one_line(e.stderr), show(e)
    assert snapshot(rd) == before


def test_checkpoint_from_other_model_shape_is_refused(copy, tmp_path):
    cfg, rd = copy
    before = snapshot(rd)
    p = run(cfg, rd, sets=("model.hidden=64",))
    assert p.returncode == 2, show(p)
    msg = one_line(p.stderr)
    # Caught before any worker starts, by comparing with the config the checkpoints were made with.
    assert "model.hidden: 32 -> 64" in msg and "checkpoints cannot load" in msg, msg
    assert snapshot(rd) == before

    # The same checkpoint named explicitly for a new run directory.
    other = tmp_path / "other"
    p = run(cfg, other, resume=str(rd / "checkpoints" / "step-3"), sets=("model.hidden=64",))
    assert p.returncode == 2, show(p)
    msg = one_line(p.stderr)
    assert "'hidden': 32" in msg and "'hidden': 64" in msg, msg   # resume's own check: no config to compare
    assert snapshot(rd) == before
    assert not other.exists()


def test_resume_from_missing_path_is_a_usage_error(copy):
    cfg, rd = copy
    before = snapshot(rd)
    p = run(cfg, rd, resume="/does/not/exist")
    assert p.returncode == 2, show(p)
    msg = one_line(p.stderr)
    assert "/does/not/exist" in msg and "no such checkpoint" in msg, msg
    assert snapshot(rd) == before


def test_resume_none_moves_old_checkpoints_aside(copy):
    cfg, rd = copy
    old = snapshot(rd / "checkpoints")
    p = run(cfg, rd, resume="none", sets=("train.max_steps=10", "checkpoint.every_steps=2", "checkpoint.keep=3"))
    assert p.returncode == 0, show(p)
    assert "starting fresh" in p.stderr, show(p)
    aside = list(rd.glob("checkpoints.old-*"))
    assert len(aside) == 1
    assert snapshot(aside[0]) == old            # moved, byte for byte and with its mtimes, not rewritten
    # A fresh run from step 0, with checkpoint.keep=3: the newest three complete saves remain.
    assert steps(rd) == [10, 8, 6]
    assert sorted(train_losses(rd)) == list(range(1, 11))


def test_truncated_newest_is_skipped_and_previous_loaded(tmp_path):
    """Newest checkpoint damaged, an older one intact: skip the newest with a warning naming it, load
    the older one, replay the steps after it exactly. The damaged files are never deleted or
    overwritten (the save at the same step moves them aside). TensorBoard and metrics.jsonl show
    each step once although steps 11 and 12 were logged twice."""
    cfg = write_config(tmp_path / "job.yaml", {"train": {"max_steps": 12}, "log": {"tensorboard": True}})
    rd = tmp_path / "run"
    first = run(cfg, rd, stop_at=12)
    assert first.returncode == EXIT_STOPPED, show(first)
    assert steps(rd) == [12, 10]
    first_losses = train_losses(rd)
    at12 = export(rd, tmp_path / "first-12.pt", step=12)

    shard = rd / "checkpoints" / "step-12" / "__1_0.distcp"
    _truncate(shard)
    damaged = snapshot(rd / "checkpoints" / "step-12")
    step10 = snapshot(rd / "checkpoints" / "step-10")

    second = run(cfg, rd)
    assert second.returncode == 0, show(second)
    warnings = [ln for ln in second.stderr.splitlines() if "skipping incomplete checkpoint" in ln]
    assert warnings and all("step-12" in ln and "__1_0.distcp" in ln for ln in warnings), show(second)
    assert "resuming from step 10 " in second.stderr, show(second)

    # Nothing deleted or overwritten: step-10 as it was; the damaged step-12 moved aside intact.
    assert snapshot(rd / "checkpoints" / "step-10") == step10
    aside = list((rd / "checkpoints").glob("step-12.skipped-*"))
    assert len(aside) == 1 and snapshot(aside[0]) == damaged

    # Steps 11-12 replayed from step-10 exactly: same losses, same weights as the first run's step 12.
    losses = train_losses(rd)                   # also: each step once
    assert losses == first_losses
    assert_same_weights(export(rd, tmp_path / "second-12.pt"), at12)

    shown, written = tb_scalar_steps(rd)
    assert shown == list(range(1, 13))
    assert written == list(range(1, 13)), "doubled TensorBoard segment after resume"
    raw = [json.loads(ln)["step"] for ln in (rd / "metrics.jsonl").read_text().splitlines()]
    assert raw == list(range(1, 13))
