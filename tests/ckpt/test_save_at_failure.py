"""A failure costs one step (issue 52): the survivors save the step they hold when a peer dies.

Real processes, real gloo groups, real SIGKILL, the README's loop (tests/scripts/local_tier_loop.py)
with neither tier saving anything before the fault (shared only at the end, local every 30 s:
the run is shorter). Rank 1 dies in the middle of step 8 (after its forward); rank 0 waits in
that step's gradient all-reduce, which fails.

* One node (``torchrun --nproc_per_node 2 --max-restarts 1``): rank 0 saves its item of step 7
  and rank 1's, from rank 1's own state that it kept at every step; the restart resumes both from
  step 7 and ends bitwise equal to a run never killed. Nothing is left in node memory.
* Two nodes: on the dev cluster (tests/slurm/test_save_at_failure_slurm.py); two torchrun agents
  on one machine restart their workers in step only when every worker dies at once, which a
  survivor that saves first does not.
* Off (``checkpoint.local_on_failure=false``): the restart starts from step 0, as before.
* What the pieces do alone: the keeping's exchange, the save's items (a copy's module files are
  links, never written over by a later save), a survivor that stepped its optimizer saves nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st
import torch

from helpers import show
from test_local_tier import _assert_bitwise, _logs, _torchrun

KILL_AT = 7   # the last step_end rank 1 completes
FAULT = dict(ON_FAILURE="true", LOCAL_EVERY="0", SHARED_EVERY="0", LOCAL_TIER_KILL_MID="1")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("jit-ref")
    p = _torchrun(d, 0, ON_FAILURE="true", LOCAL_EVERY="0", SHARED_EVERY="0")
    assert p.returncode == 0, show(p)
    return torch.load(d / "runs" / "loop" / "final.pt", weights_only=True)


def _resumed(logs: str) -> list[tuple[str, str]]:
    return re.findall(r"\[rank (\d)\] .*resumed from step (\d+) \(\S+\), saved at world size 2 \(local tier", logs)


@pytest.mark.procs
def test_a_rank_killed_mid_step_costs_that_step_only_bitwise(tmp_path, reference):
    p = _torchrun(tmp_path, KILL_AT, **FAULT)
    assert p.returncode == 0, show(p)
    logs = _logs(tmp_path / "runs" / "loop")
    said = [ln for ln in logs.splitlines() if "a peer left a collective: saved step" in ln]
    assert len(said) == 1 and "[rank 0]" in said[0], logs
    assert "saved step 7 to the node-local tier" in said[0] and "rank 0's item, and rank 1's" in said[0], said
    assert sorted(_resumed(logs)) == [("0", "7"), ("1", "7")], logs
    assert "shared tier" not in logs, logs
    _assert_bitwise(torch.load(tmp_path / "runs" / "loop" / "final.pt", weights_only=True), reference)
    assert list((tmp_path / "shm").iterdir()) == []   # nothing left in node memory


@pytest.mark.procs
def test_off_the_restart_starts_over_as_before(tmp_path, reference):
    p = _torchrun(tmp_path, KILL_AT, **dict(FAULT, ON_FAILURE="false"))
    assert p.returncode == 0, show(p)
    logs = _logs(tmp_path / "runs" / "loop")
    assert "saved step" not in logs and _resumed(logs) == [], logs
    _assert_bitwise(torch.load(tmp_path / "runs" / "loop" / "final.pt", weights_only=True), reference)


# Faults of the save itself, caused in the survivor's process (a wrapper's patch: a full directory
# and a process killed mid-save are faults this machine cannot time from outside).
PATCHES = {
    "full": """
import errno
from hpc_train.ckpt.local import flat, tier as tier_mod
def _full(path, buffers):
    raise OSError(errno.ENOSPC, "No space left on device", str(path))
_save = tier_mod.LocalTier.save_at_failure
def _save_full(self, *a, **kw):
    flat.write = _full
    return _save(self, *a, **kw)
