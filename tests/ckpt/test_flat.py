"""The local tier's layout (hpc_train.ckpt.local.flat): a rank's tensors as one raw file per dtype, and
a skeleton that says where each lies. Through the real write and read on disk (the ones every
local item goes through, checksums included), any nesting of tensors and plain values comes back
bitwise; a module and an optimizer (a fresh one, with no state yet) resume bitwise; a state that
no longer matches, or a damaged skeleton or buffer file, is a CheckpointError naming the place,
never a partial load. A real local item of a crashed run holds one file per dtype and the same
weights as the shared checkpoint of its step."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_train.ckpt.local import flat
from hpc_train.ckpt.checksum import CRC32C, Checks
from hpc_train.errors import CheckpointError

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool, torch.uint8]


def _tensor(draw, dtype: torch.dtype) -> torch.Tensor:
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    t = (torch.randn(shape, generator=g) * 100).to(dtype) if dtype.is_floating_point else \
        torch.randint(0, 2 if dtype == torch.bool else 100, shape, generator=g).to(dtype)
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)        # not contiguous: copied densely, read back by place
    return t


@st.composite
def states(draw, depth: int = 0):
    def leaf():
        return st.one_of(st.sampled_from(DTYPES).map(lambda d: ("t", d)), st.floats(allow_nan=False),
                         st.integers(), st.booleans(), st.none(), st.text(max_size=5))
    n = draw(st.integers(0, 4))
    out = {}
    for i in range(n):
        kind = draw(st.sampled_from(["leaf", "leaf", "dict", "list", "tuple"]) if depth < 2 else st.just("leaf"))
        if kind == "leaf":
            v = draw(leaf())
            out[f"k{i}"] = _tensor(draw, v[1]) if isinstance(v, tuple) and v[:1] == ("t",) else v
        elif kind == "dict":
            out[f"k{i}"] = draw(states(depth + 1))
        else:
            vals = [draw(states(depth + 1)) for _ in range(draw(st.integers(0, 2)))]
            out[f"k{i}"] = vals if kind == "list" else tuple(vals)
    return out


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)


def _save(state: dict, where: Path):
    """pack and write, as the local tier's writer does; the skeleton through torch.save and back
    with weights_only, as rank-R.pt carries it. Returns (skeleton, the item's checks, buffers)."""
    buffers, skeleton, nbytes = flat.pack(state)
    assert nbytes == sum(b.numel() * b.element_size() for b in buffers.values())
    where.mkdir()
    sums = flat.write(where, buffers)
    assert sorted(sums) == sorted(flat.file_name(n) for n in buffers)
    buf = io.BytesIO()
    torch.save(skeleton, buf)
    skeleton = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    return skeleton, Checks(where, {"checksums": {"algorithm": CRC32C, "files": sums}}), buffers


@settings(max_examples=40, deadline=None)
@given(state=states())
@pytest.mark.procs
def test_any_state_comes_back_bitwise(tmp_path_factory, state):
    where = tmp_path_factory.mktemp("item") / "step-1"
    skeleton, checks, saved = _save(state, where)
    back = flat._unpack(skeleton, flat.read(where, skeleton, checks), clone=True)
    assert _equal(state, back)
    assert sorted(saved) == sorted({str(t.dtype).removeprefix("torch.") for t in _tensors(state)})
    flat._check(state, skeleton, saved, "state")     # the state it came from fits its own skeleton


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


KINDS = {"model": "module", "optim": "optimizer"}


def _trained(lr: float = 1e-3):
    from hpc_train.trainer.models import ConvNet
    m = ConvNet()
    return m, torch.optim.AdamW(m.parameters(), lr=lr)


def _step(m, o, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)
    o.zero_grad()
    torch.nn.functional.cross_entropy(m(x), y).backward()
    o.step()


def _restore_from(state: dict, target: dict, where: Path) -> None:
    skeleton, checks, _ = _save(flat.views(state, KINDS), where)
    flat.restore(target, KINDS, skeleton, flat.read(where, skeleton, checks))


@pytest.mark.procs
def test_a_module_and_a_fresh_optimizer_resume_bitwise(tmp_path):
    """The restore's usual case: a new process whose optimizer has taken no step (no state)."""
    torch.manual_seed(0)
    m1, o1 = _trained()
    _step(m1, o1, 1)
    m2, o2 = _trained(lr=0.5)
    o2.param_groups[0]["weight_decay"] = 0.3
    assert not o2.state
    _restore_from({"model": m1, "optim": o1}, {"model": m2, "optim": o2}, tmp_path / "step-1")
    assert o2.param_groups[0]["lr"] == 1e-3 and o2.param_groups[0]["weight_decay"] == 0.01
    for s in range(2, 5):
        _step(m1, o1, s)
        _step(m2, o2, s)
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    assert all(torch.equal(o1.state[p]["exp_avg_sq"], o2.state[q]["exp_avg_sq"])
               for p, q in zip(m1.parameters(), m2.parameters()))
    # The optimizer holds tensors of its own, not views of the buffer it was read from.
    bases = {o2.state[p]["exp_avg"].untyped_storage().data_ptr() for p in m2.parameters()}
    assert len(bases) == len(list(m2.parameters()))


def _grown(m):
    m.fc = torch.nn.Linear(m.fc.in_features, 11)


def _renamed(m):
    m.head = m.fc
    del m.fc


def _regrouped(o):
    o.param_groups[1:] = []
    g = o.param_groups[0]
    o.add_param_group({"params": [g["params"].pop()]})


@pytest.mark.parametrize("change, named", [
    (lambda m, o: _grown(m), r"size mismatch for model\.fc\.weight: the checkpoint holds float32 \[10, "),
    (lambda m, o: _renamed(m), r"entries under model differ from the state.s \(fc\.bias, fc\.weight, head\.bias\)"),
    (lambda m, o: _regrouped(o), r"optim: the checkpoint's parameter groups hold \[\d+\] parameters, the "
                                 r"optimizer's now \[\d+, 1\]"),
])
def test_a_state_that_changed_is_named_and_nothing_is_loaded(tmp_path, change, named):
    m1, o1 = _trained()
    _step(m1, o1, 1)
    m2, o2 = _trained(lr=0.5)
    change(m2, o2)
    before = {k: v.clone() for k, v in m2.state_dict().items()}
    with pytest.raises(CheckpointError, match=named):
        _restore_from({"model": m1, "optim": o1}, {"model": m2, "optim": o2}, tmp_path / "step-1")
    assert all(torch.equal(before[k], v) for k, v in m2.state_dict().items()), "written before the mismatch was found"
    assert not o2.state and o2.param_groups[0]["lr"] == 0.5


def test_a_damaged_or_short_buffer_file_is_named(tmp_path):
    state = {"w": torch.arange(1000, dtype=torch.float32), "n": torch.tensor(3)}
    skeleton, checks, _ = _save(state, tmp_path / "step-1")
    f = tmp_path / "step-1" / "flat-float32.bin"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"flat-float32\.bin fails its crc32c check"):
        flat.read(tmp_path / "step-1", skeleton, checks)
    f.write_bytes(bytes(raw[:-4]))
    with pytest.raises(CheckpointError, match=r"flat-float32\.bin does not hold the 4000 bytes"):
        flat.read(tmp_path / "step-1", skeleton, checks)
    f.unlink()
    f.symlink_to(tmp_path / "elsewhere.bin")
    with pytest.raises(CheckpointError, match=r"cannot read flat-float32\.bin: is a symlink"):
        flat.read(tmp_path / "step-1", skeleton, checks)


