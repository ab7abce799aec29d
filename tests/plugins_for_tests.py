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
    """A map-style dataset whose every training sample costs ``delay`` seconds to load; on the rank
    named by ``HPC_TEST_CRASH_RANK`` its first sample raises (a bug in a user's data)."""

    def __init__(self, x, y, delay: float) -> None:
        self.x, self.y, self.delay = x, y, delay

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        if os.environ.get("HPC_TEST_CRASH_RANK", "-") == os.environ.get("RANK"):
            raise RuntimeError(f"slow_data: rank {os.environ['RANK']} crashes, as the test asked")
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
    deterministic step. Weights and state-dict keys are the built-in model's.

    Two more faults, each at a real point of a real run: ``HPC_TRAIN_TEST_FAIL_AT="R:K"``: rank R
    raises just before step K's forward; ``HPC_TRAIN_TEST_FREEZE_IN_SAVE=1``: rank 0 stops itself
    (SIGSTOP) inside the first save that it begins, its step directory made and no commit record
    in it, after writing ``frozen-save`` (its pid) to the run directory. K counts the steps this
    process trains (after a resume from step S, K=1 is step S+1)."""
    import dataclasses
    import signal

    from hpc_train.trainer import models
    model = models.build(dataclasses.replace(cfg, name=name))
    rank = os.environ.get("RANK")
    spec = os.environ.get("HPC_TRAIN_TEST_STOP_AT_STEP") if rank == "0" else None
    fail_rank, _, fail_at = os.environ.get("HPC_TRAIN_TEST_FAIL_AT", "").partition(":")
    fail_at = int(fail_at) if fail_at and fail_rank == rank else None
    freeze = os.environ.get("HPC_TRAIN_TEST_FREEZE_IN_SAVE") == "1" and rank == "0"
    if not (spec or fail_at or freeze):
        return model
    import hpc_train
    run = hpc_train.init()                   # the worker's Run: the trainer builds the model inside it
    accum = run.config.optim.grad_accum
    k, _, m = (spec or "0").partition(":")
    # The agreement rides on the last micro-batch's backward, so signal before that forward.
    call = (int(k) - 1) * accum + min(int(m or accum) + 1, accum) if spec else None
    seen = {"n": 0}

    def hook(module, inputs):
        if not module.training:
            return
        seen["n"] += 1
        if fail_at is not None and seen["n"] == (fail_at - 1) * accum + 1:
            raise RuntimeError(f"test failure: rank {rank} fails at its step {fail_at}")
        if seen["n"] == call:
            os.kill(os.getppid(), signal.SIGTERM)
            deadline = time.monotonic() + 30
            while not run.stop_requested and time.monotonic() < deadline:
                time.sleep(0.01)

    def freeze_in_save(module, prefix, keep_vars):
        root = Path(run.run_dir)
        steps = [d for d in (root / "checkpoints").glob("step-*") if d.name[5:].isdigit()]
        if any(not (d / "commit.json").exists() for d in steps):
            (root / "frozen-save").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
    # On the first leaf module: under dist.strategy=split the model's own forward is not called
    # (its stages are), but its first layer is, once per forward, under every strategy.
    first = next(m for m in model.modules() if not any(True for _ in m.children()))
    first.register_forward_pre_hook(hook)
    if freeze:
        first.register_state_dict_pre_hook(freeze_in_save)
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


# -- tests/guarantees/test_claims*.py: the README's claims, each through the public API ----------------------
#
# ``claims_loop`` is a user's own loop on ``hpc_train.init()`` (README "Your own training code"),
# driven by environment knobs so that one function serves several claims:
#
# ``HPC_TEST_REQUEST_STOP_AT="R:K"``
#     rank R calls ``run.request_stop()`` just before step K's forward (so the stop is agreed at
#     step K whether the agreement rides on DDP's all-reduce or not).
# ``HPC_TEST_OWN_DDP=1``
#     the loop builds its own ``DistributedDataParallel`` and hands it to ``run.watch`` instead of
#     calling ``run.wrap``.
# ``HPC_TEST_COUNT_ALLREDUCE=1``
#     each rank counts the ``torch.distributed.all_reduce`` calls made inside ``run.step_end`` and
#     writes them to ``allreduce-rank<R>.json`` in the run directory.
# ``HPC_TEST_LOADER=stateful`` (or ``stateful-gen``: with a ``generator`` of its own; ``stateful-workers``: 2 workers)
#     the data comes from torchdata's ``StatefulDataLoader`` (in ``state``) instead of ``run.loader``.
# ``HPC_TEST_SAVE_PROBE=1``
#     ``state["probe"]`` is a :class:`SaveProbe`.
# ``HPC_TEST_SIGSTOP_IN=save|load``, ``HPC_TEST_SIGSTOP_RANK=R``, ``HPC_TEST_SIGSTOP_AFTER=N``
#     ``state["freeze"]`` is a :class:`FreezeIn`: rank R stops itself (SIGSTOP) inside the named phase.


class SaveProbe:
    """A user's own state object (kind ``stateful``: rank 0 calls ``state_dict()`` inside every
    save, after the save has waited for the one before it). It checks that every older step
    directory already holds its ``commit.json`` at that moment, i.e. that no earlier save is still
    in flight, and writes what it saw to ``save-probe.json``."""

    def __init__(self, state: dict, run_dir: Path) -> None:
        self.state, self.out = state, Path(run_dir) / "save-probe.json"
        self.seen: list[dict] = []

    def state_dict(self) -> dict:
        import json
        step = self.state["step"]
        root = self.out.parent / "checkpoints"
        older = sorted(int(p.name[5:]) for p in root.glob("step-*") if p.name[5:].isdigit() and int(p.name[5:]) < step)
        pending = [s for s in older if not (root / f"step-{s}" / "commit.json").exists()]
        self.seen.append({"step": step, "older": older, "uncommitted": pending})
        self.out.write_text(json.dumps(self.seen))
        return {"checks": len(self.seen)}

    def load_state_dict(self, sd: dict) -> None:
        pass


class FreezeIn:
    """A user's own state object that freezes its process (SIGSTOP to itself, a real stopped
    rank) inside the checkpoint phase named by ``HPC_TEST_SIGSTOP_IN``: ``save`` from
    ``state_dict()`` (called by the checkpointer while it saves; rank 0 only, as for every
    ``stateful`` object), ``load`` from ``load_state_dict()`` (called while a checkpoint loads, on
    every rank). Only on rank ``HPC_TEST_SIGSTOP_RANK``, at its ``HPC_TEST_SIGSTOP_AFTER``-th call
    (default 1). Before stopping it writes ``frozen-<phase>-rank<R>`` (its pid) to the run
    directory, so the test knows the rank is frozen and in which phase."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.run_dir, self.rank = Path(run_dir), rank
        self.phase = os.environ.get("HPC_TEST_SIGSTOP_IN", "")
        self.target = int(os.environ.get("HPC_TEST_SIGSTOP_RANK", "-1"))
        self.after = int(os.environ.get("HPC_TEST_SIGSTOP_AFTER", "1"))
        self.calls = {"save": 0, "load": 0}

    def _maybe_freeze(self, phase: str) -> None:
        import signal
        self.calls[phase] += 1
        if self.phase == phase and self.rank == self.target and self.calls[phase] == self.after:
            Path(self.run_dir, f"frozen-{phase}-rank{self.rank}").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)

    def state_dict(self) -> dict:
        self._maybe_freeze("save")
        return {"calls": self.calls["save"]}

    def load_state_dict(self, sd: dict) -> None:
        self._maybe_freeze("load")


