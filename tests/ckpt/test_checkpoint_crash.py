"""Issue 3, crash test: kill -9 every rank at random moments while checkpoints are being written,
10 times; after each kill, resume picks the newest complete checkpoint, never a partial one.

Real: a 2-rank `python -m hpc_train run`, saving (asynchronously, DCP) after every step a ~20 MB
state (an MLP with 2048 hidden units and Adam), so that the ranks spend most of their time inside a
save. The kill is a real SIGKILL to each worker's process group, found as the children of the `run`
launcher in /proc (workers run in their own sessions). Each round after the first starts with a
real resume from the previous round's choice; the test checks the launcher's and the workers'
choice, then after every kill that every checkpoint the resume rules call complete passes
`ckpt verify`'s checks and loads in full (model, optimizer, schedule, progress, rank files).
"""

from __future__ import annotations

import pytest

import collections
import os
import random
import subprocess
import sys
import time

from helpers import REPO, clean_env, kill9_workers, load_full, run, show, write_config

from hpc_train.ckpt import store
from hpc_train.cli.ckpt import verify_one

# Every test here starts real training processes: not in `make test-fast`.
pytestmark = pytest.mark.procs

KILLS = 6
CRASH_CFG = {"model": {"name": "mlp", "hidden": 2048, "dropout": 0.1},
             "train": {"max_steps": 100000, "log_every": 50},
             "checkpoint": {"every_steps": 1, "keep": 2}}


def _newest_step(rd) -> int:
    info = store.newest_complete(rd)
    return info.step if info else 0


def _classify(rd, newest: int) -> str:
    """Where in a save the kill landed, judged by the newest step directory's files."""
    partial = [i for i in store.scan(rd) if not i.complete and i.step > newest]
    if not partial:
        return "between saves"
    names = {p.name for p in partial[0].path.iterdir()}
    if "commit.json.tmp" in names:
        return "writing commit record"
    if ".metadata" in names:
        return ".metadata written, no commit record yet"
    if any(n.endswith(".distcp") for n in names):
        return "writing shards"
    return "before shards"


def test_kill9_during_checkpoint_writes_never_resumes_from_partial(tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    print(f"crash test seed {seed}")
    cfg = write_config(tmp_path / "job.yaml", CRASH_CFG)
    rd = tmp_path / "run"
    where = collections.Counter()
    for round_ in range(KILLS):
        before = _newest_step(rd)
        log = tmp_path / f"launch-{round_}.log"
        with open(log, "w") as out:
            launcher = subprocess.Popen(
                [sys.executable, "-m", "hpc_train", "run", str(cfg), "--nproc", "2", "--run-dir", str(rd)],
                cwd=REPO, env=clean_env(), stdout=out, stderr=subprocess.STDOUT)
        try:
            # Wait until this launch has committed a save of its own: training is under way and
            # saving every step. (A hang here is ended by pytest-timeout; `finally` kills the workers.)
            while _newest_step(rd) <= before:
                assert launcher.poll() is None, f"run exited early:\n{log.read_text()[-5000:]}"
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.4))
            killed = kill9_workers(launcher.pid)
        finally:
            kill9_workers(launcher.pid)
            launcher.wait(timeout=60)
        assert len(killed) == 2
        text = log.read_text()
        if before:
            # This round resumed from the checkpoint the previous round's check picked.
            assert f"resuming from step {before} " in text, text[-5000:]
            assert f"resumed from step {before} (" in text and f"step-{before}), saved at world size" in text, \
                text[-5000:]

        newest = store.newest_complete(rd)
        assert newest is not None and newest.step > before
        where[_classify(rd, newest.step)] += 1
        scanned = store.scan(rd)
        assert newest.step in [i.step for i in scanned if i.complete], [i.step for i in scanned]
        for info in scanned:
            if info.complete:                   # what resume may pick: must be whole and loadable
                assert verify_one(info) is None, (info.path, verify_one(info))
                state = load_full(info.path)
                assert state["app.step"] == info.step
                assert info.record["world_size"] == 2

    print(f"where the {KILLS} kills landed: {dict(where)}")
    assert sum(n for k, n in where.items() if k != "between saves") >= 1, where

    # Finish: the same command (a few more steps) resumes from the newest complete one and completes.
    last = _newest_step(rd)
    p = run(cfg, rd, sets=(f"train.max_steps={last + 3}",))
    assert p.returncode == 0, show(p)
    assert f"resuming from step {last} " in p.stderr, show(p)
    assert store.newest_complete(rd).step == last + 3
