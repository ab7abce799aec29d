"""Issue 3, `python -m hpc_train ckpt list|verify|export`, and safe loading: a checkpoint never
gets to run code. Real checkpoints from a 2-rank `run`; every command in a fresh process."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from helpers import export, hpc, load_full, plant, run, show, snapshot, steps, write_config
from hpc_train.errors import EXIT_STOPPED


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A 2-rank run with saves every 2 steps (keep=3), stopped by SIGTERM at step 6 of 10:
    complete checkpoints step-6, step-4, step-2, and a run that resumes when started again."""
    d = tmp_path_factory.mktemp("cli")
    cfg = write_config(d / "job.yaml", {"train": {"max_steps": 10}, "checkpoint": {"every_steps": 2, "keep": 3}})
    p = run(cfg, d / "run", stop_at=6)
    assert p.returncode == EXIT_STOPPED, show(p)
    assert steps(d / "run") == [6, 4, 2]
    return cfg, d / "run"


@pytest.fixture
def copy(base, tmp_path):
    cfg, rd = base
    shutil.copytree(rd, tmp_path / "run")
    return cfg, tmp_path / "run"


@pytest.mark.procs
def test_list_shows_step_time_size_status_world(copy):
    _, rd = copy
    (rd / "checkpoints" / "step-2" / "commit.json").unlink()        # one incomplete
    aside = rd / "checkpoints" / "step-8.skipped-1700000000"     # a moved-aside copy
    shutil.copytree(rd / "checkpoints" / "step-6", aside)
    p = hpc("ckpt", "list", rd)
    assert p.returncode == 0, show(p)
    lines = p.stdout.splitlines()
    rows = [ln.split() for ln in lines[1:4]]
    assert [int(r[0]) for r in rows] == [6, 4, 2]
    for r in rows[:2]:
        step = int(r[0])
        ck = rd / "checkpoints" / f"step-{step}"
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", r[1]) and re.fullmatch(r"\d\d:\d\d:\d\d", r[2]), r
        on_disk = sum(f.stat().st_size for f in ck.iterdir() if f.name != "commit.json")
        assert r[3] == f"{on_disk / 1e6:.2f}MB", (r, on_disk)
        assert r[4] == "2" and r[5] == "complete", r
    assert rows[2][-1] != "complete" and "INCOMPLETE: no commit record" in p.stdout.splitlines()[3]
    aside_mb = sum(f.stat().st_size for f in aside.iterdir()) / 1e6
    total_mb = sum(f.stat().st_size for f in (rd / "checkpoints").rglob("*") if f.is_file()) / 1e6
    assert lines[4:] == ["moved aside by a resume, as incomplete or damaged: 1 (kept for you to look at; the newest 3 are kept, older ones removed: checkpoint.keep_skipped)", f"  step-8.skipped-1700000000  {aside_mb:.2f}MB",
                         f"disk use of {rd / 'checkpoints'}: {total_mb:.2f}MB"], lines


@pytest.mark.procs
def test_verify_flags_corrupted_checkpoints(copy):
    _, rd = copy
    ok = hpc("ckpt", "verify", rd)
    assert ok.returncode == 0, show(ok)
    assert ok.stdout.split() == ["step", "6:", "ok", "step", "4:", "ok", "step", "2:", "ok"]

    shard = rd / "checkpoints" / "step-6" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])                     # truncated: the sizes catch it
    meta = rd / "checkpoints" / "step-4" / ".metadata"
    meta.write_bytes(b"\x00" * meta.stat().st_size)                  # same size, garbage: a deeper check
    before = snapshot(rd)
    bad = hpc("ckpt", "verify", rd)
    assert bad.returncode == 1, show(bad)
    out = bad.stdout.splitlines()
    assert out[0].startswith("step 6: BAD: __1_0.distcp has"), out
    assert out[1].startswith("step 4: BAD: .metadata does not load"), out
    assert out[2] == "step 2: ok", out
    assert snapshot(rd) == before


@pytest.mark.procs
def test_export_loads_with_weights_only(copy, tmp_path):
    cfg, rd = copy
    w6 = export(rd, tmp_path / "w6.pt")                              # default: newest complete
    w4 = export(rd, tmp_path / "w4.pt", step=4)
    # A plain state_dict of tensors that the model loads strictly.
    from hpc_train import config
    from hpc_train.trainer import models
    model = models.build(config.load(cfg).model)
    model.load_state_dict(w6, strict=True)
    assert len(w6) >= 2 and sorted(w6) == sorted(w4) == sorted(model.state_dict()), (sorted(w6), sorted(w4))
    assert all(isinstance(v, torch.Tensor) for v in w6.values())
    full = load_full(rd / "checkpoints" / "step-6")                  # the same tensors as in the checkpoint
    assert all(torch.equal(full[f"model.{k}"], v) for k, v in w6.items())
    assert full["app.step"] == 6
    assert any(not torch.equal(w6[k], w4[k]) for k in w6)            # --step picks another save
    p = hpc("ckpt", "export", rd, tmp_path / "x.pt", "--step", "5")
    assert p.returncode == 2 and "no checkpoint at step 5 (have: 6, 4, 2)" in p.stderr, show(p)
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize("argv", [("list", "/does/not/exist"), ("verify", "/does/not/exist"),
                                  ("export", "/does/not/exist", "/tmp/never.pt")])