def claims_loop():
    """A user's own loop on the public API (see the knobs above); returns like ``run_api_loop``."""
    import json

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import TensorDataset

    import hpc_train
    run = hpc_train.init()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.25), nn.Linear(32, 1))
    if os.environ.get("HPC_TEST_OWN_DDP") == "1":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = run.watch(DDP(net))
    else:
        model = run.wrap(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
    if os.environ.get("HPC_TEST_LOADER", "").startswith("stateful"):
        from torch.utils.data.distributed import DistributedSampler
        from torchdata.stateful_dataloader import StatefulDataLoader
        sampler = DistributedSampler(data, num_replicas=run.world_size, rank=run.rank, shuffle=True, seed=5)
        # "stateful-gen": the loader draws its per-iter() base seed from its own generator, not
        # from torch's global RNG (which hpc_train restores, and the dropout masks come from).
        gen = torch.Generator().manual_seed(7) if os.environ["HPC_TEST_LOADER"] == "stateful-gen" else None
        workers = 2 if os.environ["HPC_TEST_LOADER"] == "stateful-workers" else 0
        loader = StatefulDataLoader(data, batch_size=8, sampler=sampler, drop_last=True, generator=gen,
                                    num_workers=workers)
    else:
        loader = run.loader(data, batch_size=8, shuffle=True)
    state = {"model": model, "optim": opt, "loader": loader, "step": 0, "epoch": 0}
    if os.environ.get("HPC_TEST_SAVE_PROBE") == "1":
        state["probe"] = SaveProbe(state, run.run_dir)
    if os.environ.get("HPC_TEST_SIGSTOP_IN"):
        state["freeze"] = FreezeIn(run.run_dir, run.rank)
    run.restore(state)
    who, _, at = os.environ.get("HPC_TEST_REQUEST_STOP_AT", "").partition(":")
    counts: list[int] = []
    count = os.environ.get("HPC_TEST_COUNT_ALLREDUCE") == "1"
    total = run.config.train.max_steps or 10**9
    loss = torch.zeros(())
    stateful = os.environ.get("HPC_TEST_LOADER", "").startswith("stateful")
    while state["step"] < total:
        if stateful:
            loader.sampler.set_epoch(state["epoch"])   # what a StatefulDataLoader user does per epoch
        for x, y in loader:
            if who and int(who) == run.rank and state["step"] + 1 == int(at):
                run.request_stop()
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            state["step"] += 1
            run.log(state["step"], loss=loss.item())
            if count:
                real, n = dist.all_reduce, [0]

                def counting(*a, **k):
                    n[0] += 1
                    return real(*a, **k)
                dist.all_reduce = counting
                try:
                    stop = run.step_end(state)
                finally:
                    dist.all_reduce = real
                counts.append(n[0])
                (run.run_dir / f"allreduce-rank{run.rank}.json").write_text(json.dumps(counts))
            else:
                stop = run.step_end(state)
            if stop:
                return {"stopped": state["step"]}
            if state["step"] >= total:
                break
        else:
            state["epoch"] += 1
    return run.finish({"steps": state["step"], "loss": loss.item()})


def slow_build_mlp(cfg):
    """The built-in MLP, built slowly: writes ``building-rank<R>`` to ``HPC_TEST_MARK_DIR``, sleeps
    ``HPC_TEST_BUILD_SLEEP_S`` (start-up that takes a while: a big model, a slow filesystem), then
    writes ``built-rank<R>`` saying whether a stop had been requested by then."""
    import dataclasses
    import json

    import hpc_train
    from hpc_train.trainer import models
    run = hpc_train.init()
    _mark("building")
    time.sleep(float(os.environ.get("HPC_TEST_BUILD_SLEEP_S", "0")))
    d = os.environ.get("HPC_TEST_MARK_DIR")
    if d:
        Path(d, f"built-rank{run.rank}").write_text(json.dumps({"stop_requested": run.stop_requested}))
    return models.build(dataclasses.replace(cfg, name="mlp"))


def threads_report(cfg, env, device):
    """What this rank trains with: ``OMP_NUM_THREADS`` and torch's intra-op threads, written to
    ``RUN_DIR/threads-rank<R>.json``."""
    import json

    import torch
    Path(cfg.resolved_run_dir(), f"threads-rank{env.rank}.json").write_text(
        json.dumps({"omp": os.environ.get("OMP_NUM_THREADS"), "torch": torch.get_num_threads()}))
    return {}


class SlowSave:
    """A user's state object whose ``state_dict()`` takes ``HPC_TEST_SLOW_SAVE_S`` seconds: a slow
    checkpoint save (rank 0 calls it inside every save)."""

    def state_dict(self) -> dict:
        time.sleep(float(os.environ.get("HPC_TEST_SLOW_SAVE_S", "0")))
        return {"slow": 1}

    def load_state_dict(self, sd: dict) -> None:
        pass


def uneven_steps():
    """A loop on the public API whose steps are not all alike (issue 32's false alarms): ~10 ms
    steps; every 100th a 20x longer one (an evaluation nobody marked); a slow save
    (:class:`SlowSave`); after a restore, a first step of ``HPC_TEST_FIRST_STEP_S``; at step
    ``HPC_TEST_UNMARKED_AT`` an unmarked pause of ``HPC_TEST_PAUSE_S``, and at
    ``HPC_TEST_MARKED_AT`` the same pause inside ``run.long_phase()``."""
    import torch

    import hpc_train
    run = hpc_train.init()
    torch.manual_seed(0)
    model = run.wrap(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model, "optim": opt, "slow": SlowSave(), "step": 0}
    resumed = run.restore(state) > 0
    knob = {k: int(os.environ.get(f"HPC_TEST_{k}", "-1")) for k in ("UNMARKED_AT", "MARKED_AT")}
    pause = float(os.environ.get("HPC_TEST_PAUSE_S", "0"))
    while state["step"] < run.config.train.max_steps:
        if resumed:
            time.sleep(float(os.environ.get("HPC_TEST_FIRST_STEP_S", "0")))
            resumed = False
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.2 if state["step"] % 100 == 99 else 0.01)
        state["step"] += 1
        if state["step"] == knob["UNMARKED_AT"]:
            time.sleep(pause)
        if state["step"] == knob["MARKED_AT"]:
            with run.long_phase("evaluation"):
                time.sleep(pause)
        if run.step_end(state):
            return {"stopped": state["step"]}
    return run.finish({"steps": state["step"]})