tier_mod.LocalTier.save_at_failure = _save_full
""",
    "dies-saving": """
import os, signal
from hpc_train.ckpt.local import tier as tier_mod
def _dies(self, *a, **kw):
    os.kill(os.getpid(), signal.SIGKILL)   # after its own item, before the copy is committed
tier_mod.LocalTier._copy_at_failure = _dies
""",
    "keeper-dies-too": "",
}


def _torchrun_n(cwd: Path, nproc: int, patch: str, kill_at: int = KILL_AT, **env: str):
    import ast
    import subprocess
    import sys
    from helpers import clean_env
    from test_local_tier import STEPS, WRAPPER, _port
    (cwd / "loop.py").write_text(WRAPPER.replace("import local_tier_loop\n", f"if os.environ.get('TORCHELASTIC_RESTART_COUNT') == '0':\n"
                                                  + "".join(f"    {ln}\n" for ln in patch.strip().splitlines())
                                                  + "import local_tier_loop\n") if patch else WRAPPER)
    (cwd / "shm").mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--max-restarts", "1",
           "--monitor-interval", "0.2", "--master_port", _port(), "loop.py", str(STEPS), str(kill_at), str(cwd / "shm")]
    return subprocess.run(cmd, cwd=cwd, env=clean_env(**env), capture_output=True, text=True, timeout=240)


@pytest.mark.procs
@pytest.mark.parametrize("fault", sorted(PATCHES))
def test_a_save_that_cannot_be_made_falls_back_to_the_tiers_in_one_line(tmp_path, fault):
    """The shared tier saves every 4 steps here (step 4 when rank 1 dies in step 8). A full
    directory (the save fails: one line), the survivor killed during its save (rank 1's copy never
    committed), or the dead rank's keeper dying with it (3 ranks: ranks 1 and 2 die; rank 1's state
    was kept by rank 2): step 7 is not held for every rank, the restart says so in one line and
    resumes every rank from the shared tier's step 4, and the run ends bitwise equal to the same
    run killed the same way with the save at a failure off: nothing the tiers held is lost.
    (Against a run never killed, a 3-rank resume from the shared tier differs in the last bits
    with or without this save: DDP's first step after a start sums each gradient across three
    ranks in another order; two ranks' sums commute.)"""
    nproc = 3 if fault == "keeper-dies-too" else 2
    env = dict(FAULT, SHARED_EVERY="4", LOCAL_TIER_KILL_RANK="1,2" if nproc == 3 else "1")
    p = _torchrun_n(tmp_path, nproc, PATCHES[fault], **env)
    assert p.returncode == 0, show(p)
    logs = _logs(tmp_path / "runs" / "loop")
    if fault == "full":
        said = [ln for ln in logs.splitlines() if "the save at the failure" in ln]
        assert len(said) == 1 and "step 7) failed" in said[0] and "No space left" in said[0], logs
    else:
        said = [ln for ln in logs.splitlines() if "step 7 is held for rank" in ln]
        assert len(said) == 1 and "but not for rank 1; the restart loads step 4" in said[0], logs
    resumed = re.findall(r"resumed from step (\d+) \(\S+\), saved at world size \d \((\w+) tier", logs)
    assert resumed == [("4", "shared")] * nproc, logs
    ref = tmp_path / "ref"
    ref.mkdir()
    p = _torchrun_n(ref, nproc, "", **dict(env, ON_FAILURE="false"))
    assert p.returncode == 0, show(p)
    _assert_bitwise(torch.load(tmp_path / "runs" / "loop" / "final.pt", weights_only=True),
                    torch.load(ref / "runs" / "loop" / "final.pt", weights_only=True))
    assert list((tmp_path / "shm").iterdir()) == []


@pytest.mark.procs
def test_a_sharded_run_falls_back_to_the_tiers_in_one_line(tmp_path):
    """dist.strategy=fsdp: each rank holds only its own shards, so nothing is saved at the
    failure; the survivor says why in one line and the restart resumes from the shared tier's step 4,
    bitwise equal to the same run never killed."""
    env = dict(FAULT, SHARED_EVERY="4", STRATEGY="fsdp")
    p = _torchrun_n(tmp_path, 2, "", **env)
    assert p.returncode == 0, show(p)
    logs = _logs(tmp_path / "runs" / "loop")
    said = [ln for ln in logs.splitlines() if "nothing saved at the failure" in ln]
    assert len(said) == 1 and "dist.strategy=fsdp shards the state" in said[0], logs
    assert re.findall(r"resumed from step (\d+) \(\S+\), saved at world size 2 \((\w+) tier", logs) == \
        [("4", "shared")] * 2, logs
    ref = tmp_path / "ref"
    ref.mkdir()
    p = _torchrun_n(ref, 2, "", kill_at=0, **env)
    assert p.returncode == 0, show(p)
    _assert_bitwise(torch.load(tmp_path / "runs" / "loop" / "final.pt", weights_only=True),
                    torch.load(ref / "runs" / "loop" / "final.pt", weights_only=True))

def _tier(tmp_path: Path, rank: int = 0, world: int = 2):
    from hpc_train import config as config_mod, config_local
    from hpc_train.ckpt.local.tier import LocalTier
    base, run_dir = tmp_path / "shm", tmp_path / "run"
    base.mkdir(exist_ok=True)
    run_dir.mkdir(exist_ok=True)
    cfg = config_mod.load(None, [f"checkpoint.local_dir={base}", "checkpoint.local_every_steps=1"])
    node = config_local.node_dir(base / "hpc_train-1", run_dir, {}, "node0")
    return LocalTier(cfg.checkpoint, cfg.dist, run_dir, rank, world, node=node)


def _state() -> tuple[dict, dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    state = {"model": model, "optim": optim, "step": 0, "seen": 0}
    kinds = {"model": "module", "optim": "optimizer", "step": "plain", "seen": "plain"}
    return state, kinds


def _train(state: dict) -> None:
    loss = state["model"](torch.randn(16, 4)).square().mean()
    state["optim"].zero_grad()
    loss.backward()
    state["optim"].step()
    state["step"] += 1


def test_a_survivor_saves_its_item_and_the_kept_ranks_item_which_load_as_that_step(tmp_path):
    """Rank 0 of 2 holds step 3 when its peer fails (the next step's forward has changed the
    BatchNorm statistics, no optimizer step yet): its own item and rank 1's (rank 1's own values,
    as kept) are complete and verify, load the weights and statistics of step 3 with each rank's
    own values, and a restart of the node's items picks step 3 for both ranks. The copy's module
    files are links to the item's, and a later save that recycles the item's files writes new ones
    instead: the copy still verifies."""
    from hpc_train.ckpt import load, store, tiers
    from hpc_train.ckpt.local.keep import Kept, take
    tier = _tier(tmp_path)
    state, kinds = _state()
    for _ in range(3):
        _train(state)
    state["seen"] = 30
    mine = take(state, kinds, 0, 3)
    theirs = take(state, kinds, 1, 3)
    theirs = Kept(1, 3, {**theirs.own, "plain": {**theirs.own["plain"], "seen": 31}}, theirs.app)
    weights = {k: v.clone() for k, v in state["model"].state_dict().items()}
    state["model"](torch.randn(16, 4))     # the next step's forward: the statistics move
    assert not torch.equal(state["model"][1].running_mean, weights["1.running_mean"])
    assert sorted(tier.save_at_failure(state, kinds, mine, theirs)) == [0, 1]
    own, copy = tier.dir / "step-3", tier.node / "copies" / "rank-1" / "step-3"
    for rank, path, seen in ((0, own, 30), (1, copy, 31)):
        info = store.inspect(path)
        assert info.complete and store.verify_checksums(info) is None, info.problem
        assert info.record["rank"] == rank and info.record["saved_at"] == "failure"
        fresh, _ = _state()
        load.load(fresh, path, rank, 2, kinds, single=True)
        assert all(torch.equal(fresh["model"].state_dict()[k], v) for k, v in weights.items())
        assert (fresh["step"], fresh["seen"]) == (3, seen)
    assert (copy / "flat-float32.bin").stat().st_ino == (own / "flat-float32.bin").stat().st_ino
    ident = tiers.Identity.of(tier.run_dir, world_size=2)
    assert tiers.restart(tiers.on_node(tier.node), ident).step == 3
    for step in (4, 5, 6):       # local_keep 2: step 3's item is retired, its files reused
        _train(state)
        tier.save(state, step, kinds)
        tier.wait()
    assert not own.exists()
    info = store.inspect(copy)
    assert info.complete and store.verify_checksums(info) is None, info.problem
    tier.close(remove=True)
    assert not tier.node.exists()


def test_a_full_directory_saves_nothing_whole_and_says_why(tmp_path):
    """The directory cannot take the item (a fault this machine cannot cause in /dev/shm without
    root: the write raises ENOSPC): the save raises the disk's error, and no complete item is left."""
    import errno
    from hpc_train.ckpt import store, tiers
    from hpc_train.ckpt.local import flat
    from hpc_train.ckpt.local.keep import take
    tier = _tier(tmp_path)
    state, kinds = _state()
    _train(state)
    write = flat.write

    def full(path, buffers):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    flat.write = full
    try:
        with pytest.raises(OSError, match="No space left"):
            tier.save_at_failure(state, kinds, take(state, kinds, 0, 1), take(state, kinds, 1, 1))
    finally:
        flat.write = write
    assert not any(i.info.complete for i in tiers.on_node(tier.node))
    assert not store.inspect(tier.dir / "step-1").complete


@pytest.mark.parametrize("world", [2, 3, 8])
def test_each_rank_is_kept_by_exactly_one_other_rank(world):
    from hpc_train.ckpt.local.keep import keeper_of
    from hpc_train.ckpt.local.peer import Ring
    pairs = [keeper_of(r, world, None) for r in range(world)]
    assert sorted(k for k, _ in pairs) == list(range(world)) and all(k != r for r, (k, _) in enumerate(pairs))
    assert all(pairs[k][1] == r for r, (k, _) in enumerate(pairs))   # the keeper's source is the rank
    ring = [Ring(r, r % 2, 2, r // 2, 2, 1) for r in range(4)]        # two nodes of two: the other node
    assert [keeper_of(r, 4, ring[r]) for r in range(4)] == [(2, 2), (3, 3), (0, 0), (1, 1)]


# -- the kept state's message: its own codec, never an arbitrary pickle ------------------------
def _roundtrip(part):
    from hpc_train.ckpt.local.keep import body_size, decode, encode, write
    skeleton, tensors = encode(part)
    n = body_size(skeleton, tensors)
    out = torch.full((n + 64,), 7, dtype=torch.uint8)     # a message is longer than its body
    write(out, skeleton, tensors)
    return decode(out[:n].numpy().tobytes())


def test_a_ranks_own_state_crosses_as_it_was():
    """The generators' states, and per-rank objects of every plain kind: tuples stay tuples, int
    keys int keys, a view's values (not its storage), an empty tensor, bfloat16, bool."""
    from hpc_train.ckpt.local.keep import _same
    from hpc_train.ckpt.state import rng_state
    wide = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    part = {"rng": rng_state(), "objects": {"loader": {"epoch": 2, 3: (1, 2.5, "x"), "view": wide[:, 1:3],
                                                       "empty": torch.empty(0, 4), "none": None,
                                                       "flags": torch.tensor([True, False]), "f": [1e-300]}}}
    back = _roundtrip(part)
    assert _same(part, back) and back["objects"]["loader"][3] == (1, 2.5, "x")
    assert back["objects"]["loader"]["view"].shape == (3, 2) and back["rng"]["torch"].dtype == torch.uint8


@settings(max_examples=60, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=8)
    | st.builds(lambda n, d: torch.arange(n).to(d), st.integers(0, 40),
                st.sampled_from([torch.int64, torch.float32, torch.bfloat16, torch.uint8, torch.bool])),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=6) | st.integers(), inner, max_size=4), max_leaves=20))