def test_bad_run_dir_is_a_usage_error(argv):
    p = hpc("ckpt", *argv)
    assert p.returncode == 2, show(p)
    assert len(p.stderr.strip().splitlines()) == 1 and "/does/not/exist" in p.stderr, show(p)


# -- loading never unpickles arbitrary objects -----------------------------------------------
def _s(text: str) -> bytes:
    b = text.encode()
    return b"\x8c" + bytes([len(b)]) + b          # SHORT_BINUNICODE


def evil_pickles(marker) -> dict[str, bytes]:
    cmd = f"touch {marker}"
    return {
        # The classic: GLOBAL os.system, REDUCE.
        "os.system": b"cos\nsystem\n(" + b"V" + cmd.encode() + b"\ntR.",
        # Protocol 4 resolves dotted names attribute by attribute: a module on an allow-list by
        # prefix ("torch.distributed.checkpoint.*") would hand out its `os` import's `system`.
        "dotted-name-via-dcp-module": (b"\x80\x04" + _s("torch.distributed.checkpoint.filesystem")
                                       + _s("os.system") + b"\x93" + _s(cmd) + b"\x85R."),
    }


def test_evil_pickles_really_run_code_when_unpickled(tmp_path):
    """Control: the payloads below are live (plain pickle runs them), so a refusal means something."""
    import pickle
    for name, payload in evil_pickles(tmp_path / "m").items():
        (tmp_path / "m").unlink(missing_ok=True)
        pickle.loads(payload)
        assert (tmp_path / "m").exists(), name


@pytest.mark.parametrize("kind", ["os.system", "dotted-name-via-dcp-module"])
@pytest.mark.procs
def test_malicious_metadata_is_refused_everywhere(copy, tmp_path, kind):
    cfg, rd = copy
    marker = tmp_path / "PWNED"
    plant(rd / "checkpoints" / "step-6", ".metadata", evil_pickles(marker)[kind])
    before = snapshot(rd / "checkpoints")

    v = hpc("ckpt", "verify", rd)
    assert not marker.exists(), "ckpt verify ran the checkpoint's code"
    assert v.returncode == 1 and "step 6: BAD: .metadata does not load" in v.stdout, show(v)
    assert "not allowed" in v.stdout
    e = hpc("ckpt", "export", rd, tmp_path / "out.pt")
    assert not marker.exists(), "ckpt export ran the checkpoint's code"
    assert e.returncode == 2, show(e)
    assert "not allowed" in e.stderr and len(e.stderr.strip().splitlines()) == 1, show(e)
    assert not (tmp_path / "out.pt").exists()
    assert snapshot(rd / "checkpoints") == before
    if kind == "dotted-name-via-dcp-module":                          # one full resume attempt
        r = run(cfg, rd)
        assert not marker.exists(), "resuming ran the checkpoint's code"
        # Refused, then every rank falls back to step-4 together; the run finishes from there.
        assert r.returncode == 0, show(r)
        assert re.search(r"skipping checkpoint step 6 \(\S*step-6\): it does not load: .*not allowed", r.stderr), show(r)
        assert f"resumed from step 4 ({rd / 'checkpoints' / 'step-4'})" in r.stderr, show(r)
        aside = list((rd / "checkpoints").glob("step-6.skipped-*"))   # kept for inspection, not deleted
        assert len(aside) == 1 and (aside[0] / ".metadata").read_bytes() == evil_pickles(marker)[kind]


@pytest.mark.procs
def test_malicious_rank_file_is_refused_on_resume(copy, tmp_path):
    """The per-rank RNG/loader file is a torch.save pickle: loaded with weights_only=True."""
    cfg, rd = copy
    marker = tmp_path / "PWNED"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    ck = rd / "checkpoints" / "step-6"
    torch.save({"rng": Evil()}, ck / "evil.tmp")
    plant(ck, "rank-0.pt", (ck / "evil.tmp").read_bytes())
    (ck / "evil.tmp").unlink()
    r = run(cfg, rd)
    assert not marker.exists(), "resuming ran the rank file's code"
    # Only rank 0 fails (rank 1 loaded its own file fine); both fall back to step-4 together, with
    # no hang until the collective timeout, and finish.
    assert r.returncode == 0, show(r)
    assert re.search(r"skipping checkpoint step 6 \(\S*step-6\): it does not load: cannot load rank-0.pt: .*GLOBAL posix.system",
                     r.stderr), show(r)
    assert f"resumed from step 4 ({rd / 'checkpoints' / 'step-4'})" in r.stderr, show(r)


