"""Issue 10: parallelism strategies and mixed precision, on CPU with 2 real gloo processes.

Everything is real: `python -m hpc_train run --nproc N` (the built-in trainer, or the own-loop
example jobs/charlm.py through --script), the launcher's SIGTERM forwarding, DCP on disk,
`ckpt export` + `torch.load(weights_only=True)`. The built-in trainer's stops land at a chosen
step through the HPC_TRAIN_TEST_STOP_AT_STEP model plug-in (tests/plugins_for_tests.py); the own
loop is stopped by watching the disk, as in test_own_code.py.

Tolerances, and why:
* ddp vs allreduce, ddp vs split: bitwise. Both average as DDP does (divide by the world size,
  then sum), and a sum of 2 floats does not depend on the order.
* fsdp vs ddp: max |difference| <= 1e-6 after 12 Adam steps (measured: 7.5e-9 on the MLP, 0.0
  on charlm). FSDP2 reduce-scatters gradients and may divide before and after the sum, so an
  element may differ by an ulp, which Adam's normalised update carries on.
* Resume exactness: bitwise for every strategy (each is compared with itself).
* Under ``ddp`` the stop-and-resume exactness is tested in test_checkpoint_exact.py (built-in
  trainer) and test_own_code.py (charlm); it is not repeated here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import (REPO, assert_same_weights, export, hpc, one_line_exit2, run, show, start, steps,
                          stop_when, train_losses, write_config)
from hpc_train.errors import EXIT_STOPPED

STOP_AT = 7            # mid-epoch: 512 samples / (16 x 2 ranks) = 16 steps per epoch
TOTAL = 12             # BASE's train.max_steps
FSDP_ATOL = 1e-6


def _over(strategy: str, **extra) -> dict:
    return {"dist": {"strategy": strategy}, **extra}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """One uninterrupted built-in-trainer run per (strategy, nproc): (config, run dir, losses, weights)."""
    cache: dict = {}

    def get(strategy: str, nproc: int = 2):
        if (strategy, nproc) not in cache:
            d = tmp_path_factory.mktemp(f"straight-{strategy}-{nproc}")
            cfg = write_config(d / "job.yaml", _over(strategy))
            p = run(cfg, d / "run", nproc=nproc)
            assert p.returncode == 0, show(p)
            cache[strategy, nproc] = (cfg, d / "run", train_losses(d / "run"), export(d / "run", d / "final.pt"))
        return cache[strategy, nproc]
    return get


# -- the strategies train the same model -------------------------------------------------------
@pytest.mark.parametrize("strategy", ["allreduce", "split"])
@pytest.mark.procs
def test_allreduce_and_split_equal_ddp_bitwise(straight, strategy):
    _, _, ddp_losses, ddp_weights = straight("ddp")
    _, _, losses, weights = straight(strategy)
    assert losses == ddp_losses
    assert_same_weights(weights, ddp_weights)


@pytest.mark.procs
def test_accumulation_skips_the_averaging_under_every_strategy(tmp_path):
    """3 micro-batches per step: allreduce (its no_sync) is bitwise ddp (no_sync), fsdp
    (set_requires_gradient_sync) within the tolerance."""
    out = {}
    for strategy in ("ddp", "allreduce", "fsdp"):
        cfg = write_config(tmp_path / f"{strategy}.yaml", _over(strategy, optim={"grad_accum": 3},
                                                                train={"max_steps": 4}))
        p = run(cfg, tmp_path / strategy)
        assert p.returncode == 0, show(p)
        out[strategy] = export(tmp_path / strategy, tmp_path / f"{strategy}.pt")
    assert_same_weights(out["allreduce"], out["ddp"])
    assert max((out["fsdp"][k] - out["ddp"][k]).abs().max().item() for k in out["ddp"]) <= FSDP_ATOL


@pytest.mark.procs
def test_fsdp_matches_ddp_within_tolerance(straight):
    _, _, ddp_losses, ddp_weights = straight("ddp")
    _, _, losses, weights = straight("fsdp")
    assert sorted(weights) == sorted(ddp_weights)
    diff = max((weights[k] - ddp_weights[k]).abs().max().item() for k in weights)
    assert diff <= FSDP_ATOL, f"fsdp differs from ddp by {diff}"
    assert losses and sorted(losses) == sorted(ddp_losses), (sorted(losses), sorted(ddp_losses))
    assert all(abs(losses[s] - ddp_losses[s]) <= 1e-5 for s in losses)


@pytest.mark.procs
def test_split_matches_single_process_run(straight):
    """Stages at 1 process (no data parallelism): the same floats as the plain model."""
    _, _, plain_losses, plain_weights = straight("none", 1)
    _, _, losses, weights = straight("split", 1)
    assert losses == plain_losses
    assert_same_weights(weights, plain_weights)


# -- stop by SIGTERM mid-epoch, resume, compare bitwise -------------------------------------------
@pytest.fixture(scope="module")
def stopped(tmp_path_factory, straight):
    """Per strategy, a pristine copy of a 2-rank run stopped by SIGTERM at step STOP_AT."""
    cache: dict = {}

    def get(strategy: str) -> Path:
        if strategy not in cache:
            cfg, _, _, _ = straight(strategy)
            rd = tmp_path_factory.mktemp(f"stopped-{strategy}") / "run"
            p = run(cfg, rd, stop_at=STOP_AT)
            assert p.returncode == EXIT_STOPPED, show(p)
            assert f"checkpoint saved at step {STOP_AT}; run the same command to resume" in p.stderr, show(p)
            assert steps(rd)[0] == STOP_AT
            cache[strategy] = rd
        return cache[strategy]
    return get


@pytest.mark.parametrize("strategy", ["allreduce", "fsdp", "split"])
@pytest.mark.procs
def test_builtin_trainer_stop_and_resume_is_bitwise_exact(straight, stopped, tmp_path, strategy):
    cfg, _, ref_losses, ref_weights = straight(strategy)
    rd = tmp_path / "run"
    shutil.copytree(stopped(strategy), rd)
    p = run(cfg, rd)
    assert p.returncode == 0, show(p)
    assert f"resuming from step {STOP_AT} " in p.stderr, show(p)
    assert train_losses(rd) == ref_losses
    assert_same_weights(export(rd, tmp_path / "resumed.pt"), ref_weights)


@pytest.mark.parametrize("nproc", [1, 4])
@pytest.mark.procs
def test_fsdp_checkpoint_from_2_processes_resumes_at_another_world_size(straight, stopped, tmp_path, nproc):
    """The step-7 checkpoint of 2 fsdp ranks (sharded DTensors) loads at 1 and at 4 processes:
    DCP reshards. Not bitwise (the batches per step change with the world size); the data
    continues after the same number of samples."""
    cfg, _, _, _ = straight("fsdp")
    rd = tmp_path / "run"
    shutil.copytree(stopped("fsdp"), rd)
    p = run(cfg, rd, nproc=nproc, timeout=300)
    assert p.returncode == 0, show(p)
    assert f"saved at world size 2, now {nproc}: resharded" in p.stderr, show(p)
    result = json.loads((rd / "result.json").read_text())
    assert result["steps"] == TOTAL and result["world_size"] == nproc
    assert result["progress"]["samples_seen"] == STOP_AT * 32 + (TOTAL - STOP_AT) * 16 * nproc
    assert sorted(train_losses(rd)) == list(range(1, TOTAL + 1))


# -- the own loop (jobs/charlm.py) through run.wrap ---------------------------------------------
CHARLM = str(REPO / "jobs" / "charlm.py")
CHARLM_STEPS = 120


def _charlm(strategy: str, rd: Path) -> tuple[str, ...]:
    return ("run", "--script", CHARLM, "--nproc", "2", "--run-dir", str(rd), "--set", "checkpoint.every_steps=20",
            "--set", "log.tensorboard=false", "--set", f"dist.strategy={strategy}", "--", "--steps",
            str(CHARLM_STEPS))


@pytest.mark.parametrize("strategy", ["allreduce", "fsdp", "split"])
@pytest.mark.procs
def test_own_loop_stop_and_resume_is_bitwise_exact(tmp_path, strategy):
    ref = tmp_path / "straight"
    p = hpc(*_charlm(strategy, ref))
    assert p.returncode == 0, show(p)
    rd = tmp_path / "run"
    first = stop_when(start(*_charlm(strategy, rd)), rd / "checkpoints" / "step-20", timeout=180)
    assert first.returncode == EXIT_STOPPED, show(first)
    k = json.loads((rd / "stopped.json").read_text())["steps"]
    assert 20 <= k < CHARLM_STEPS and steps(rd)[0] == k
    second = hpc(*_charlm(strategy, rd))
    assert second.returncode == 0, show(second)
    assert f"resuming from step {k} " in second.stderr, show(second)
    assert train_losses(rd) == train_losses(ref)
    # state holds the unwrapped model: the keys are the plain model's under every strategy.
    weights = export(rd, tmp_path / "resumed.pt")
    assert sorted(weights) == ["embed.weight", "net.1.bias", "net.1.weight", "net.4.bias", "net.4.weight"]
    assert_same_weights(weights, export(ref, tmp_path / "straight.pt"))


# -- precision ---------------------------------------------------------------------------------
@pytest.mark.procs
def test_bf16_on_cpu_trains_digits(tmp_path):
    rd = tmp_path / "run"
    p = hpc("run", REPO / "jobs" / "digits.yaml", "--nproc", "2", "--run-dir", rd, "--set", "train.precision=bf16",
            "--set", "log.tensorboard=false", "--set", "log.progress=off", "--set", "train.epochs=6", timeout=300)
    assert p.returncode == 0, show(p)
    result = json.loads((rd / "result.json").read_text())
    assert result["test_accuracy"] >= 0.95, result


@pytest.mark.procs
def test_fp16_checkpoint_restores_the_scaler(tmp_path):
    """fp16 autocast runs on this CPU, with a real GradScaler. The scaler's growth tracker
    (successful steps since its last back-off) is in every checkpoint; a resumed run continues
    it, so its final scaler state and weights equal an uninterrupted run's."""
    cfg = write_config(tmp_path / "job.yaml", {"train": {"precision": "fp16", "max_steps": TOTAL}})
    ref = tmp_path / "straight"
    p = run(cfg, ref)
    assert p.returncode == 0, show(p)
    rd = tmp_path / "run"
    first = run(cfg, rd, stop_at=STOP_AT)
    assert first.returncode == EXIT_STOPPED, show(first)
    saved = torch.load(rd / "checkpoints" / f"step-{STOP_AT}" / "app.pt", weights_only=True)["scaler"]
    assert saved["_growth_tracker"] > 0 and saved["scale"] > 0, saved   # a live scaler, not a default one
    second = run(cfg, rd)
    assert second.returncode == 0, show(second)
    final = torch.load(rd / "checkpoints" / f"step-{TOTAL}" / "app.pt", weights_only=True)["scaler"]
    expected = torch.load(ref / "checkpoints" / f"step-{TOTAL}" / "app.pt", weights_only=True)["scaler"]
    assert final == expected
    assert_same_weights(export(rd, tmp_path / "a.pt"), export(ref, tmp_path / "b.pt"))


