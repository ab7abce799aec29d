"""What a checkpoint holds, seen as a mapping of state objects.

A user hands :meth:`hpc_train.run.Run.restore` / :meth:`~hpc_train.run.Run.step_end` a dict such as
``{"model": model, "optim": optimizer, "sched": scheduler, "loader": loader, "step": 0}``.
Each value is one of four kinds, and the kind decides where it is stored:

``module`` / ``optimizer``
    sharded through DCP (``get_model_state_dict`` / ``get_optimizer_state_dict``), so DDP and
    FSDP-wrapped models save one copy and reshard to another world size.
``per_rank``
    differs from rank to rank: data loaders (their position). Stored in ``rank-R.pt``, with
    this rank's RNG states, which are always saved.
``stateful``
    anything else with ``state_dict()``/``load_state_dict()`` (schedulers, ``GradScaler``,
    the user's own objects): assumed the same on every rank; rank 0's copy goes to ``app.pt``.
``plain``
    numbers, strings, bools, ``None``, tensors, and lists/tuples/dicts of them. They may differ
    from rank to rank: each rank's own are stored in its ``rank-R.pt`` (rank 0's also in
    ``app.pt``), and on restore the dict entry is *replaced* (an ``int`` cannot be updated in
    place). At the same world size every rank gets back its own value. At another world size
    every rank gets rank 0's: exact for a value that was the same on every rank (``step``, an
    epoch, an agreed metric); a value that differed across ranks when saved (``commit.json``
    lists it under ``differs_by_rank``) is named in a warning.

Keys are strings (they name files' entries and ``commit.json`` fields); any other key is
refused by :func:`kinds`, so by ``restore()``, before anything trains.

Files other than DCP's are read with ``torch.load(weights_only=True)``, which never runs
arbitrary code; that is why RNG states are converted to plain types here.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from hpc_train.errors import UsageError

PLAIN_SCALARS = (int, float, bool, str, bytes, type(None))


def kind_of(key: str, value: Any) -> str:
    """The storage kind of ``state[key]`` (see the module docstring); a clear error otherwise."""
    if isinstance(value, nn.Module):
        return "module"
    if isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(value, torch.utils.data.DataLoader):
        if not (hasattr(value, "state_dict") and hasattr(value, "load_state_dict")):
            raise UsageError(f"state[{key!r}] is a {type(value).__name__}, which cannot save its position "
                             f"(no state_dict()); use run.loader(dataset, batch_size) or torchdata's "
                             f"StatefulDataLoader, or leave the loader out of state")
        return "per_rank"
    if getattr(value, "hpc_train_per_rank", False):   # hpc_train.node.loader.ShardedLoader
        return "per_rank"
    if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
        return "stateful"
    if is_plain(value):
        return "plain"
    raise UsageError(f"state[{key!r}] is a {type(value).__module__}.{type(value).__qualname__}, which cannot be "
                     f"checkpointed: give objects with state_dict()/load_state_dict() (models, optimizers, "
                     f"schedulers, loaders) or plain data (numbers, strings, tensors, lists and dicts of them)")


def is_plain(value: Any) -> bool:
    if isinstance(value, PLAIN_SCALARS) or isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_plain(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, (str, int)) and is_plain(v) for k, v in value.items())
    return False


def kinds_of(state: Mapping[str, Any]) -> dict[str, str]:
    """Every entry's kind; checks that ``step`` is there and is an integer."""
    if not isinstance(state, Mapping):
        raise UsageError(f"state must be a dict of state objects, got {type(state).__name__}")
    if "step" not in state:
        raise UsageError("state has no 'step' entry: add state['step'] = 0 (the number of optimizer steps done), "
                         "and increase it by one after every optimizer step")
    if isinstance(state["step"], bool) or not isinstance(state["step"], int):
        raise UsageError(f"state['step'] must be an int (optimizer steps done), got {type(state['step']).__name__}")
    for k in state:
        if not isinstance(k, str):
            raise UsageError(f"state key {k!r} is not a string ({type(k).__name__}); name every state entry with a "
                             f"string, e.g. state[{str(k)!r}]")
    return {k: kind_of(k, v) for k, v in state.items()}


# -- per-rank RNG ----------------------------------------------------------------------------
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU, CUDA) in plain types."""
    py = random.getstate()
    npst = np.random.get_state()
    out: dict[str, Any] = {
        # The Mersenne Twister's 625 words as one tensor: as a list, each is an object the
        # rank file's pickler visits (a few hundred microseconds of every save's writer).
        "python": [py[0], torch.from_numpy(np.array(py[1], dtype=np.int64)), py[2]],   # faster than torch.tensor
        "numpy": [npst[0], torch.from_numpy(np.asarray(npst[1]).astype(np.int64)), int(npst[2]), int(npst[3]),
                  float(npst[4])],
        "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = list(torch.cuda.get_rng_state_all())
    return out


def set_rng_state(st: dict[str, Any]) -> None:
    py, n = st["python"], st["numpy"]
    words = py[1].tolist() if isinstance(py[1], torch.Tensor) else py[1]   # a list before the tensor
    random.setstate((py[0], tuple(words), py[2]))
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])