@pytest.mark.parametrize("skeleton, named", [
    ({"w": {flat.MARK: ["system", 0, [2]]}}, "'system', which is not a torch dtype"),
    ({"w": {flat.MARK: ["float32", -1, [2]]}}, "bad entry"),
    ({"w": {flat.MARK: ["float32", 0, "2"]}}, "bad entry"),
    ({"w": {flat.MARK: ["float32", 0]}}, "bad entry"),
    ({"w": {flat.MARK: ["_C", 0, [2]]}}, "not a torch dtype"),
    ({"w": {flat.MARK: ["float32", True, [2]]}}, "bad entry"),
])
def test_a_damaged_skeleton_is_a_checkpoint_error(tmp_path, skeleton, named):
    with pytest.raises(CheckpointError, match=named):
        flat.read(tmp_path, skeleton, Checks(tmp_path, {}))


@pytest.mark.procs
def test_a_crashed_run_s_local_item_holds_a_file_per_dtype_and_the_shared_tier_s_weights(tmp_path):
    """The README's loop under torchrun, rank 1 killed at step 7 with no restart: rank 0's local
    item of step 6 has its tensors in one file per dtype, and its model's weights are those of the
    shared checkpoint of step 6."""
    from test_local_tier import _torchrun

    from helpers import export, show
    from hpc_train.ckpt import store
    from hpc_train.ckpt.safe import safe_torch_load
    p = _torchrun(tmp_path, 7, restarts="0", SHARED_EVERY="3")
    assert p.returncode != 0, show(p)
    item = next((tmp_path / "shm").glob("**/rank-0/step-6"))
    record = json.loads((item / "commit.json").read_text())
    assert record["layout"] == flat.LAYOUT and record["tier"] == "local", record
    assert sorted(record["files"]) == ["app.pt", "flat-float32.bin", "rank-0.pt"], record["files"]   # Adam's step too
    info = store.inspect(item)
    assert info.complete, info.problem
    skeleton = safe_torch_load(item / "rank-0.pt", None)[flat.KEY]
    model = flat._unpack(skeleton["model"], flat.read(item, skeleton, Checks(item, record)), clone=True)
    shared = export(tmp_path / "runs" / "loop", tmp_path / "m.pt", step=6)
    assert store.inspect(tmp_path / "runs" / "loop" / "checkpoints" / "step-6").complete
    names = {k.removeprefix("module."): v for k, v in model.items()}   # the DDP wrapper's own state dict
    assert sorted(names) == sorted(shared)
    assert [k for k in names if not torch.equal(names[k], shared[k])] == []


def test_an_item_of_this_layout_is_complete_with_its_rank_file_and_no_dcp_files(tmp_path):
    """store.inspect judges a local item by its own layout: no DCP .metadata, but the rank file
    that holds the skeleton; a layout that is not a name makes the record unreadable."""
    from hpc_train.ckpt import store
    item = tmp_path / "step-3"
    _, _, buffers = _save({"w": torch.ones(4)}, item)
    (item / "rank-0.pt").write_bytes(b"x")
    store.write_commit(item, {"step": 3, "layout": flat.LAYOUT}, durable=False)
    assert store.inspect(item).complete, store.inspect(item).problem
    (item / "rank-0.pt").unlink()
    store.write_commit(item, {"step": 3, "layout": flat.LAYOUT}, durable=False)
    assert store.inspect(item).problem == "commit record lists no rank-R.pt, which holds the item's layout"
    store.write_commit(item, {"step": 3}, durable=False)
    assert store.inspect(item).problem == "commit record lists no DCP .metadata"
    store.write_commit(item, {"step": 3, "layout": ["buffers"]}, durable=False)
    assert store.inspect(item).problem == "commit record is unreadable: layout is ['buffers'], not a name"
