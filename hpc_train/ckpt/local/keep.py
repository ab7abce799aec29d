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

When: where the step's gradient averaging begins, before its all-reduce (the agreement's hook:
DDP's bucket 0, the averager's first bucket; :class:`hpc_train.node.stops.Agreement`), else at the
rank's first ``optimizer.step()`` of the step (a step pre-hook); and every rank's step waits at
that pre-hook until it holds the state of that step of the rank it keeps
(:meth:`Keeping.before_step`). So a survivor steps to S only once it holds the state of S of the
rank it keeps: a rank that dies before sending it leaves its keeper at S - 1 with the state of
S - 1, never at S without it. Sent before the all-reduce, the state has normally arrived by the
time the keeper's optimizer step asks for it: the wait is not a round trip of its own. The state then is the step's
end state in a loop that draws no random numbers and moves no loader between its last backward
and ``step_end`` (the usual order); :meth:`Keeping.after_step` checks that in the first steps and
now and then, and a loop that does otherwise sends the state again from ``step_end`` (its keeper
then trusts only those: a death between the two falls back).
Written in a codec of its own (:func:`encode`): the tensors (most of it: the generators' states)
as raw bytes, the rest as a small skeleton in ``torch.save``'s legacy format, into one of two
buffers used in turn and handed to gloo; the receive for the next state is posted as soon as one
arrives, and waited for by the training thread (a receiving Python thread would contend with
training for the interpreter's lock). The values of ``state`` that are neither modules,
optimizers nor per-rank objects (the step count, schedulers) are the keeper's own: the same on
every rank.

What falls back to the tiers' newest step (said in one line by the restart): a rank that dies
together with its keeper, a loop with no optimizer in ``state``.
The skeleton received is read with ``weights_only=True`` (plain data) and every tensor's place is
checked against the message: never an arbitrary pickle.
"""

from __future__ import annotations

import copy
import io
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hpc_train.ckpt.common import app_state, rank_state, why

log = logging.getLogger("hpc_train")
_HEADER = 24   # bytes before each state: its step, its length in bytes, its kind (three int64)
PRE, FIX, CLOSE, GROW = 0, 1, 2, 3   # before the step's optimizer.step(), again from step_end, the end, a larger size
# Every message is one buffer of this many bytes (or more, after a GROW): the receiver posts the
# next receive as soon as one arrives, so a state goes out the moment it is sent, without a
# handshake that would wait for the receiving thread to get the interpreter's lock.
_SIZE = 64 << 10
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


def take(state: Mapping[str, Any], kinds: dict[str, str], rank: int, step: int,
         part: dict[str, Any] | None = None) -> Kept:
    """This rank's own state now, on the training thread: the generators' states (fresh objects)
    and copies of the rest, which the loop may change in place from the next step on; and copies
    of the modules' buffers, which the next step's forward changes (BatchNorm's statistics)
    before its first collective can fail. ``part``: the generators' and per-rank objects' states
    this rank sent before the step's ``optimizer.step()`` (:func:`own_part`), the same (the loop's
    order; :meth:`Keeping.after_step` checks it), not taken again."""
    if part is None:
        own = rank_state(state, kinds)
        rng = own.pop("rng")
        own, app = copy.deepcopy((own, app_state(state, kinds)))
        own["rng"] = rng
    else:
        plain, app = copy.deepcopy(({k: state[k] for k, kind in kinds.items() if kind == "plain"},
                                    app_state(state, kinds)))
        own = {"rng": part["rng"], "objects": part["objects"], "plain": plain}
    buffers = {k: {n: b.detach().clone() for n, b in state[k].named_buffers()}
               for k, kind in kinds.items() if kind == "module"}
    return Kept(rank, step, own, app, {k: b for k, b in buffers.items() if b})


# A state's message body: the length of its skeleton (int64), the skeleton (the state with each
# CPU tensor replaced by a marker naming where its bytes lie, in torch.save's legacy format, which
# torch.load reads with weights_only=True and writes in a fifth of the zip format's time), then
# the tensors' bytes. Most of a state is its generators' tensors, copied as they are.
_TENSOR = "\0kept tensor"   # no key of a state_dict begins with a NUL


def _split(obj: Any, tensors: list[torch.Tensor], at: list[int]) -> Any:
    if type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.layout == torch.strided:
        t = obj.detach().contiguous()
        nbytes = t.numel() * t.element_size()
        tensors.append(t)
        at[0] += nbytes
        return {_TENSOR: [at[0] - nbytes, nbytes, str(t.dtype).removeprefix("torch."), list(t.shape)]}
    if type(obj) is dict:
        return {k: _split(v, tensors, at) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_split(v, tensors, at) for v in obj)
    return obj   # anything else as torch.save writes it


def encode(part: Any) -> tuple[bytes, list[torch.Tensor]]:
    """(the skeleton's bytes, the tensors whose bytes follow it, in order)."""
    tensors: list[torch.Tensor] = []
    skeleton = _split(part, tensors, [0])
    buf = io.BytesIO()
    torch.save(skeleton, buf, _use_new_zipfile_serialization=False)
    return buf.getvalue(), tensors


def body_size(skeleton: bytes, tensors: list[torch.Tensor]) -> int:
    """The body's bytes: its skeleton's length, the skeleton, the tensors'."""
    return 8 + len(skeleton) + sum(t.numel() * t.element_size() for t in tensors)


def write(out: torch.Tensor, skeleton: bytes, tensors: list[torch.Tensor]) -> None:
    view = out.numpy()
    view[:8].view(np.int64)[0] = len(skeleton)
    view[8:8 + len(skeleton)] = np.frombuffer(skeleton, dtype=np.uint8)
    at = 8 + len(skeleton)
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes:
            out[at:at + nbytes] = t.reshape(-1).view(torch.uint8)
        at += nbytes


def decode(body: bytes) -> Any:
    """The state a message's body holds; what does not add up raises ValueError."""
    (k,) = np.frombuffer(body[:8], dtype=np.int64).tolist() if len(body) >= 8 else (-1,)
    if not 0 <= k <= len(body) - 8:
        raise ValueError(f"a skeleton of {k} bytes in a body of {len(body)}")
    data = memoryview(body)[8 + k:]

    def fill(obj: Any) -> Any:
        if type(obj) is dict and set(obj) == {_TENSOR}:
            start, nbytes, dtype, shape = obj[_TENSOR]
            kind = getattr(torch, str(dtype), None)
            if not isinstance(kind, torch.dtype) or not 0 <= start <= start + nbytes <= len(data):
                raise ValueError(f"a tensor of {nbytes} bytes at {start} of {len(data)}, dtype {dtype}")
            raw = torch.frombuffer(bytearray(data[start:start + nbytes]), dtype=torch.uint8) if nbytes \
                else torch.empty(0, dtype=torch.uint8)
            return raw.view(kind).reshape(shape)
        if type(obj) is dict:
            return {key: fill(v) for key, v in obj.items()}
        if type(obj) in (list, tuple):
            return type(obj)(fill(v) for v in obj)
        return obj
    return fill(torch.load(io.BytesIO(body[8:8 + k]), weights_only=True))


def keeper_of(rank: int, world: int, ring: Any) -> tuple[int, int]:
    """(the rank that keeps this rank's state, the rank whose state this one keeps): along the
    local tier's ring of copies where there is one (another node), else the next rank."""
    if ring is not None:
        return ring.buddy(1), ring.source(1)
    return (rank + 1) % world, (rank - 1) % world


def own_part(state: Mapping[str, Any], kinds: dict[str, str]) -> dict[str, Any]:
    """What a rank sends: its generators' states and its per-rank objects' (copies)."""
    own = rank_state(state, kinds)
    return {"rng": own["rng"], "objects": copy.deepcopy(own["objects"])}


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
    :meth:`start`, at the first ``step_end`` on every rank (a collective). The training thread
    only, or the backward's (:meth:`send`, from DDP's hook) while the training thread waits in it."""

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
        self._out_size = self._in_size = _SIZE
        self._pg: Any = None
        self._sends: dict[int, Any] = {}   # buffer (0, 1; 2: a GROW) -> its send in flight
        self._out: list[torch.Tensor] = []   # the two send buffers, used in turn
        self._turn = 0
        self._recv: tuple[Any, torch.Tensor] | None = None   # the posted receive of the source's next state
        self._source_ended = False
        self._failed: RuntimeError | None = None   # the send's error, raised by before_step

    def start(self) -> None:
        """At every ``step_end``; the first makes the group and posts the first receive."""
        if self._pg is None and self.off is None:
            self._pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
            self._post()

    def _post(self) -> None:
        msg = torch.empty(self._in_size, dtype=torch.uint8)
        self._recv = (dist.irecv(msg, self.source, group=self._pg), msg)

    def _take_one(self) -> None:
        """Wait for the posted receive, keep what it brought, post the next (raises a peer's loss)."""
        assert self._recv is not None
        work, msg = self._recv
        self._recv = None
        work.wait()
        step, n, kind = (int(v) for v in msg[:_HEADER].view(torch.int64).tolist())
        if kind == CLOSE:
            self._source_ended = True
            return
        if kind == GROW:
            self._in_size = n
        elif not 0 <= n <= self._in_size - _HEADER:
            raise ValueError(f"rank {self.source} sent a state of {n} bytes in a message of {self._in_size}")
        else:
            self._source_fixes = self._source_fixes or kind == FIX
            self._held[step] = (kind, msg[_HEADER:_HEADER + n].numpy().tobytes())
            for old in sorted(self._held)[:-2]:
                del self._held[old]
        self._post()

    def _send(self, step: int, kind: int, part: Any) -> None:
        """One message (after a GROW when the state outgrew the size): header and body written into
        one of two buffers used in turn (the send from that buffer two messages ago has long ended)."""
        skeleton, tensors = encode(part) if part is not None else (b"", [])
        n = body_size(skeleton, tensors) if part is not None else 0
        if _HEADER + n > self._out_size:
            size = max(2 * self._out_size, 1 << (_HEADER + n - 1).bit_length())
            self._wait_sends()
            grow = torch.zeros(self._out_size, dtype=torch.uint8)
            grow[:_HEADER] = torch.tensor([step, size, GROW], dtype=torch.int64).view(torch.uint8)
            self._sends[2] = dist.isend(grow, self.keeper, group=self._pg)
            self._out_size = size
            self._out = []
        if not self._out:
            self._out = [torch.zeros(self._out_size, dtype=torch.uint8) for _ in range(2)]
        turn = self._turn
        self._turn ^= 1
        if (work := self._sends.pop(turn, None)) is not None:
            work.wait()
        out = self._out[turn]
        out.numpy()[:_HEADER].view(np.int64)[:] = (step, n, kind)
        if part is not None:
            write(out[_HEADER:], skeleton, tensors)
        self._sends[turn] = dist.isend(out, self.keeper, group=self._pg)

    def _wait_sends(self) -> None:
        for work in self._sends.values():
            work.wait()
        self._sends = {}

    def send(self, state: Mapping[str, Any], kinds: dict[str, str], step: int) -> None:
        """Where the step's gradient averaging begins, before its all-reduce (the agreement's hook,
        inside the backward): send this rank's state of ``step``. A failure is kept for
        :meth:`before_step` to raise (an exception here would surface inside DDP's hook)."""
        if self._pg is None or self.off is not None or (self._sent is not None and self._sent[0] == step):
            return
        part = own_part(state, kinds)
        try:
            self._send(step, PRE, part)
        except Exception as e:  # noqa: BLE001 - raised by before_step, on the training thread
            self.off = f"the send of step {step} to rank {self.keeper} failed ({why(e)})"
            self._failed = RuntimeError(self.off)
            self._failed.__cause__ = e
            return
        self._sent = (step, part)

    def before_step(self, state: Mapping[str, Any], kinds: dict[str, str], step: int) -> None:
        """Before this rank's ``optimizer.step()`` of ``step``: send its state unless :meth:`send`
        did, then wait until the source's state of ``step`` is here. Raises the exchange's error (a
        peer gone: the failure path then saves the step before, which every rank still holds; a
        peer frozen: the hang watch does, while this waits)."""
        self.send(state, kinds, step)
        if self._failed is not None:
            raise self._failed
        if self._pg is None or self.off is not None:
            return
        try:
            while max(self._held, default=-1) < step and not self._source_ended:
                self._take_one()
        except Exception as e:
            self.off = f"the exchange of step {step} with rank {self.keeper} and {self.source} failed ({why(e)})"
            raise RuntimeError(self.off) from e

    def sent(self, step: int) -> dict[str, Any] | None:
        """What this rank sent before ``step``'s optimizer step, while the check below holds."""
        return self._sent[1] if self._sent is not None and self._sent[0] == step and not self._fixes else None

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

    def held(self, mine: Kept) -> tuple[Kept | None, str]:
        """The source's state at ``mine.step`` as received here, with this rank's values of the
        rest (``mine``: its own, of the same step), or (None, why not). Any thread: it only reads."""
        step = mine.step
        got = dict(self._held).get(step)
        if got is None:
            return None, f"rank {self.rank} holds no state of rank {self.source} for step {step}"
        if self._source_fixes and got[0] != FIX:
            return None, f"rank {self.source}'s state of step {step} was not sent again from its step_end"
        try:
            part = decode(got[1])
            own = {"rng": part["rng"], "objects": part["objects"], "plain": mine.own.get("plain", {})}
        except Exception as e:  # noqa: BLE001 - bytes from a peer: refused, never trusted
            return None, f"rank {self.source}'s state of step {step} cannot be read ({why(e)})"
        return Kept(self.source, step, own, mine.app), ""

    def close(self, wait: bool) -> None:
        """End the exchange: after a finish or a stop (``wait``), saying so to the keeper and taking
        in the source's last messages to its word; after a failure, nothing (its peer may be gone)."""
        if self._pg is None or not wait or self.off is not None:
            self.off = self.off or "closed"
            return
        self.off = "closed"   # once: Run's close follows finish's
        try:
            self._send(-1, CLOSE, None)
            self._wait_sends()
            while not self._source_ended:
                self._take_one()
        except Exception:  # noqa: BLE001 - a peer gone at the end: nothing left to keep
            pass
