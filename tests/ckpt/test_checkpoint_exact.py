"""Issue 3, exactness: a run stopped by SIGTERM at step k and resumed in fresh processes ends
bitwise equal to a run that was never stopped, and logs the same loss at every step.

Everything is real: `python -m hpc_train run --nproc 2` (2 gloo ranks), the launcher's SIGTERM
forwarding, DCP on disk, `ckpt export` + `torch.load(weights_only=True)`. The stop is made
deterministic by the HPC_TRAIN_TEST_STOP_AT_STEP hook: rank 0 sends a real SIGTERM to the `run`
process at step k ("K:M": between micro-batch M and M+1 of step K) and waits for the forwarded
signal, so the agreed stop lands at step k, not at whatever step a log-watcher happened to see.
"""

from __future__ import annotations

import json

import pytest

from helpers import (assert_same_weights, export, run, show, steps, train_losses, write_config)
from hpc_train.errors import EXIT_STOPPED

# Every test here starts real training processes: not in `make test-fast`.
pytestmark = pytest.mark.procs

# 512 synthetic samples, 16 per rank, 2 ranks: 16 micro-batches per rank per epoch.
CONFIGS = {
    # MLP with dropout, no accumulation, no loader workers: 16 steps per epoch.
    "mlp-accum1-workers0": ({"model": {"name": "tests.plugins_for_tests:stoppable_mlp", "hidden": 32, "dropout": 0.25},
                             "train": {"max_steps": 20}}, 20),
    # ConvNet (BatchNorm buffers) with dropout, 3 micro-batches per step, 2 loader worker processes,
    # eval at each epoch end: 15 usable micro-batches = 5 steps per epoch.
    "convnet-accum3-workers2": ({"model": {"name": "tests.plugins_for_tests:stoppable_convnet", "dropout": 0.3},
                                 "data": {"num_workers": 2}, "optim": {"grad_accum": 3},
                                 "train": {"max_steps": 12, "eval": True},
                                 # copies of async saves overlap the next step (the default only with a GPU)
                                 "checkpoint": {"every_steps": 4, "overlap_staging": "always"}}, 12),
}

