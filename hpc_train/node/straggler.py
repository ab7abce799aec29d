"""Stragglers: each rank's own step time, gathered every ``dist.straggler_every_steps`` steps,
and the slow rank named on rank 0. No Slurm here; torch only for the one collective.

A rank's *own* time is what it spends before it can hand its gradients over: from the end of
its previous ``step_end`` to the moment its step's last gradient bucket enters DDP's all-reduce
(the agreement's comm hook on bucket 0, :mod:`hpc_train.node.stops`). The wall time of a step is
the same on every rank (they wait for each other), so it cannot tell which rank is slow; the own
time can. Without a watched DDP module (another strategy, a loop of its own) it is the time to
``step_end``, which includes any collective of the loop's own (say so when naming a rank).

Every N steps every rank contributes its mean own time over those steps to one all-gather of
``world_size`` float32 values (4 bytes a rank: 16 KiB at 4096 ranks, every 50 steps). Rank 0 keeps
the last :data:`~hpc_train.node.liveness.STRAGGLER_GATHERINGS` gatherings; a rank whose own time was
at least ``dist.straggler_ratio`` times the median of the other ranks' in each of them is named
once, in one line (rank, node, how much slower, since which step), until it recovers.
``metrics.jsonl`` and TensorBoard get the spread (median, max, the slowest rank) at every gathering.

Replacing it (``job.replace_stragglers``): once rank 0 has named a rank for
``dist.straggler_window_s`` without a break, it asks for a stop (:meth:`StopRequest.straggler
<hpc_train.node.stops.StopRequest.straggler>`): the agreement carries it to every rank at the
next step boundary, all save and exit together, as on a preemption, and the batch shell's hook
restarts the step in place with a spare in the slow node's place
(:func:`hpc_train.login.decide.decide`). Only under hpc_train's batch script (its hook decides),
with checkpoints on (the restart resumes from the stop's), and with a node of the allocation
outside this step (a spare): else the rank is named, never swapped. A process asks once; the next
step must name a rank for a whole window again, so there is at most one swap per window.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections import deque
from pathlib import Path

from hpc_train.node.liveness import STRAGGLER_GATHERINGS

log = logging.getLogger("hpc_train")


class Stragglers:
    def __init__(self, every: int, ratio: float, rank: int, world_size: int, multi: bool, run_dir: Path,
                 window_s: float = 300.0, replace: bool = False) -> None:
        self.every, self.ratio, self.rank, self.world = every, ratio, rank, world_size
        self.window_s, self.replace = window_s, replace and rank == 0
        self.named_at: dict[int, float] = {}   # rank -> when it was named (monotonic; rank 0)
        self.asked: tuple[int, str] | None = None   # the swap this process asked for (rank, node)
        self.on = multi and every > 0
        self.run_dir = Path(run_dir)
        self.started = time.monotonic()     # this step's start: the previous step_end's return
        self.entered: float | None = None   # the step's last gradient bucket entered the all-reduce
        self.hooked = False                 # entered is set by a DDP comm hook (own time exact)
        self._own, self._n = 0.0, 0
        self._history: deque[list[float]] = deque(maxlen=STRAGGLER_GATHERINGS)
        self.named: dict[int, int] = {}     # rank -> the step since which it is slow (rank 0)
        self.last: dict[str, float] | None = None

    def enter(self) -> None:
        """The step's last bucket goes to the all-reduce (called from the comm hook)."""
        self.entered, self.hooked = time.monotonic(), True

    def arrived(self) -> None:
        """``step_end`` was reached: this step's own time is known."""
        if not self.on:
            return
        now = time.monotonic()
        end = self.entered if self.entered is not None and self.entered >= self.started else now
        self._own += end - self.started
        self._n += 1
        self.entered = None

    @classmethod
    def of(cls, d, replace_stragglers: bool, checkpoints: bool, env, multi: bool, run_dir: Path) -> Stragglers:
        """The run's watch (``d``: the dist section), with the swap on where
        ``job.replace_stragglers`` can work here (``checkpoints``: checkpoint.enabled)."""
        why = swap_refusal(os.environ, checkpoints) if replace_stragglers and multi else None
        if why and env.rank == 0 and d.straggler_every_steps > 0:
            log.warning("straggler: job.replace_stragglers is on, but %s: a slow rank is named, not swapped", why)
        return cls(d.straggler_every_steps, d.straggler_ratio, env.rank, env.world_size, multi, run_dir,
                   d.straggler_window_s, replace_stragglers and why is None)

    def left(self, step: int, device, stop=None) -> dict[str, float] | None:
        """``step_end`` returns: the next step starts now. Every N steps, the gathering (every
        rank); on rank 0 its spread, for the metrics; None otherwise. Rank 0 asks ``stop`` (the
        process's StopRequest) for a swap once a rank was named for the window."""
        out = None
        if self.on and step % self.every == 0 and self._n:
            out = self._gather(step, device)
            self._own, self._n = 0.0, 0
            due = self._due() if self.replace and self.asked is None and stop is not None else None
            if due is not None and not stop.requested:
                self.asked = due
                log.warning("straggler: rank %d on %s named slow for %.0f s (dist.straggler_window_s=%g): saving at "
                            "the next step and ending this job step, to swap %s for a spare", due[0], due[1],
                            time.monotonic() - self.named_at[due[0]], self.window_s, due[1])
                stop.straggler(*due)
        self.started = time.monotonic()
        return out

    def _gather(self, step: int, device) -> dict[str, float] | None:
        import torch
        import torch.distributed as dist
        mine = torch.tensor([self._own / self._n], dtype=torch.float32, device=device)
        every = torch.empty(self.world, dtype=torch.float32, device=device)
        dist.all_gather_single(every, mine)   # all_gather_into_tensor is deprecated
        if self.rank != 0:
            return None
        times = every.cpu().tolist()
        self._history.append(times)
        median = statistics.median(times)
        slowest = max(range(self.world), key=times.__getitem__)
        self.last = {"straggler_median_s": median, "straggler_max_s": times[slowest],
                     "straggler_slowest_rank": float(slowest)}
        self._name(step, median)
        return self.last

    def _name(self, step: int, median: float) -> None:
        if len(self._history) < STRAGGLER_GATHERINGS or median <= 0:
            return
        for r in range(self.world):
            ratios = [_ratio(h, r) for h in self._history]
            slow = min(ratios) >= self.ratio
            if slow and r not in self.named:
                self.named[r] = step - self.every * (STRAGGLER_GATHERINGS - 1)
                self.named_at[r] = time.monotonic()
                how = "" if self.hooked else " (to step_end: no DDP module is watched, so the loop's own collectives count too)"
                log.warning("straggler: rank %d on %s is %.1fx slower than the median of the other ranks (own step "
                            "time %.1f ms against %.1f ms%s) since step %d", r, _node(self.run_dir, r),
                            sum(ratios) / len(ratios), 1000 * self._history[-1][r],
                            1000 * self._history[-1][r] / ratios[-1], how, self.named[r])
            elif not slow and r in self.named and max(ratios) < self.ratio:
                del self.named[r]
                self.named_at.pop(r, None)
                log.info("straggler: rank %d on %s is back within %.1fx of the others at step %d", r,
                         _node(self.run_dir, r), self.ratio, step)

    def _due(self) -> tuple[int, str] | None:
        """(rank, node) of the slowest rank named for the whole window, if its node is known."""
        now, last = time.monotonic(), self._history[-1] if self._history else None
        due = [r for r, t in self.named_at.items() if now - t >= self.window_s]
        if not due or last is None:
            return None
        r = max(due, key=lambda x: _ratio(last, x))
        node = _node(self.run_dir, r)
        return None if node == "unknown host" else (r, node)


