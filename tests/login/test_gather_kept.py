"""The hook's progress for a Trainer script (login/gather._newest_checkpoint): without a
checkpoint of hpc_train's, a script's step was unknown, so two failures at different Trainer steps
looked like "the same error with no progress". With keeper.json the Trainer's newest complete
checkpoint is the step, and whether this job saved it."""

from __future__ import annotations

import json
import os

from helpers import safetensors_bytes, torch_archive_bytes
from hpc_train.login import gather
from hpc_train.records import keeper


def _trainer_run(tmp_path, step: int, mtime: float):
    ck = tmp_path / "out" / f"checkpoint-{step}"
    ck.mkdir(parents=True)
    (ck / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (ck / "model.safetensors").write_bytes(safetensors_bytes())
    (ck / "rng_state.pth").write_bytes(torch_archive_bytes())
    os.utime(ck / "trainer_state.json", (mtime, mtime))
    (tmp_path / "run").mkdir()
    keeper.write(tmp_path / "run", keeper.Keeper(keeper.TRAINER, tmp_path / "out", 1))
    return tmp_path / "run"


def test_a_trainer_script_s_progress_is_its_newest_complete_checkpoint(tmp_path):
    rd = _trainer_run(tmp_path, 30, mtime=2000.0)
    assert gather._newest_checkpoint(rd, 1000, script=True) == (30, True)     # saved by this job
    assert gather._newest_checkpoint(rd, 3000, script=True) == (30, False)    # by an earlier one


def test_without_a_keeper_a_script_s_step_is_unknown_and_the_trainer_s_is_0(tmp_path):
    rd = tmp_path / "run"
    rd.mkdir()
    assert gather._newest_checkpoint(rd, 1000, script=True) == (None, False)
    assert gather._newest_checkpoint(rd, 1000, script=False) == (0, False)
    (tmp_path / "out" / "checkpoint-5").mkdir(parents=True)                  # half-written: not a step
    keeper.write(rd, keeper.Keeper(keeper.TRAINER, tmp_path / "out", 1))
    assert gather._newest_checkpoint(rd, 1000, script=True) == (None, False)
