"""User plug-ins for the tests, named in configs as ``tests.plugins_for_tests:NAME``.

They are what a user would write: a model builder ``f(ModelSection) -> nn.Module``, a dataset
builder ``f(DataSection, seed) -> (train, test)``, and training functions
``f(Config, NodeEnv, device) -> dict``. torch is imported inside the functions, so resolving
this module (which ``run`` does before starting workers) stays cheap.

Environment knobs (inherited by the workers from the test that starts ``run``):

``HPC_TEST_MARK_DIR``
    a builder that runs writes ``<builder>-rank<R>`` there, proving every rank used it.
``HPC_TEST_SLOW_S``
    :func:`slow_data` sleeps this long per training sample (a job slow enough to interrupt).
``HPC_TEST_FAIL_MARKER``, ``HPC_TEST_FAIL_RUN``, ``HPC_TEST_FAIL_AT_STEP``
    :func:`fail_while_marked` fails at that step in that run directory while the marker exists.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SMALL_TRAIN, SMALL_TEST = 96, 32


def _mark(what: str) -> None:
    d = os.environ.get("HPC_TEST_MARK_DIR")
    if d:
        Path(d, f"{what}-rank{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))


def tiny_model(cfg):
    """A user's own model: 784 -> 16 -> 10."""
    from torch import nn

    _mark("tiny_model")
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.ReLU(), nn.Linear(16, 10))


def fail_while_marked(cfg):
    """:func:`tiny_model`, except that its forward raises at training step ``HPC_TEST_FAIL_AT_STEP``
    while the file named by ``HPC_TEST_FAIL_MARKER`` exists, in the run directory ending with
    ``HPC_TEST_FAIL_RUN``: a task that dies mid-run for a reason outside its config (a file gone
    missing, a bad node), which resubmitting after the fix cures. One rank, no grad_accum."""
    model = tiny_model(cfg)
    marker, which = os.environ.get("HPC_TEST_FAIL_MARKER"), os.environ.get("HPC_TEST_FAIL_RUN")
    if not (marker and which):
        return model
    import hpc_train
    if not str(hpc_train.init().run_dir).endswith(which):
        return model
    at, seen = int(os.environ.get("HPC_TEST_FAIL_AT_STEP", "1")), {"n": 0}

    def hook(module, inputs):
        if module.training:
            seen["n"] += 1
            if seen["n"] >= at and Path(marker).exists():
                raise RuntimeError(f"test failure: {marker} exists")
    model.register_forward_pre_hook(hook)
    return model


def _tensors(n: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def small_data(cfg, seed: int):
    """A user's own dataset: exactly SMALL_TRAIN training and SMALL_TEST test samples."""
    from torch.utils.data import TensorDataset

    _mark("small_data")
    x, y = _tensors(SMALL_TRAIN + SMALL_TEST, seed)
    return TensorDataset(x[:SMALL_TRAIN], y[:SMALL_TRAIN]), TensorDataset(x[SMALL_TRAIN:], y[SMALL_TRAIN:])


class _Slow:
    """A map-style dataset whose every training sample costs ``delay`` seconds to load."""

    def __init__(self, x, y, delay: float) -> None:
        self.x, self.y, self.delay = x, y, delay

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        if self.delay:
            time.sleep(self.delay)
        return self.x[i], self.y[i]


def slow_data(cfg, seed: int):
    """Training samples slowed by ``HPC_TEST_SLOW_S`` (0 when unset); the test split is fast."""
    from torch.utils.data import TensorDataset

    n = cfg.synthetic_size
    x, y = _tensors(n + 32, seed)
    delay = float(os.environ.get("HPC_TEST_SLOW_S", "0"))
    return _Slow(x[:n], y[:n], delay), TensorDataset(x[n:], y[n:])


def _pid_file(cfg, env) -> None:
    Path(cfg.run_dir, f"pid-rank{env.rank}").write_text(str(os.getpid()))


def die_on_rank1(cfg, env, device):
    """Rank 1 raises; rank 0 waits for it in a collective that will never complete."""
    import torch
    import torch.distributed as dist

    _pid_file(cfg, env)
    dist.barrier()                       # both pid files exist before anyone dies
    if env.rank == 1:
        raise RuntimeError("boom from rank 1: the user's training function failed")
    t = torch.ones(1)
    dist.all_reduce(t)                   # rank 1 never joins
    time.sleep(600)
    return {"unreachable": True}


def exit_on_rank1(cfg, env, device):
    """Rank 1 vanishes with exit code 3 (no exception, no error file); rank 0 waits for it in a
    collective."""
    import torch
    import torch.distributed as dist

    _pid_file(cfg, env)
    dist.barrier()
    if env.rank == 1:
        os._exit(3)
    t = torch.ones(1)
    dist.all_reduce(t)
    time.sleep(600)
    return {"unreachable": True}


def world_report(scale):
    """For `hpc_train.submit(callable)`: runs on every task with the process group initialised."""
    import socket

    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": float(t) * scale,
            "host": socket.gethostname()}