def test_any_plain_value_crosses_as_it_was(value):
    from hpc_train.ckpt.local.keep import _same
    assert _same(_roundtrip({"objects": value}), {"objects": value})


class _Runs:
    def __reduce__(self):
        import os
        return (os.system, ("touch /tmp/hpc_train-keep-codec-ran",))


@pytest.mark.parametrize("damage", ["short", "skeleton longer than the body", "tensor beyond the body",
                                    "skeleton not torch's", "pickled code"])
def test_a_message_that_does_not_add_up_is_refused(damage):
    """What a peer sent is checked, never trusted: each of these raises (held() says the state
    cannot be read, and the save falls back to the tiers in one line)."""
    import io
    from hpc_train.ckpt.local.keep import body_size, decode, encode, write
    from hpc_train.ckpt.state import rng_state
    skeleton, tensors = encode({"rng": rng_state()})
    n = body_size(skeleton, tensors)
    out = torch.zeros(n, dtype=torch.uint8)
    write(out, skeleton, tensors)
    body = out.numpy().tobytes()
    if damage == "short":
        body = body[:5]
    elif damage == "skeleton longer than the body":
        body = (len(body)).to_bytes(8, "little") + body[8:]
    elif damage == "tensor beyond the body":
        body = body[:-100]
    elif damage == "skeleton not torch's":
        body = (4).to_bytes(8, "little") + b"\x80\x02K\x01" + body[12:]
    else:   # torch's own format around an object that would run a command when unpickled
        buf = io.BytesIO()
        torch.save(_Runs(), buf, _use_new_zipfile_serialization=False)
        code = buf.getvalue()
        body = len(code).to_bytes(8, "little") + code
    with pytest.raises(Exception):
        decode(body)
    assert not Path("/tmp/hpc_train-keep-codec-ran").exists()


