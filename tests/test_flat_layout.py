"""The local tier's flat layout (hpc_train.ckpt.flat): a rank's tensors as one buffer per dtype,
and a skeleton that says where each lies. Through a real DCP save and load on disk (the writer
and reader every local item goes through), any nesting of tensors and plain values comes back
bitwise, in the live state's own tensors; a state that no longer matches, or a damaged
skeleton, is a CheckpointError naming the place, never a partial load. A real local item of a
crashed run holds a few DCP items (not one per tensor) and the same weights as the shared
checkpoint of its step."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_train.ckpt import flat
from hpc_train.ckpt.crc import ChecksummingWriter
from hpc_train.ckpt.safe import SafePlanner, SafeReader
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


def _like(obj):
    """The same nesting, every tensor a fresh one of its shape and dtype (the live state a load
    fills), every plain value different."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj, memory_format=torch.contiguous_format)
    if isinstance(obj, dict):
        return {k: _like(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_like(v) for v in obj)
    return "changed"


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)


def _round_trip(state: dict, target, where: Path):
    """pack, a DCP save and the skeleton through torch.save (weights_only on the way back), then
    a DCP load into buffers the skeleton sizes, and fill."""
    saved, skeleton, nbytes = flat.pack(state)
    assert nbytes == sum(b.numel() * b.element_size() for b in saved[flat.KEY].values())
    where.mkdir()
    dcp.save(saved, storage_writer=ChecksummingWriter(str(where), thread_count=1, sync_files=False), no_dist=True)
    buf = io.BytesIO()
    torch.save(skeleton, buf)
    skeleton = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    buffers = flat.empty_buffers(skeleton)
    if buffers[flat.KEY]:
        dcp.load(buffers, storage_reader=SafeReader(str(where)), planner=SafePlanner(), no_dist=True)
    return flat.fill(target, skeleton, buffers), saved


@settings(max_examples=40, deadline=None)
@given(state=states())
def test_any_state_comes_back_bitwise_into_the_live_tensors(tmp_path_factory, state):
    target = _like(state)
    live = list(_tensors(target))
    out, saved = _round_trip(state, target, tmp_path_factory.mktemp("item") / "step-1")
    assert _equal(state, out)
    assert [id(t) for t in _tensors(out)] == [id(t) for t in live]     # filled in place, as DCP loads
    assert sorted(saved[flat.KEY]) == sorted({str(t.dtype).removeprefix("torch.") for t in _tensors(state)})


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def test_an_optimizer_s_state_resumes_bitwise(tmp_path):
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    from hpc_train.ckpt.common import dcp_state
    from hpc_train.trainer.models import ConvNet
    torch.manual_seed(0)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))

    def step(m, o):
        o.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        o.step()
    kinds = {"model": "module", "optim": "optimizer"}
    m1 = ConvNet()
    o1 = torch.optim.AdamW(m1.parameters(), lr=1e-3)
    step(m1, o1)
    m2 = ConvNet()
    o2 = torch.optim.AdamW(m2.parameters(), lr=0.5, weight_decay=0.3)
    target, _ = _round_trip(dcp_state({"model": m1, "optim": o1}, kinds), dcp_state({"model": m2, "optim": o2}, kinds),
                            tmp_path / "step-1")
    set_model_state_dict(m2, target["model"])
    set_optimizer_state_dict(m2, o2, target["optim"])
    assert o2.param_groups[0]["lr"] == 1e-3 and o2.param_groups[0]["weight_decay"] == 0.01
    for _ in range(3):
        step(m1, o1)
        step(m2, o2)
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))


@pytest.mark.parametrize("change, named", [
    (lambda s: s["model"].__setitem__("w", torch.zeros(3, 5)), "size mismatch for model.w"),
    (lambda s: s["model"].pop("b"), "entries under model differ"),
    (lambda s: s.__setitem__("groups", [{"lr": 1.0}]), "groups has 2 entries"),
    (lambda s: s["model"].__setitem__("b", 3), "model.b is a tensor in the checkpoint"),
])
def test_a_state_that_changed_is_named_and_nothing_is_loaded(tmp_path, change, named):
    state = {"a": torch.full((3,), 7.0), "model": {"w": torch.ones(4, 5), "b": torch.ones(5)},
             "groups": [{"lr": 0.1}, {"lr": 0.2}]}
    target = _like(state)
    change(target)
    with pytest.raises(CheckpointError, match=named):
        _round_trip(state, target, tmp_path / "step-1")
    assert torch.equal(target["a"], torch.zeros(3)), "a place checked before the mismatch was written"


@pytest.mark.parametrize("skeleton, named", [
    ({"w": {flat.MARK: ["system", 0, [2]]}}, "'system', which is not a torch dtype"),
    ({"w": {flat.MARK: ["float32", -1, [2]]}}, "bad entry"),
    ({"w": {flat.MARK: ["float32", 0, "2"]}}, "bad entry"),
    ({"w": {flat.MARK: ["float32", 0]}}, "bad entry"),
])
def test_a_damaged_skeleton_is_a_checkpoint_error(skeleton, named):
    with pytest.raises(CheckpointError, match=named):
        flat.empty_buffers(skeleton)


def test_a_crashed_run_s_local_item_holds_few_items_and_the_shared_tier_s_weights(tmp_path):
    """The README's loop under torchrun, rank 1 killed at step 7 with no restart: rank 0's local
    item of step 6 has its tensors in one DCP item per dtype, and its model's weights are those of
    the shared checkpoint of step 6."""
    from test_checkpoint_local import _torchrun

    from ckpt_helpers import export, show
    from hpc_train.ckpt import store
    from hpc_train.ckpt.safe import safe_torch_load
    p = _torchrun(tmp_path, 7, restarts="0", SHARED_EVERY="3")
    assert p.returncode != 0, show(p)
    item = next((tmp_path / "shm").glob("**/rank-0/step-6"))
    record = json.loads((item / "commit.json").read_text())
    assert record["layout"] == flat.LAYOUT and record["tier"] == "local", record
    meta = SafeReader(str(item)).read_metadata()
    assert sorted(meta.state_dict_metadata) == ["flat.float32"], sorted(meta.state_dict_metadata)   # Adam's step too
    skeleton = safe_torch_load(item / "rank-0.pt", None)[flat.KEY]
    buffers = flat.empty_buffers(skeleton)
    dcp.load(buffers, storage_reader=SafeReader(str(item)), planner=SafePlanner(), no_dist=True)
    model = flat.fill({k: torch.empty(m[flat.MARK][2]) for k, m in skeleton["model"].items()}, skeleton["model"],
                      buffers)
    shared = export(tmp_path / "runs" / "loop", tmp_path / "m.pt", step=6)
    assert store.inspect(tmp_path / "runs" / "loop" / "checkpoints" / "step-6").complete
    assert sorted(model) == sorted(shared)
    assert [k for k in model if not torch.equal(model[k], shared[k])] == []
