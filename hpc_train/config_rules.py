"""Torch-free rules of the config that the CLI checks before any worker starts: Slurm's time
formats, the precision names, what a strategy can launch, the hang limits. Plain values in,
one :class:`~hpc_train.errors.UsageError` line out; :mod:`hpc_train.config` applies them."""

from __future__ import annotations

import math
import re

from hpc_train.errors import UsageError

_TIME_RE = re.compile(r"(?:([0-9]{1,6})-)?([0-9]{1,9})(?::([0-9]{1,9}))?(?::([0-9]{1,9}))?")   # ASCII digits: \d also takes "٣"
OPT_LEVELS = {"O0": "fp32", "O1": "fp16", "O2": "fp16"}   # Apex's names (hpc_train.node.precision)
STRATEGIES = ("ddp", "fsdp", "dp", "allreduce", "split", "none")   # hpc_train.node.strategies


def time_minutes(spec: str) -> int:
    """Slurm's time formats (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) in whole minutes."""
    m = _TIME_RE.fullmatch(spec.strip())
    if not m or spec.strip().upper() in ("", "UNLIMITED"):
        raise UsageError(f"job.time: {spec!r} is not a Slurm time; use MM, HH:MM:SS or D-HH:MM:SS "
                         f"(e.g. 30, 01:30:00, 2-00:00:00)")
    days, a, b, c = m.groups()
    if days is not None:            # D-HH[:MM[:SS]]
        secs = int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    elif c is not None:             # HH:MM:SS
        secs = int(a) * 3600 + int(b) * 60 + int(c)
    elif b is not None:             # MM:SS
        secs = int(a) * 60 + int(b)
    else:                           # MM
        secs = int(a) * 60
    if secs <= 0:
        raise UsageError(f"job.time: {spec!r} is zero; give a positive time limit")
    return max(1, math.ceil(secs / 60))


def resolve_precision(precision: str, opt_level: str) -> str:
    """The precision ``train.precision`` and ``train.opt_level`` name together (torch-free)."""
    if opt_level == "none":
        return precision
    mapped = OPT_LEVELS[opt_level]
    if precision != "fp32" and precision != mapped:
        raise UsageError(f"config: train.opt_level={opt_level} means train.precision={mapped}, but "
                         f"train.precision={precision} is set too; set only one of them")
    return mapped


def check_launch(strategy: str, procs_per_node: int) -> None:
    """Refuse what cannot run before any worker starts (torch-free)."""
    if strategy == "dp" and procs_per_node > 1:
        raise UsageError(
            f"config: dist.strategy=dp runs one process per node that drives all its GPUs, but {procs_per_node} "
            f"processes per node were asked for; use dist.strategy=ddp (one process per GPU: no GIL contention, "
            f"no per-step scatter/gather through GPU 0, gradients reduced while backward runs), or one process "
            f"per node (--nproc 1, job.tasks_per_node=1)")


def hang_timeout(value: str, timeout_s: float, floor_s: float) -> float | None:
    """``dist.hang_timeout_s`` as seconds, None for auto; one line when it or
    ``dist.hang_floor_s`` is invalid (see :mod:`hpc_train.node.hang`)."""
    try:
        fixed = None if str(value).strip() == "auto" else float(value)
    except ValueError:
        fixed = -1.0
    if fixed is not None and not 0 < fixed <= timeout_s:       # NaN fails this too
        raise UsageError(f"config: dist.hang_timeout_s={value!r}; valid: auto, or seconds in "
                         f"(0, dist.timeout_s={timeout_s:g}]")
    if floor_s > timeout_s:
        raise UsageError(f"config: dist.hang_floor_s={floor_s:g} is above dist.timeout_s={timeout_s:g}, "
                         f"which ends a stuck collective first; valid: 0 (auto) to {timeout_s:g}")
    return fixed


def stragglers(job, dist) -> None:
    """The straggler settings (see :mod:`hpc_train.node.straggler`): a ratio above 1, a window of
    positive seconds, and a swap only with a spare to swap in and a gathering to name a rank."""
    if dist.straggler_ratio <= 1:
        raise UsageError(f"config: dist.straggler_ratio={dist.straggler_ratio:g} names every rank; valid: above 1 "
                         f"(1.3: 30% slower than the median rank)")
    if not dist.straggler_window_s > 0:
        raise UsageError(f"config: dist.straggler_window_s={dist.straggler_window_s:g}; valid: seconds above 0 "
                         f"(300: a rank named slow for 5 minutes is swapped, with job.replace_stragglers)")
    if job.replace_stragglers and job.spare_nodes < 1:
        raise UsageError(f"config: job.replace_stragglers=true needs a spare node to swap in, but "
                         f"job.spare_nodes={job.spare_nodes}; valid: job.spare_nodes >= 1, or "
                         f"job.replace_stragglers=false")
    if job.replace_stragglers and dist.straggler_every_steps < 1:
        raise UsageError("config: job.replace_stragglers=true needs the ranks' step times, but "
                         "dist.straggler_every_steps=0 turns their gathering off; valid: dist.straggler_every_steps "
                         ">= 1, or job.replace_stragglers=false")
