"""Two real gloo processes: the same model trained under DDP with the stop agreement's comm hook
(``hpc_train.node.stops.Agreement.attach``, what ``run.wrap``/``run.watch`` do) and under plain DDP
(its built-in all-reduce), from the same initial weights on the same per-rank data. Each rank
writes whether the two state dicts are bitwise equal, and what the agreement summed, to
``OUT/rank-R.json``, for two models (below). Used by tests/guarantees/test_claims.py:
``python tests/scripts/ddp_agreement_probe.py OUT``.

Each rank also writes, after each hooked step, the ids of its interpreter's thread states and
its count of Python threads: the hook's callbacks run on gloo's work thread, which must keep one
thread state rather than make one per callback (``stops._keep_thread_state``: a fork while one is
made leaves the child hung).

``small``: bucket 0 is under 1 MiB, so the agreement's values ride inside its all-reduce (the
hook concatenates them to the gradients). ``big``: one parameter over 1 MiB fills bucket 0, so
the values get a small all-reduce of their own beside it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 6


def _net(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "big":   # the last layer (bucket 0 holds the last parameters) is 2 MiB
        return nn.Sequential(nn.Linear(16, 1024), nn.ReLU(), nn.Linear(1024, 512))
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10))


def _thread_states() -> list[int]:
    """The ids of this interpreter's thread states, by the C API's walk (read between steps,
    when no callback runs)."""
    import ctypes
    api = ctypes.pythonapi
    api.PyInterpreterState_Get.restype = ctypes.c_void_p
    api.PyInterpreterState_ThreadHead.restype = api.PyThreadState_Next.restype = ctypes.c_void_p
    api.PyInterpreterState_ThreadHead.argtypes = api.PyThreadState_Next.argtypes = [ctypes.c_void_p]
    api.PyThreadState_GetID.restype, api.PyThreadState_GetID.argtypes = ctypes.c_uint64, [ctypes.c_void_p]
    ids, state = [], api.PyInterpreterState_ThreadHead(api.PyInterpreterState_Get())
    while state:
        ids.append(api.PyThreadState_GetID(state))
        state = api.PyThreadState_Next(state)
    return sorted(ids)


def _train(model: nn.Module, rank: int, agreement=None, states=None) -> tuple[list[list[float]], list[bool]]:
    import threading
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)      # each rank its own data: averaging matters
    sums, carried = [], []
    for step in range(STEPS):
        x = torch.randn(8, 16, generator=g)
        if agreement is not None:
            agreement.stage(torch.tensor([float(rank + 1), float(step)]))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if agreement is not None:
            # (work, values) set by the hook during backward; no work: the values rode in bucket 0.
            carried.append(agreement._inflight is not None and agreement._inflight[0] is None)
            sums.append(agreement.collect(torch.device("cpu")).tolist())
        if states is not None:
            states.append((_thread_states(), threading.active_count()))
    return sums, carried


def _worker(rank: int, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    report = {kind: _compare(kind, rank) for kind in ("small", "big")}
    Path(out, f"rank-{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _compare(kind: str, rank: int) -> dict:
    from hpc_train.node.stops import Agreement

    hooked = DDP(_net(kind))
    agreement = Agreement(True, lambda: [0.0, 0.0])
    agreement.attach(hooked)
    plain = DDP(_net(kind))
    init_equal = all(torch.equal(a, b) for a, b in zip(hooked.state_dict().values(), plain.state_dict().values()))
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    states: list = []
    sums, carried = _train(hooked, rank, agreement, states)
    _train(plain, rank)
    a, b = hooked.module.state_dict(), plain.module.state_dict()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    changed = [k for k, v in plain.state_dict().items() if not torch.equal(v, before[k])]
    return {"hooked": agreement.hooked, "init_equal": init_equal, "differ": differ, "keys": sorted(a),
            "changed_by_training": changed, "sums": sums, "carried": carried,
            "states": states}


def main() -> None:
    out = sys.argv[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(out, port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
