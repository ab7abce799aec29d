"""keeper.json and the one reader of a Trainer's checkpoints (hpc_train.records.keeper): which
``checkpoint-N`` a rerun resumes from, as a table and as an invariant."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import safetensors_bytes, torch_archive_bytes
from hpc_train.records import keeper
from hpc_train.records.keeper import Keeper


def _checkpoint(out: Path, step: int, *, state: object = "ok", weights: bool = True, ranks: int = 2,
                torn: str | None = None) -> Path:
    """``torn``: the file a kill cut off (its bytes cut to ``TORN``'s length)."""
    ck = out / f"checkpoint-{step}"
    ck.mkdir(parents=True)
    if state == "ok":
        (ck / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    elif state is not None:
        (ck / "trainer_state.json").write_bytes(state if isinstance(state, bytes) else json.dumps(state).encode())
    if weights:
        (ck / "model.safetensors").write_bytes(safetensors_bytes())
    for r in range(ranks):
        (ck / ("rng_state.pth" if ranks == 1 else f"rng_state_{r}.pth")).write_bytes(torch_archive_bytes())
    if torn is not None:
        whole = (ck / torn).read_bytes() if (ck / torn).exists() else torch_archive_bytes()
        (ck / torn).write_bytes(whole[:TORN.get(torn, len(whole) // 2)])
    return ck


TORN = {"empty.pt": 0}


# (what the directory holds, the keeper's world size, the problem's words or None for complete)
CASES = [
    (dict(), 2, None),
    (dict(ranks=1), 1, None),
    (dict(ranks=1), 2, "no rng_state_0.pth"),            # saved at another world size
    (dict(ranks=2), 1, "no rng_state.pth"),
    (dict(state=None), 2, "trainer_state.json is missing"),
    (dict(state=b"{\"global_st"), 2, "trainer_state.json is not valid JSON"),   # cut off by a kill
    (dict(state={"global_step": 7}), 2, "says step 7, not 5"),
    (dict(state={"global_step": "5"}), 2, "says step '5', not 5"),
    (dict(state=[5]), 2, "trainer_state.json holds a list"),
    (dict(weights=False), 2, "no model weights"),
    (dict(ranks=0), 2, "no rng_state_0.pth"),
    # Present, but cut off by a kill while the Trainer wrote them in place.
    (dict(torn="rng_state_1.pth"), 2, "rng_state_1.pth is cut off"),
    (dict(torn="model.safetensors"), 2, "model.safetensors is cut off"),
    (dict(torn="optimizer.pt"), 2, "optimizer.pt is cut off"),
    (dict(torn="empty.pt"), 2, "empty.pt is cut off"),
]


@pytest.mark.parametrize("held, world, problem", CASES)
def test_a_trainer_checkpoint_is_complete_or_names_what_is_missing(tmp_path, held, world, problem):
    _checkpoint(tmp_path / "out", 5, **held)
    [k] = keeper.trainer_checkpoints(Keeper(keeper.TRAINER, tmp_path / "out", world))
    assert k.step == 5 and k.path == tmp_path / "out" / "checkpoint-5"
    assert (k.problem is None) if problem is None else (problem in k.problem), k.problem


def test_model_only_checkpoints_need_no_rng_states(tmp_path):
    _checkpoint(tmp_path / "out", 5, ranks=0)
    assert keeper.newest_complete(Keeper(keeper.TRAINER, tmp_path / "out", 2, model_only=True)).step == 5


def test_the_newest_complete_passes_over_newer_half_written_ones_links_and_files(tmp_path):
    out = tmp_path / "out"
    _checkpoint(out, 10)
    _checkpoint(out, 20, state=None)                        # a kill during the save
    (out / "checkpoint-30").symlink_to(out / "checkpoint-10")
    (out / "checkpoint-40").write_text("not a directory")
    for name in ("checkpoint-050", "checkpoint-x", "checkpoint-", "checkpoint-60.old", "old-1"):
        (out / name).mkdir()                                 # not the Trainer's names: not listed
    kept = Keeper(keeper.TRAINER, out, 2)
    assert [k.step for k in keeper.trainer_checkpoints(kept)] == [10, 20, 30, 40]
    assert keeper.newest_complete(kept).step == 10


def test_a_missing_output_dir_holds_nothing(tmp_path):
    assert keeper.trainer_checkpoints(Keeper(keeper.TRAINER, tmp_path / "nowhere", 2)) == []


def test_the_record_round_trips_and_a_bad_one_is_named(tmp_path):
    k = Keeper(keeper.TRAINER, tmp_path / "out", 4, model_only=True)
    keeper.write(tmp_path, k)
    assert keeper.read(tmp_path) == (k, None)
    for bad, words in [({"framework": "x", "directory": "/o", "world_size": 1}, "framework"),
                       ({"framework": keeper.TRAINER, "directory": "", "world_size": 1}, "directory"),
                       ({"framework": keeper.TRAINER, "directory": "/o", "world_size": 0}, "world_size"),
                       ({"framework": keeper.TRAINER, "world_size": 1}, "directory")]:
        (tmp_path / keeper.NAME).write_text(json.dumps(bad))
        got, problem = keeper.read(tmp_path)
        assert got is None and keeper.NAME in problem and words in problem, problem
    (tmp_path / keeper.NAME).unlink()
    assert keeper.read(tmp_path) == (None, None)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dirs=st.dictionaries(st.integers(0, 50), st.sampled_from(["complete", "no-state", "wrong-step", "no-rng"]),
                            max_size=8))
def test_the_chosen_checkpoint_is_complete_and_no_complete_one_is_newer(tmp_path_factory, dirs):
    out = tmp_path_factory.mktemp("out")
    for step, kind in dirs.items():
        _checkpoint(out, step, state=None if kind == "no-state" else {"global_step": step + 1}
                    if kind == "wrong-step" else "ok", ranks=1 if kind == "no-rng" else 2)
    kept = Keeper(keeper.TRAINER, out, 2)
    chosen = keeper.newest_complete(kept)
    complete = [s for s, kind in dirs.items() if kind == "complete"]
    assert (chosen.step if chosen else None) == (max(complete) if complete else None)


def test_files_written_by_torch_and_safetensors_are_whole_and_any_cut_of_them_is_not(tmp_path):
    """The real writers' formats: an RNG state as the Trainer saves it (torch.save) and weights
    saved by safetensors; the whole file is complete, every shorter prefix of it is cut off."""
    import torch
    from safetensors.torch import save_file

    _checkpoint(tmp_path / "out", 5)
    ck = tmp_path / "out" / "checkpoint-5"
    torch.save({"python": (3, (1, 2), None), "cpu": torch.get_rng_state()}, ck / "rng_state_1.pth")
    save_file({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, str(ck / "model.safetensors"))
    kept = Keeper(keeper.TRAINER, tmp_path / "out", 2)
    assert keeper.newest_complete(kept).step == 5
    for name in ("rng_state_1.pth", "model.safetensors"):
        whole = (ck / name).read_bytes()
        for cut in sorted({0, 1, 7, 8, 100, len(whole) // 2, len(whole) - 22, len(whole) - 1}):
            (ck / name).write_bytes(whole[:cut])
            [k] = keeper.trainer_checkpoints(kept)
            assert k.problem is not None and f"{name} is cut off" in k.problem, (name, cut, k.problem)
        (ck / name).write_bytes(whole)
    assert keeper.newest_complete(kept).step == 5