# -- bad input: one line, exit 2 ------------------------------------------------------------------
@pytest.mark.procs
def test_bad_input_is_one_line_exit_2(tmp_path, straight):
    rd = tmp_path / "r"
    job = REPO / "jobs" / "digits.yaml"
    one_line_exit2(hpc("run", job, "--set", "dist.strategy=zero3", "--run-dir", rd), "dist.strategy must be one of",
              "fsdp", "allreduce", "split")
    one_line_exit2(hpc("run", job, "--set", "dist.strategy=dp", "--nproc", "2", "--run-dir", rd),
              "dist.strategy=dp", "2 processes per node", "use dist.strategy=ddp")
    one_line_exit2(hpc("submit", job, "--set", "dist.strategy=dp", "--set", "job.tasks_per_node=4", "--dry-run"),
              "dist.strategy=dp", "4 processes per node")
    one_line_exit2(hpc("submit", job, "--set", "dist.strategy=dp", "--set", "job.gpus_per_node=8", "--dry-run"),
              "dist.strategy=dp", "8 processes per node", "job.tasks_per_node=1")
    assert hpc("submit", job, "--set", "dist.strategy=dp", "--set", "job.gpus_per_node=8", "--set",
               "job.tasks_per_node=1", "--dry-run").returncode == 0
    one_line_exit2(hpc("run", job, "--set", "train.opt_level=O1", "--set", "train.precision=bf16", "--run-dir", rd),
              "train.opt_level=O1 means train.precision=fp16")
    one_line_exit2(hpc("run", job, "--set", "dist.strategy=fsdp", "--set", "train.precision=fp16", "--run-dir", rd),
              "fsdp", "use train.precision=bf16")
    assert not rd.exists()
    # fsdp resumed from a checkpoint of another model (hidden 32 -> 16): refused before any worker.
    _, fsdp_run, _, _ = straight("fsdp")
    cfg = write_config(tmp_path / "other.yaml", _over("fsdp", model={"hidden": 16}))
    one_line_exit2(run(cfg, rd, resume=str(fsdp_run / "checkpoints" / f"step-{TOTAL}")), "model config",
              "'hidden': 32", "'hidden': 16")