def _stoppable(name: str, cfg):
    """The built-in model ``name`` with a test-only forward pre-hook: with
    ``HPC_TRAIN_TEST_STOP_AT_STEP="K"`` (or ``"K:M"``: after micro-batch M of step K), rank 0 sends
    a real SIGTERM to the ``run`` launcher just before the forward that makes the stop land at
    step K, and waits (<= 30 s) until the launcher's forwarded SIGTERM has reached it. The stop
    then takes the public path (launcher -> every rank -> step_end's agreement -> save) at a
    deterministic step. Weights and state-dict keys are the built-in model's."""
    import dataclasses
    import signal

    from hpc_train.trainer import models
    model = models.build(dataclasses.replace(cfg, name=name))
    spec = os.environ.get("HPC_TRAIN_TEST_STOP_AT_STEP")
    if not spec or os.environ.get("RANK") != "0":
        return model
    import hpc_train
    run = hpc_train.init()                   # the worker's Run: the trainer builds the model inside it
    accum = run.config.optim.grad_accum
    k, _, m = spec.partition(":")
    # The agreement rides on the last micro-batch's backward, so signal before that forward.
    call = (int(k) - 1) * accum + min(int(m or accum) + 1, accum)
    seen = {"n": 0}

    def hook(module, inputs):
        if not module.training:
            return
        seen["n"] += 1
        if seen["n"] == call:
            os.kill(os.getppid(), signal.SIGTERM)
            deadline = time.monotonic() + 30
            while not run.stop_requested and time.monotonic() < deadline:
                time.sleep(0.01)
    # On the first leaf module: under dist.strategy=split the model's own forward is not called
    # (its stages are), but its first layer is, once per forward, under every strategy.
    first = next(m for m in model.modules() if not any(True for _ in m.children()))
    first.register_forward_pre_hook(hook)
    return model


def stoppable_mlp(cfg):
    return _stoppable("mlp", cfg)


def stoppable_convnet(cfg):
    return _stoppable("convnet", cfg)


def loop_forever(cfg, env, device):
    """A ``train.fn`` that knows nothing of Run: it never calls step_end, so a stop must end it."""
    import torch
    import torch.distributed as dist

    _mark("loop_forever")
    while True:
        t = torch.ones(1)
        dist.all_reduce(t)
        time.sleep(0.05)


def stuck_in_collective(cfg, env, device):
    """A ``train.fn`` that knows nothing of Run, stopped while rank 1 waits in an all-reduce that
    rank 0 has not joined (rank 0 is in Python, rank 1 in gloo): the two ranks leave the code at
    different points of its sequence of collectives."""
    import torch
    import torch.distributed as dist

    _mark("stuck_in_collective")
    while True:
        if dist.get_rank() == 0:
            time.sleep(3600)
        dist.all_reduce(torch.ones(1))


def run_api_loop():
    """A callable on the public API: ``hpc_train.init()`` returns the worker's Run."""
    import json

    import torch

    import hpc_train
    run = hpc_train.init()
    info = {"same_run": hpc_train.init() is run, "world_size": run.world_size, "rank": run.rank,
            "timeout_s": run.config.dist.timeout_s, "LOCAL_RANK": os.environ["LOCAL_RANK"]}
    (run.run_dir / f"fn-info-rank{run.rank}.json").write_text(json.dumps(info))
    torch.manual_seed(0)
    model = run.wrap(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    key = "weights" if os.environ.get("HPC_TEST_STATE_KEYS") == "renamed" else "model"
    state = {key: model, "optim": opt, "step": 0}
    run.restore(state)
    total = run.config.train.max_steps or 10**9
    while state["step"] < total:
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["step"] += 1
        run.log(state["step"], loss=loss.item())
        if run.step_end(state):
            return {"stopped": state["step"]}
        time.sleep(0.01)
    return run.finish({"steps": state["step"]})


def bad_state():
    """Hands restore() a state it must refuse (HPC_TEST_BAD_STATE picks how)."""
    import threading

    import torch

    import hpc_train
    run = hpc_train.init()
    model = run.wrap(torch.nn.Linear(2, 1))
    case = os.environ["HPC_TEST_BAD_STATE"]
    if case == "no-step":
        state = {"model": model}
    elif case == "bad-object":
        state = {"model": model, "thing": threading.Lock(), "step": 0}
    else:
        state = {"model": model, "loader": torch.utils.data.DataLoader(list(range(8))), "step": 0}
    run.restore(state)


def leaves_a_thread(cfg, env, device):
    """A train.fn whose code returns while its own non-daemon thread still works (an uploader,
    say): the process must wait for it, as Python's own exit would."""
    import threading

    def upload():
        time.sleep(2.0)
        Path(cfg.run_dir, f"uploaded-rank{env.rank}").write_text("done")
    threading.Thread(target=upload).start()
    return {"ok": True}


def reports_gc(cfg, env, device):
    """A train.fn that records whether Python's cyclic collector is on while the user's code
    runs (the worker turns it off for its own start-up only)."""
    import gc
    import json
    Path(cfg.run_dir, f"gc-rank{env.rank}.json").write_text(json.dumps({"enabled": gc.isenabled()}))
    return {"ok": True}
