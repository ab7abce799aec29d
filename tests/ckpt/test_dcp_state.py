"""The state as DCP sees it (hpc_train.ckpt.common.dcp_state), which both tiers save and load
through, and the RNG states every rank file holds. A module and its one optimizer are read with
one get_state_dict call (its parameter-name mapping built once, not twice, on the training
thread): the result must be exactly what the separate calls give, whatever the optimizer's
state; a module with two optimizers keeps the separate calls. Python's RNG state, now stored as
one tensor, restores exactly, and a rank file written with it as a list still does."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from hpc_train.ckpt.common import dcp_state
from hpc_train.ckpt.state import rng_state, set_rng_state


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _train(model: nn.Module, optimizers: list[torch.optim.Optimizer], steps: int) -> None:
    for _ in range(steps):
        for o in optimizers:
            o.zero_grad()
        model(torch.randn(16, 4)).square().mean().backward()
        for o in optimizers:
            o.step()


def _same(a, b, where: str = "") -> None:
    """Equal in structure, in plain values, and bitwise in every tensor (dtype and shape too)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a, b.view(-1).view(torch.uint8)
                           if b.numel() else b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (where, list(a), list(b))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}.{i}")
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("make, steps", [
    (lambda ps: torch.optim.Adam(ps, lr=1e-3), 3),
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1), 0),    # no state yet: DCP makes it
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 2),
    (lambda ps: torch.optim.SGD([{"params": ps[:2], "lr": 0.5}, {"params": ps[2:]}], lr=0.1, momentum=0.9), 2),
], ids=["adam", "adamw-fresh", "sgd-momentum", "two-groups"])
def test_one_call_gives_what_the_separate_calls_give(make, steps):
    model = _model()
    opt = make(list(model.parameters()))
    _train(model, [opt], steps)
    got = dcp_state({"model": model, "optimizer": opt, "step": 3},
                    {"model": "module", "optimizer": "optimizer", "step": "plain"})
    assert list(got) == ["model", "optimizer"]
    _same(got["model"], get_model_state_dict(model), "model")
    _same(got["optimizer"], get_optimizer_state_dict(model, opt), "optimizer")


def test_a_module_with_two_optimizers_and_the_kinds_order():
    model = _model()
    params = list(model.parameters())
    first, second = torch.optim.Adam(params[:2], lr=1e-3), torch.optim.SGD(params[2:], lr=0.1, momentum=0.9)
    _train(model, [first, second], 2)
    state = {"opt_b": second, "model": model, "opt_a": first}
    got = dcp_state(state, {"opt_b": "optimizer", "model": "module", "opt_a": "optimizer"})
    assert list(got) == ["opt_b", "model", "opt_a"]     # the caller's order, as before
    _same(got["model"], get_model_state_dict(model), "model")
    _same(got["opt_a"], get_optimizer_state_dict(model, first), "opt_a")
    _same(got["opt_b"], get_optimizer_state_dict(model, second), "opt_b")


def test_python_rng_state_restores_exactly_from_either_form():
    random.seed(1234)
    random.random()
    saved = rng_state()
    assert isinstance(saved["python"][1], torch.Tensor) and saved["python"][1].numel() == 625
    want = [random.random() for _ in range(5)]
    set_rng_state(saved)
    assert [random.random() for _ in range(5)] == want
    old = dict(saved, python=[saved["python"][0], saved["python"][1].tolist(), saved["python"][2]])
    set_rng_state(old)          # a rank file written when the words were a list
    assert [random.random() for _ in range(5)] == want