CASES = [
    pytest.param("mlp-accum1-workers0", "7", 7, id="mid-epoch-workers0"),
    pytest.param("mlp-accum1-workers0", "16", 16, id="epoch-boundary-workers0"),
    # The signal arrives after micro-batch 1 of step 4's 3: the ranks finish the cycle and stop at 4.
    pytest.param("convnet-accum3-workers2", "4:1", 4, id="inside-accum-cycle-workers2"),
    pytest.param("convnet-accum3-workers2", "10:2", 10, id="inside-accum-cycle-at-epoch-boundary-workers2"),
]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """One uninterrupted run per config, shared by its cases: (config path, run dir, losses, weights)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            over, total = CONFIGS[name]
            d = tmp_path_factory.mktemp(f"straight-{name}")
            cfg = write_config(d / "job.yaml", over)
            p = run(cfg, d / "run")
            assert p.returncode == 0, show(p)
            losses = train_losses(d / "run")
            assert sorted(losses) == list(range(1, total + 1))
            weights = export(d / "run", d / "final.pt")
            cache[name] = (cfg, d / "run", losses, weights)
        return cache[name]
    return get


@pytest.mark.parametrize("config,stop_at,k", CASES)
def test_stop_and_resume_is_bitwise_exact(straight, tmp_path, config, stop_at, k):
    cfg, straight_dir, straight_losses, straight_weights = straight(config)
    total = CONFIGS[config][1]
    rd = tmp_path / "run"

    first = run(cfg, rd, stop_at=stop_at)
    # SIGTERM to `run`: every rank finishes its step, saves, exits; the launcher says how to go on.
    assert first.returncode == EXIT_STOPPED, show(first)
    assert f"checkpoint saved at step {k}; run the same command to resume" in first.stderr, show(first)
    assert json.loads((rd / "stopped.json").read_text())["steps"] == k
    assert steps(rd)[0] == k
    assert sorted(train_losses(rd)) == list(range(1, k + 1))

    second = run(cfg, rd)                       # the same command, fresh processes
    assert second.returncode == 0, show(second)
    assert f"resuming from step {k} " in second.stderr, show(second)
    assert f"resumed from step {k} ({rd / 'checkpoints' / f'step-{k}'})," in second.stderr, show(second)   # the worker
    assert json.loads((rd / "result.json").read_text())["steps"] == total

    # Per-step losses: every step once, and equal to the uninterrupted run's (bitwise: same floats).
    losses = train_losses(rd)
    assert sorted(losses) == list(range(1, total + 1))
    after = {s: (losses[s], straight_losses[s]) for s in range(k + 1, total + 1)}
    assert len(after) == total - k > 0, (k, total)
    assert all(a == b for a, b in after.values()), f"losses after step {k} differ: {after}"
    assert losses == straight_losses

    # Exported weights: every tensor bitwise equal.
    assert_same_weights(export(rd, tmp_path / "resumed.pt"), straight_weights)


def test_an_async_checkpoint_holds_exactly_its_step(straight, tmp_path):
    """The straight ConvNet run's step-8 was an async save whose copy overlapped step 9's forward and
    backward (BatchNorm buffers change there; step 9's optimizer.step waited for the copy). Resumed
    in a new run directory, it must continue exactly as the straight run did: any byte of step 9
    in it would change every later loss and weight."""
    cfg, straight_dir, straight_losses, straight_weights = straight("convnet-accum3-workers2")
    ck = straight_dir / "checkpoints" / "step-8"
    assert json.loads((ck / "commit.json").read_text())["step"] == 8
    rd = tmp_path / "run"
    p = run(cfg, rd, resume=str(ck))
    assert p.returncode == 0, show(p)
    assert f"resumed from step 8 ({ck})," in p.stderr, show(p)
    losses = train_losses(rd)
    assert {s: losses[s] for s in range(9, 13)} == {s: straight_losses[s] for s in range(9, 13)}
    assert_same_weights(export(rd, tmp_path / "resumed.pt"), straight_weights)


def test_retention_keeps_newest_two(straight):
    """checkpoint.keep=2 (with a save every 5 steps over 20 steps): only step-20 and step-15 remain."""
    _, rd, _, _ = straight("mlp-accum1-workers0")
    assert steps(rd) == [20, 15]


def test_resume_at_another_world_size_continues_from_same_samples(tmp_path):
    """2 ranks stopped at step 5 (mid-epoch), resumed with 1 process: DCP reshards. The weights the
    one process gets are the saved ones, bitwise: one step at optim.lr=0 (Adam then moves no weight)
    saves them at step 6. Then the data continues after the same number of samples (not bitwise:
    the batches differ)."""
    cfg = write_config(tmp_path / "job.yaml", {"train": {"max_steps": 30}})
    rd = tmp_path / "run"
    first = run(cfg, rd, stop_at=5)
    assert first.returncode == EXIT_STOPPED, show(first)
    saved = export(rd, tmp_path / "saved.pt", step=5)
    probe = run(cfg, rd, nproc=1, stop_at=1, sets=("optim.lr=0",))   # stops after its first step: 6
    assert probe.returncode == EXIT_STOPPED, show(probe)
    assert "saved at world size 2, now 1: resharded" in probe.stderr, show(probe)
    assert steps(rd)[0] == 6
    assert_same_weights(export(rd, tmp_path / "resharded.pt", step=6), saved)
    second = run(cfg, rd, nproc=1)
    assert second.returncode == 0, show(second)
    result = json.loads((rd / "result.json").read_text())
    # 5 steps x 32 samples at world 2, then 25 steps x 16 samples at world 1.
    assert result["progress"]["samples_seen"] == 5 * 32 + 25 * 16
    epochs = {}
    for line in (rd / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        epochs.setdefault(rec["epoch"], []).append(rec["step"])
    # Epoch 0 (512 samples) ends exactly when the remaining 512 - 160 = 352 samples (22 steps of 16)
    # have been seen: no sample of epoch 0 is repeated or skipped in count.
    assert max(epochs[0]) == 5 + 22
    assert min(epochs[1]) == 28
    assert sorted(train_losses(rd)) == list(range(1, 31))