def swap_refusal(env, checkpoints: bool) -> str | None:
    """Why a slow rank's node cannot be swapped from this job step (None: it can): the batch
    shell's hook does the swap, the restart resumes from the stop's checkpoint, and the spare is
    a node of the allocation outside this step (``SLURM_JOB_NODELIST`` less ``SLURM_STEP_NODELIST``)."""
    from hpc_train import rundir
    from hpc_train.errors import UsageError
    from hpc_train.nodelist import expand
    if not checkpoints:
        return "checkpoints are off (the restart would have nothing to resume from)"
    if not env.get(rundir.ATTEMPT_ENV):
        return "this is not a job step of hpc_train's batch script (its hook makes the swap)"
    try:
        spare = set(expand(env.get("SLURM_JOB_NODELIST", ""))) - set(expand(env.get("SLURM_STEP_NODELIST", "")))
    except UsageError:
        spare = set()
    return None if spare else "no node of the allocation is left outside this job step to swap in"


def _ratio(times: list[float], r: int) -> float:
    """Rank ``r``'s own time over the median of the other ranks' (with 2 ranks, the other's: a
    median over all would halve the gap)."""
    others = statistics.median(times[:r] + times[r + 1:])
    return times[r] / others if others > 0 else 1.0


def _node(run_dir: Path, rank: int) -> str:
    from hpc_train.node.watchdog import holder
    return holder(run_dir, rank)[0]
