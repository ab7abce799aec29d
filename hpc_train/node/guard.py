"""Before a save: no NaN or infinite weight is ever committed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist


@torch.no_grad()
def weights_finite(state: Mapping[str, Any], kinds: Mapping[str, str], multi: bool) -> bool:
    """Whether every module's weights in ``state`` are finite on every rank. One host sync per
    save (saves are rare), agreed over ranks so that sharded models decide together."""
    params = [p for k, kind in kinds.items() if kind == "module" for p in state[k].parameters()]
    if not params:
        return True
    # FSDP parameters are DTensors: check this rank's shard (the agreement below covers the rest).
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    bad = torch.stack([p.detach().isfinite().all() for p in local]).all().logical_not().float().reshape(1)
    if multi:
        dist.all_reduce(bad)
    return bad.item() == 0