# -- ckpt export of a user's own state: the module under any key -------------------------------
def _save_in_process(run_dir, state) -> None:
    """One real checkpoint of ``state`` at its step, written by the Checkpointer in this process
    (world size 1), as a user's own loop writes it."""
    from hpc_train.ckpt.shared.save import Checkpointer
    from hpc_train.config import CheckpointSection
    ck = Checkpointer(CheckpointSection(), run_dir, 0, 1)
    ck.save(state, state["step"], blocking=True)
    ck.close()


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")   # DCP, in one process
@pytest.mark.procs
def test_export_takes_the_one_module_under_any_key(tmp_path):
    net = _net(0)
    _save_in_process(tmp_path / "run", {"net": net, "opt": torch.optim.SGD(net.parameters(), lr=0.1), "step": 3})
    got = export(tmp_path / "run", tmp_path / "net.pt")
    want = net.state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], v) for k, v in want.items()), sorted(got)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")   # DCP, in one process
@pytest.mark.procs
def test_export_of_several_modules_asks_which(tmp_path):
    from helpers import one_line_exit2
    student, teacher = _net(1), _net(2)
    rd, out = tmp_path / "run", tmp_path / "w.pt"
    _save_in_process(rd, {"student": student, "teacher": teacher, "step": 5})
    one_line_exit2(hpc("ckpt", "export", rd, out), "student", "teacher", "--key")
    one_line_exit2(hpc("ckpt", "export", rd, out, "--key", "opt"), "student", "teacher")
    assert not out.exists()
    p = hpc("ckpt", "export", rd, out, "--key", "teacher")
    assert p.returncode == 0, show(p)
    got = torch.load(out, weights_only=True)
    assert all(torch.equal(got[k], v) for k, v in teacher.state_dict().items()) and len(got) == 4


def _local_item(run_dir: Path, base: Path, job: str, rank: int, step: int, **record) -> Path:
    """A node-local item of ``run_dir`` as the tier lays it out (hpc_train.config_local), with a
    commit record; ``record``: fields that differ from this run's."""
    from hpc_train import config, config_local
    from hpc_train.ckpt import store
    path = config_local.node_dir(base / f"hpc_train-{job}", run_dir, {}, "n1") / f"rank-{rank}" / f"step-{step}"
    path.mkdir(parents=True)
    (path / f"rank-{rank}.pt").write_bytes(b"x")
    digest = config.load(run_dir / "config.yaml").digest()
    store.write_commit(path, {"step": step, "tier": "local", "run_dir": str(run_dir.resolve()), "rank": rank,
                              "world_size": 1, "config_hash": digest, "time": 1.0, "layout": store.BUFFERS, **record},
                       durable=False)
    return path


def test_ckpt_list_shows_local_items_when_the_shared_tier_has_none_and_names_what_would_not_load(tmp_path):
    """Issue 49.5: a run whose only checkpoints are node-local items (no checkpoints/ yet) is listed,
    not refused; an item a restart would not load (another config's) says why."""
    rd, base = tmp_path / "run", tmp_path / "shm"
    rd.mkdir()
    from hpc_train import config
    config.write(config.load(None, [f"checkpoint.local_dir={base}", "checkpoint.local_every_steps=5"]), rd)
    _local_item(rd, base, "7", 0, 5)
    _local_item(rd, base, "7", 0, 10, config_hash="another")
    p = hpc("ckpt", "list", rd)
    assert p.returncode == 0, show(p)
    lines = [ln for ln in p.stdout.splitlines() if "local n1/rank-0" in ln]
    assert [ln.split()[0] for ln in lines] == ["10", "5"], p.stdout
    assert "NOT LOADED: saved under another config" in lines[0] and "NOT LOADED" not in lines[1], p.stdout
    assert hpc("ckpt", "list", tmp_path).returncode == 2   # no checkpoints at all: still refused
    # status judges them as the restore would: step 5, the other config's step 10 named once
    from hpc_train.login.jobs import restart_point
    assert restart_point(rd, None) == ("restarted in place: step 5 from the node-local tier (every rank of 1 held) "
                                       "(1 other item(s) ignored: saved under another config); a requeue: step 0 "
                                       "(no shared checkpoint yet)")


def test_ckpt_list_of_a_script_s_run_says_where_its_checkpoints_are(tmp_path):
    """Issue 51: a --script run keeps its own checkpoints; `ckpt list` said only "has no
    checkpoints/ directory"."""
    from helpers import one_line_exit2
    from hpc_train import config
    rd = tmp_path / "run"
    config.write(config.load(None, ["train.script=train.py"]), rd)
    line = one_line_exit2(hpc("ckpt", "list", rd), str(rd), "no hpc_train checkpoints")
    assert "hpc_train.init()" in line and "a script's own checkpoints are wherever it writes them" in line