def test_devices_a_cpu_cannot_show_are_refused_inone_line_exit2():
    """No GPU here: the two refusals that need one are checked on their pure functions, with the
    device counts a GPU node would report (the CLI turns their UsageError into one line, exit 2)."""
    from hpc_train.node import precision
    from hpc_train.node import strategies
    from hpc_train.errors import UsageError
    with pytest.raises(UsageError, match=r"3 stages on 3 devices, but each process has 2 \(4 GPUs per node / 2"):
        strategies.stage_devices(3, torch.device("cuda", 0), 4, 1, 2)
    assert strategies.stage_devices(2, torch.device("cuda", 2), 4, 1, 2) == [torch.device("cuda", 2),
                                                                                torch.device("cuda", 3)]
    assert strategies.stage_devices(3, torch.device("cpu"), 0, 0, 2) == [torch.device("cpu")] * 3
    with pytest.raises(UsageError, match="use train.precision=fp16"):
        precision.check("bf16", "cuda", bf16_supported=False)
    precision.check("bf16", "cpu", bf16_supported=False)   # CPU autocast emulates bfloat16
    precision.check("fp16", "cpu", bf16_supported=False)


@pytest.mark.procs
def test_opt_level_maps_onto_precision(run_cli):
    """`config` prints the resolved config without importing torch."""
    for level, expected in (("O0", "fp32"), ("O1", "fp16"), ("O2", "fp16")):
        p = run_cli("config", REPO / "jobs" / "digits.yaml", "--set", f"train.opt_level={level}")
        assert p.returncode == 0, p.stderr
        assert f"precision: {expected}" in p.stdout


@pytest.mark.procs
def test_dp_runs_as_one_process(tmp_path):
    rd = tmp_path / "run"
    cfg = write_config(tmp_path / "job.yaml", _over("dp", model={"name": "mlp", "hidden": 32}))
    p = run(cfg, rd, nproc=1)
    assert p.returncode == 0, show(p)
    assert json.loads((rd / "result.json").read_text())["steps"] == TOTAL
