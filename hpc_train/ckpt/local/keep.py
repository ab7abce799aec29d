"""Each rank's own state, kept at a peer every step: what a survivor needs to save a dead rank's step.

Under a replicated strategy (DDP, gradient averaging, DataParallel, one process per node) every
rank holds the model and the optimizer as they are at the last ``step_end``, until its next
``optimizer.step()``: the step's first collective (the gradient all-reduce) comes before it, so a
survivor whose collective fails because a peer died still holds them, exactly
(:meth:`hpc_train.ckpt.local.tier.LocalTier.save_at_failure` writes them then). What a survivor
does not hold is the dead rank's own state: its random generators (a loop that seeds each rank
itself), its loader's position, its per-rank objects. So each rank sends that, a few KB, to its
*keeper*: the same local rank on the next node where the local tier's copies go
(:class:`hpc_train.ckpt.local.peer.Ring`), which survives the rank's node; on one node, the next
rank, which survives the rank's process.

When: at the rank's first ``optimizer.step()`` of a step (a step pre-hook), once the gradients
are averaged and before any rank can have stepped; and every rank's step waits until it holds the
state of that step of the rank it keeps (:meth:`Keeping.before_step`). So a survivor
steps to S only once it holds the state of S of the rank it keeps: a rank that dies before
sending it leaves its keeper at S - 1 with the state of S - 1, never at S without it. The state
then is the step's end state in a loop that draws no random numbers and moves no loader between
its ``optimizer.step()`` and ``step_end`` (the usual order); :meth:`Keeping.after_step` checks
that in the first steps and now and then, and a loop that does otherwise sends the state again
from ``step_end`` (its keeper then trusts only those: a death between the two falls back).
Pickled on the training thread and handed to gloo's own thread; a thread of this module
receives, over a gloo group of its own. The values of ``state`` that are neither modules,
optimizers nor per-rank objects (the step count, schedulers) are the keeper's own: the same on
every rank.

What falls back to the tiers' newest step (said in one line by the restart): a rank that dies
together with its keeper, a loop with no optimizer in ``state``.
The bytes received are read with ``weights_only=True`` (plain data, tensors): never an arbitrary
pickle.
"""

from __future__ import annotations

import copy
import io
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hpc_train.ckpt.common import app_state, plain_of, rank_state, why
from hpc_train.ckpt.state import rng_state

log = logging.getLogger("hpc_train")
_HEADER = 3   # int64s before each state: its step, its length in bytes, its kind
PRE, FIX, CLOSE = 0, 1, 2   # sent before the step's optimizer.step(), again from step_end, the end
_CHECK_FIRST, _CHECK_EVERY = 8, 64   # after_step's checks: the first steps, then one in so many
# How long a survivor's save at a failure may take before the process exits as it would without
# it: it runs between the peer's death and the launcher's SIGKILL (srun's KillWait, 30 s by
# Slurm's default and 10 s on the dev cluster; the local launcher's grace, 10 s; torchrun's, 30 s).
SAVE_LIMIT_S = 5.0


@dataclass(frozen=True)
class Kept:
    """One rank's own state at the end of ``step``: (rank-R.pt's, app.pt's) contents as a local
    item holds them, without the modules' and optimizers' skeleton (the saver adds its own)."""
    rank: int
    step: int
    own: dict[str, Any]
    app: dict[str, Any]
    buffers: dict[str, dict[str, torch.Tensor]] | None = None   # the modules' buffers then (not sent)


def take(state: Mapping[str, Any], kinds: dict[str, str], rank: int, step: int) -> Kept:
    """This rank's own state now, on the training thread: the generators' states (fresh objects)
    and copies of the rest, which the loop may change in place from the next step on; and copies
    of the modules' buffers, which the next step's forward changes (BatchNorm's statistics)
    before its first collective can fail."""
    own = rank_state(state, kinds)
    rng = own.pop("rng")
    own, app = copy.deepcopy((own, app_state(state, kinds)))
    own["rng"] = rng
    buffers = {k: {n: b.detach().clone() for n, b in state[k].named_buffers()}
               for k, kind in kinds.items() if kind == "module"}
    return Kept(rank, step, own, app, {k: b for k, b in buffers.items() if b})


def keeper_of(rank: int, world: int, ring: Any) -> tuple[int, int]:
    """(the rank that keeps this rank's state, the rank whose state this one keeps): along the
    local tier's ring of copies where there is one (another node), else the next rank."""
    if ring is not None:
        return ring.buddy(1), ring.source(1)
    return (rank + 1) % world, (rank - 1) % world


def own_part(state: Mapping[str, Any], kinds: dict[str, str]) -> dict[str, Any]:
    """What a rank sends: its generators' states and its per-rank objects' (copies)."""
    return {"rng": rng_state(),
            "objects": copy.deepcopy({k: plain_of(k, state[k]) for k, kind in kinds.items() if kind == "per_rank"})}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