SYNC_PROBE = """
import sys
import torch
import torch.distributed as dist
from hpc_train.node import strategies
from hpc_train.node.stops import Agreement

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
events = []
for name in ("ddp", "allreduce"):
    torch.manual_seed(0)
    agreement = Agreement(True, lambda: [0.0, 0.0, 0.0])
    agreement.on_sync = lambda: events.append((name, "sync"))
    net = strategies.wrap(torch.nn.Linear(4, 2), name, torch.device("cpu"), multi=True, local_rank=0,
                          local_world_size=1, agreement=agreement)
    optim = torch.optim.SGD(net.net.parameters(), lr=0.1)
    optim.register_step_pre_hook(lambda *_: events.append((name, "step")))
    for micro in range(3):      # two accumulated micro-batches, then the synced one
        with (net.no_sync() if micro < 2 else torch.enable_grad()):
            net.net(torch.randn(8, 4)).sum().backward()
            events.append((name, "backward"))
    optim.step()
    agreement.collect(torch.device("cpu"))
print(events)
"""


def test_the_state_goes_out_where_the_gradient_averaging_begins(tmp_path):
    """The keeping's send rides on the agreement's hook (hpc_train.run.Run._syncing): under DDP and
    the gradient averager it is called once per step, inside the synced backward (before its
    all-reduce), never in an accumulated micro-batch, and before the optimizer step."""
    import ast
    import subprocess
    import sys
    from helpers import clean_env
    script = tmp_path / "probe.py"
    script.write_text(SYNC_PROBE)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                       env=clean_env(), cwd=Path(__file__).resolve().parents[2])
    assert p.returncode == 0, show(p)
    for name in ("ddp", "allreduce"):
        seen = [e for n, e in ast.literal_eval(p.stdout.strip().splitlines()[-1]) if n == name]
        assert seen == ["backward", "backward", "sync", "backward", "step"], (name, seen)
