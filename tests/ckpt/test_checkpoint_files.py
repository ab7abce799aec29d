"""Reliability, round 3 (checkpoints) and checkpoint I/O at disk speed: checksums computed as
the bytes are written and checked as they are read, export that refuses damage, checkpoint files
that are not regular files, per-rank plain values, non-string state keys.

Real `python -m hpc_train` processes (2 gloo ranks), real files, real damage on disk. Where a
commit record is rewritten to match planted bytes, that is what an attacker (or a hand edit)
would do; it is said so at the spot."""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import zipfile
import zlib

import pytest

from helpers import clean_env, hpc, run, show, snapshot, steps, write_config

from hpc_train.ckpt import store
from hpc_train.errors import EXIT_STOPPED

# Every test here starts real training processes: not in `make test-fast`.
pytestmark = pytest.mark.procs


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Complete checkpoints step-6, step-4, step-2 of a 2-rank run stopped at step 6 of 8."""
    d = tmp_path_factory.mktemp("relckpt")
    cfg = write_config(d / "job.yaml", {"train": {"max_steps": 8}, "checkpoint": {"every_steps": 2, "keep": 3}})
    p = run(cfg, d / "run", stop_at=6)
    assert p.returncode == EXIT_STOPPED, show(p)
    assert steps(d / "run") == [6, 4, 2]
    return cfg, d / "run", p


def resume_on_workers(rd):
    """Resume ``rd`` with the workers alone, as the batch script's torchrun launcher starts them
    (``torchrun -m hpc_train worker``): no launcher plans first, so what a damaged checkpoint
    meets is the workers' own restore, which checks each item as it reads it. (``run`` verifies
    up front as well, and would skip it before any worker starts.)"""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(port), "-m", "hpc_train", "worker", "--config", str(rd / "config.yaml"), "--run-dir",
                        str(rd)], env=clean_env(), capture_output=True, text=True, timeout=300)
    return r


@pytest.fixture
def copy(base, tmp_path):
    cfg, rd, _ = base
    shutil.copytree(rd, tmp_path / "run", symlinks=True)
    return cfg, tmp_path / "run"


def flip_bit(path, rng: random.Random, lo: int = 0, hi: int | None = None) -> int:
    data = bytearray(path.read_bytes())
    at = rng.randrange(lo, len(data) if hi is None else hi)
    data[at] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    return at


def crc32c(data: bytes) -> str:
    import google_crc32c
    return f"{google_crc32c.value(data):08x}"


def logs(rd) -> str:
    return "".join(p.read_text() for p in sorted((rd / "logs").glob("rank-*.log")))


# -- issue 22.1: checksums computed as the bytes are written ---------------------------------
def test_commit_records_crc32c_per_file_and_per_item_computed_while_writing(base):
    _, rd, p = base
    assert "reading it back" not in p.stderr + logs(rd), show(p)   # no file needed a second read
    for info in store.scan(rd):
        sums = info.record["checksums"]
        assert sums["algorithm"] == "crc32c" and set(sums["files"]) == set(info.record["files"])
        assert {".metadata", "app.pt", "rank-0.pt", "rank-1.pt"} <= set(sums["files"])
        for name, want in sums["files"].items():
            assert crc32c((info.path / name).read_bytes()) == want, (info.path, name)
        shards = {n for n in info.record["files"] if n.endswith(".distcp")}
        assert set(sums["items"]) == shards
        for name, rows in sums["items"].items():
            data = (info.path / name).read_bytes()
            # The items tile the file, and each one's checksum is that of its bytes.
            assert [r[0] for r in rows] == [0] + [r[0] + r[1] for r in rows[:-1]]
            assert rows[-1][0] + rows[-1][1] == len(data)
            for offset, length, want in rows:
                assert crc32c(data[offset:offset + length]) == want, (name, offset)


# -- issue 22.2: verification that rides on the load -----------------------------------------
def _model_item(ck) -> tuple[str, int, int]:
    """(file, start, end) of the largest model weight, from DCP's own .metadata (our own file:
    plain DCP reading is fine here)."""
    from torch.distributed.checkpoint import FileSystemReader
    meta = FileSystemReader(str(ck)).read_metadata()
    fqn, info = max(((i.fqn, s) for i, s in meta.storage_data.items() if i.fqn.startswith("model.")),
                    key=lambda fs: fs[1].length)
    return str(info.relative_path), info.offset, info.offset + info.length


@pytest.mark.parametrize("where", ["weights", "zip directory"])
def _tensor_bytes(path, lo: int, hi: int) -> tuple[int, int]:
    """Where the tensor's own bytes lie in the storage item [lo, hi): torch.save's zip entry
    ``*/data/0`` (its local header is 30 bytes, the name and the extra field)."""
    item = path.read_bytes()[lo:hi]
    entry = next(e for e in zipfile.ZipFile(io.BytesIO(item)).infolist() if e.filename.endswith("/data/0"))
    at = entry.header_offset
    start = at + 30 + int.from_bytes(item[at + 26:at + 28], "little") + int.from_bytes(item[at + 28:at + 30], "little")
    return lo + start, lo + start + entry.file_size


@pytest.mark.parametrize("where", ["weights", "zip directory"])
def test_a_flipped_bit_is_caught_by_the_load_and_every_rank_falls_back(copy, where):
    """The workers choose by sizes only; the rank that reads the damaged item finds it, and every
    rank moves on to step-4 together. Nothing is deleted; the damaged one is moved aside. In the
    item's zip directory, torch.load fails before the item is checked: the checksum is still what
    the error names."""
    cfg, rd = copy
    ck6 = rd / "checkpoints" / "step-6"
    name, lo, hi = _model_item(ck6)
    if where == "weights":
        flip_bit(ck6 / name, random.Random(22), *_tensor_bytes(ck6 / name, lo, hi))
    else:
        flip_bit(ck6 / name, random.Random(22), hi - 22, hi - 18)      # its signature: torch.load fails
    damaged = snapshot(ck6)
    p = resume_on_workers(rd)
    assert p.returncode == 0, show(p)
    text = p.stderr + logs(rd)
    assert re.search(r"skipping checkpoint step 6 \(\S*step-6\): it does not load: "
                     rf"{re.escape(name)} \(bytes {lo}-{hi}\) fails its crc32c check \(recorded \w{{8}}, read \w{{8}}\)$",
                     text, re.M), show(p)
    assert f"resumed from step 4 ({rd / 'checkpoints' / 'step-4'})" in text, show(p)
    aside = list((rd / "checkpoints").glob("step-6.skipped-*"))
    assert len(aside) == 1 and snapshot(aside[0]) == damaged


def test_a_flipped_rank_file_fails_on_its_own_rank_and_both_fall_back(copy):
    cfg, rd = copy
    flip_bit(rd / "checkpoints" / "step-6" / "rank-1.pt", random.Random(5))
    p = resume_on_workers(rd)
    assert p.returncode == 0, show(p)
    text = p.stderr + logs(rd)
    assert re.search(r"skipping checkpoint step 6 \(\S*step-6\): it does not load: cannot load rank-1.pt: "
                     r"rank-1.pt fails its crc32c check", text) or "another rank could not load" in text, show(p)
    assert f"resumed from step 4 ({rd / 'checkpoints' / 'step-4'})" in text, show(p)


def _as_old_format(ck) -> None:
    """Rewrite a commit record as the previous format wrote it: zlib CRC-32 per file, no items."""
    rec = json.loads((ck / "commit.json").read_text())
    rec["checksums"] = {"algorithm": "crc32", "files": {
        n: f"{zlib.crc32((ck / n).read_bytes()):08x}" for n in rec["files"]}}
    (ck / "commit.json").write_text(json.dumps(rec))


def test_checkpoints_of_the_previous_format_still_verify_and_load(copy):
    cfg, rd = copy
    for s in (6, 4):
        _as_old_format(rd / "checkpoints" / f"step-{s}")
    v = hpc("ckpt", "verify", rd)
    assert v.returncode == 0 and v.stdout.splitlines() == ["step 6: ok", "step 4: ok", "step 2: ok"], show(v)
    flip_bit(rd / "checkpoints" / "step-6" / "__0_0.distcp", random.Random(6))
    v = hpc("ckpt", "verify", rd)
    assert v.returncode == 1 and re.search(r"step 6: BAD: __0_0.distcp fails its crc32 check", v.stdout), show(v)
    p = resume_on_workers(rd)
    assert p.returncode == 0, show(p)
    text = p.stderr + logs(rd)
    # Old records have no item checksums: the loader checks each file it reads, whole.
    assert re.search(r"step 6 \(\S*step-6\): it does not load: .*__0_0.distcp fails its crc32 check", text), show(p)
    assert f"resumed from step 4 ({rd / 'checkpoints' / 'step-4'})" in text, show(p)


# -- issue 19.3: export verifies checksums first ---------------------------------------------
def test_export_refuses_a_bit_flipped_checkpoint(copy, tmp_path):
    _, rd = copy
    ck = rd / "checkpoints" / "step-6"
    name, lo, hi = _model_item(ck)
    flip_bit(ck / name, random.Random(3), lo, hi)            # a model weight: what export would write
    before = snapshot(rd)
    v = hpc("ckpt", "verify", rd)
    assert v.returncode == 1 and f"step 6: BAD: {name} fails its crc32" in v.stdout, show(v)
    out = tmp_path / "model.pt"
    for args in ((), ("--step", "6")):
        p = hpc("ckpt", "export", rd, out, *args)
        assert p.returncode == 2, show(p)
        lines = [x for x in p.stderr.splitlines() if x.strip()]
        assert len(lines) == 1 and "Traceback" not in p.stderr, show(p)
        assert "step-6" in lines[0] and f"{name} fails its crc32" in lines[0], show(p)
        assert not out.exists() and not (tmp_path / "model.pt.tmp").exists()
    p = hpc("ckpt", "export", rd, out, "--step", "4")       # an intact one still exports
    assert p.returncode == 0, show(p)
    assert snapshot(rd) == before


# -- issue 19.11: checkpoint files that are not regular files -------------------------------
def _plant_special(ck, name: str, kind: str) -> None:
    """Replace one file by a FIFO or a symlink to /dev/zero, and make the record agree on its
    size (0, as stat reports for both) and checksum (of no bytes), as a hand edit would."""
    (ck / name).unlink()
    if kind == "fifo":
        os.mkfifo(ck / name)
    else:
        os.symlink("/dev/zero", ck / name)
    rec = json.loads((ck / "commit.json").read_text())
    rec["files"][name] = 0
    rec["checksums"]["files"][name] = "00000000"       # CRC32C (and CRC-32) of no bytes
    for items in (rec["checksums"].get("items", {}),):
        items.pop(name, None)
    (ck / "commit.json").write_text(json.dumps(rec))


@pytest.mark.parametrize("kind", ["fifo", "symlink-to-dev-zero"])
def test_a_checkpoint_file_that_is_not_regular_is_invalid_not_a_hang(copy, kind):
    cfg, rd = copy
    _plant_special(rd / "checkpoints" / "step-6", "app.pt", kind)
    what = "a FIFO" if kind == "fifo" else "a symlink"
    v = hpc("ckpt", "verify", rd, timeout=60)
    assert v.returncode == 1, show(v)
    assert v.stdout.splitlines() == [f"step 6: BAD: app.pt is {what}, not a regular file", "step 4: ok",
                                     "step 2: ok"], show(v)
    p = run(cfg, rd, timeout=120)
    assert p.returncode == 0, show(p)
    launcher = [ln for ln in p.stderr.splitlines() if ln.startswith("hpc_train: warning: skipping")]
    assert len(launcher) == 1 and f"step-6): app.pt is {what}, not a regular file" in launcher[0], show(p)
    assert f"resumed from step 4 ({rd / 'checkpoints' / 'step-4'})" in p.stderr + logs(rd), show(p)


# -- issue 19.4 and 19.17: plain values per rank; non-string keys ---------------------------
SCRIPT = '''
import json, os, sys
import torch
import hpc_train

run = hpc_train.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
fresh = os.environ["PHASE"] == "save"
state = {"model": model, "optim": opt, "step": 0,
         "who": f"rank-{run.rank}" if fresh else "unset",
         "mine": torch.tensor([float(run.rank)]) if fresh else torch.tensor([-1.0]),
         "shared": 7 if fresh else -1}
if os.environ.get("INT_KEY"):
    state[1] = 5
run.restore(state)
out = os.path.join(os.environ["OUT_DIR"], f"{os.environ['PHASE']}-{run.rank}-of-{run.world_size}.json")
with open(out, "w") as f:
    json.dump({"who": state["who"], "mine": state["mine"].tolist(), "shared": state["shared"],
               "step": state["step"]}, f)
while state["step"] < int(os.environ["STEPS"]):
    state["step"] += 1
    if run.step_end(state):
        break
run.finish()
'''


def _script_run(tmp_path, rd, phase: str, nproc: int, steps_: int, **env: str):
    script = tmp_path / "plain.py"
    script.write_text(SCRIPT)
    (tmp_path / "out").mkdir(exist_ok=True)
    return hpc("run", "--script", script, "--nproc", str(nproc), "--run-dir", rd, "--set", "log.tensorboard=false",
               env=clean_env(PHASE=phase, OUT_DIR=str(tmp_path / "out"), STEPS=str(steps_), **env), timeout=180)


def _restored(tmp_path, phase: str, rank: int, world: int) -> dict:
    return json.loads((tmp_path / "out" / f"{phase}-{rank}-of-{world}.json").read_text())


def test_plain_values_come_back_per_rank(tmp_path):
    rd = tmp_path / "run"
    p = _script_run(tmp_path, rd, "save", 2, 2)
    assert p.returncode == 0, show(p)
    (rd / "result.json").unlink()                 # not finished: the next run restores
    p = _script_run(tmp_path, rd, "same-world", 2, 3)
    assert p.returncode == 0, show(p)
    for r in (0, 1):                              # each rank its own, at the same world size
        assert _restored(tmp_path, "same-world", r, 2) == {"who": f"rank-{r}", "mine": [float(r)], "shared": 7,
                                                           "step": 2}
    info = store.newest_complete(rd)
    assert info.step == 3 and info.record["differs_by_rank"] == ["mine", "who"], info.record
    (rd / "result.json").unlink()
    p = _script_run(tmp_path, rd, "one-rank", 1, 4)
    assert p.returncode == 0, show(p)
    # Another world size: rank 0's values, and the ones that differed across ranks are named.
    assert _restored(tmp_path, "one-rank", 0, 1) == {"who": "rank-0", "mine": [0.0], "shared": 7, "step": 3}
    text = p.stderr + logs(rd)
    for key in ("who", "mine"):
        assert re.search(rf"state\['{key}'\] differed from rank to rank in the checkpoint saved at world size 2; "
                         rf"at world size 1 every rank gets rank 0's value", text), show(p)
    assert "state['shared'] differed" not in text


def test_a_non_string_state_key_is_refused_at_restore(tmp_path):
    rd = tmp_path / "run"
    p = _script_run(tmp_path, rd, "save", 1, 2, INT_KEY="1")
    assert p.returncode != 0, show(p)
    assert "state key 1 is not a string (int)" in p.stderr, show(p)
    assert not list((tmp_path / "out").iterdir()), "restore() returned: the script went on to train"
    assert not (rd / "checkpoints").exists() or not any((rd / "checkpoints").iterdir())