class Keeping:
    """One rank's side: its newest own state (:class:`Kept`, for its own save at a failure), and
    the newest states received from the rank it keeps. The group is made at the first
    :meth:`start`, at the first ``step_end`` on every rank (a collective)."""

    def __init__(self, rank: int, world: int, ring: Any, timeout_s: float) -> None:
        self.rank = rank
        self.keeper, self.source = keeper_of(rank, world, ring)
        self.timeout_s = timeout_s
        self.mine: Kept | None = None
        self.off: str | None = None
        self._held: dict[int, tuple[int, bytes]] = {}   # step -> (kind, bytes) of the source's newest two
        self._source_fixes = False     # the source sent a state again from step_end: trust only those
        self._sent: tuple[int, dict[str, Any]] | None = None   # what this rank sent before its last step
        self._fixes = False
        self._pg: Any = None
        self._sends: list[Any] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """At every ``step_end``; the first makes the group and the receiving thread."""
        if self._pg is None and self.off is None:
            self._pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
            self._thread = threading.Thread(target=self._loop, name="hpc_train-keep", daemon=True)
            self._thread.start()

    def _send(self, step: int, kind: int, part: Any) -> None:
        for s in self._sends:
            s.wait()
        data = torch.empty(0, dtype=torch.uint8)
        if part is not None:
            buf = io.BytesIO()
            torch.save(part, buf)
            data = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
        head = torch.tensor([step, data.numel(), kind], dtype=torch.int64)
        self._sends = [dist.isend(head, self.keeper, group=self._pg)]
        if data.numel():
            self._sends.append(dist.isend(data, self.keeper, group=self._pg))

    def before_step(self, state: Mapping[str, Any], kinds: dict[str, str], step: int) -> None:
        """Before this rank's ``optimizer.step()`` of ``step``: send its state, then wait until the
        source's state of ``step`` is here. Raises the exchange's error (a peer gone: the failure
        path then saves the step before, which every rank still holds)."""
        if self._pg is None or self.off is not None:
            return
        part = own_part(state, kinds)
        try:
            self._send(step, PRE, part)
        except Exception as e:  # noqa: BLE001 - a peer gone
            self.off = f"the send of step {step} failed ({why(e)})"
            raise RuntimeError(self.off) from e
        self._sent = (step, part)
        with self._cond:
            if not self._cond.wait_for(lambda: self.off is not None or max(self._held, default=-1) >= step,
                                       self.timeout_s):
                raise RuntimeError(f"timed out waiting for rank {self.source}'s own state of step {step}")
            if self.off is not None and max(self._held, default=-1) < step:
                raise RuntimeError(self.off)

    def after_step(self, state: Mapping[str, Any], kinds: dict[str, str], step: int) -> None:
        """At ``step_end``: in the first steps and now and then, check that the state sent before
        the step's ``optimizer.step()`` is its state now; if not, send it from here from now on."""
        if self._pg is None or self.off is not None or self._sent is None or self._sent[0] != step:
            return
        if not self._fixes and step > _CHECK_FIRST and step % _CHECK_EVERY:
            return
        part = own_part(state, kinds)
        if not self._fixes and _same(part, self._sent[1]):
            return
        if not self._fixes:
            self._fixes = True
            log.warning("this loop draws random numbers or moves a per-rank object after optimizer.step() and "
                        "before step_end: each rank's own state is sent again from step_end, and a rank that "
                        "dies between the two costs the steps since the tiers' newest save")
        try:
            self._send(step, FIX, part)
        except Exception as e:  # noqa: BLE001 - a peer gone: said where it fails
            self.off = f"the send of step {step} failed ({why(e)})"

    def _loop(self) -> None:
        """The receiving side: the source's states, until it says it ended."""
        while True:
            try:
                head = torch.empty(_HEADER, dtype=torch.int64)
                dist.irecv(head, self.source, group=self._pg).wait()
                step, n, kind = (int(v) for v in head.tolist())
                if kind == CLOSE:
                    return
                got = torch.empty(n, dtype=torch.uint8)
                dist.irecv(got, self.source, group=self._pg).wait()
            except Exception as e:  # noqa: BLE001 - a peer gone: the failure is the run's, said there
                with self._cond:
                    self.off = f"the exchange with rank {self.source} failed ({why(e)})"
                    self._cond.notify_all()
                return
            with self._cond:
                self._source_fixes = self._source_fixes or kind == FIX
                self._held[step] = (kind, got.numpy().tobytes())
                for old in sorted(self._held)[:-2]:
                    del self._held[old]
                self._cond.notify_all()

    def held(self, mine: Kept) -> tuple[Kept | None, str]:
        """The source's state at ``mine.step`` as received here, with this rank's values of the
        rest (``mine``: its own, of the same step), or (None, why not)."""
        step = mine.step
        with self._cond:
            got = self._held.get(step)
            fixes = self._source_fixes
        if got is None:
            return None, f"rank {self.rank} holds no state of rank {self.source} for step {step}"
        if fixes and got[0] != FIX:
            return None, f"rank {self.source}'s state of step {step} was not sent again from its step_end"
        try:
            part = torch.load(io.BytesIO(got[1]), weights_only=True)
            own = {"rng": part["rng"], "objects": part["objects"], "plain": mine.own.get("plain", {})}
        except Exception as e:  # noqa: BLE001 - bytes from a peer: refused, never trusted
            return None, f"rank {self.source}'s state of step {step} cannot be read ({why(e)})"
        return Kept(self.source, step, own, mine.app), ""

    def close(self, wait: bool) -> None:
        """End the exchange: after a finish or a stop (``wait``), saying so to the keeper and
        waiting for the source's word; after a failure at once."""
        if self._thread is None:
            return
        if wait and self.off is None:
            try:
                self._send(-1, CLOSE, None)
                for s in self._sends:
                    s.wait()
            except Exception:  # noqa: BLE001 - a peer gone at the end: nothing left to keep
                pass
            self._thread.join(self.timeout_s)
        self._thread = None
