"""Stop requests: signal handlers that only record, and an agreement at each step boundary.

The handler never saves or logs through locks (Lightning wrote its checkpoint inside the handler
and sometimes never finished; its exception reached only some DDP ranks and the job
deadlocked). It sets a flag. At each step boundary ``run.step_end`` folds the flag into the one
small all-reduce it makes anyway (under DDP: riding on the gradient all-reduce), so every rank
learns that *some* rank was asked to stop, in the same step, and all of them save and exit
together. Code that never calls ``step_end`` would never see the flag: it is ended instead
(:class:`StopRun`, raised in the main thread :data:`ESCALATE_AFTER_S` seconds after the stop),
and so is a loop that stops reaching it (:meth:`StopRequest.grace`), so a stop is never swallowed.

Signals: SIGTERM (what a preemption without a user signal and the time limit send, and what
``run`` forwards on Ctrl-C), SIGINT, and the job's ``--signal`` (default USR2: NCCL may catch
USR1). submitit installs its own USR2/TERM handlers in its worker (rank-0-only checkpoint,
then exit); :func:`install` replaces them, so submitit's cannot cut in before ours.

The handlers found at install are kept, as Lightning's signal connector keeps them: one the
program installed itself is called after ours has recorded the stop (never a default action,
nor submitit's: :func:`_chains_to`), and all are given back once the run is over
(:meth:`StopRequest.restore`, from ``finish()`` and ``close()``; the job's signal:
:meth:`StopRequest._given_back`), so code that goes on after training can be interrupted
again. A signal after the finish is no stop.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Any

log = logging.getLogger("hpc_train")
ESCALATE_AFTER_S = 10.0   # how long code gets to reach run.step_end after a stop before it is ended


class StopRequest:
    """Records which signal asked this process to stop, and when."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.received_at: float | None = None
        self.count = 0
        self.swap: tuple[int, str] | None = None   # (rank, node): rank 0's straggler stop (see straggler)
        self._found: dict[int, Any] = {}    # each installed signal's handler before ours
        self._given: dict[int, Any] = {}    # what restore() gave back in its place
        # Set once the run finished (result.json written): a signal from then on is no stop.
        self._done = False
        # False where hpc_train's own code runs from finish() to the process's exit (the built-in
        # trainer under the worker): finish() then keeps the handlers until that exit (the policy's).
        self._back_at_finish = True
        # Set once the loop has called run.step_end (or restored): from then on a stop waits for the
        # loop's next step boundary. Code that never looks at the flag is ended instead (StopRun,
        # after ESCALATE_AFTER_S), and so is a loop that stops reaching step_end (an empty loader, a
        # hang in the user's code): one that has not reached it for a grace period after the stop.
        self._listening = False
        self._heard: float | None = None     # monotonic time of the last step boundary (or restore)
        self._longest = 0.0                   # the longest gap between two of them
        self._quiet_at_stop = 0.0             # how long the loop had been quiet when the stop came
        self._stopped_at: float | None = None
        self._armed = False   # a stop escalates (the policy's, until the work is done)
        self._raise_now = False
        self._timer: threading.Timer | None = None

    @property
    def listening(self) -> bool:
        return self._listening

    @listening.setter
    def listening(self, value: bool) -> None:
        """Set at every step boundary: the loop is alive and acts on a stop at the next one."""
        if value:
            now = time.monotonic()
            if self._heard is not None:
                self._longest = max(self._longest, now - self._heard)
            self._heard = now
        self._listening = value

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def came_before(self, monotonic_t: float) -> bool:
        """A stop was recorded before ``monotonic_t`` (a ``time.monotonic()`` reading)."""
        return self._stopped_at is not None and self._stopped_at <= monotonic_t

    @property
    def signal_name(self) -> str:
        """The stop's signal in the one form the records and the hook use, ``job.signal``'s and
        Slurm's (USR2, TERM); ``straggler`` for rank 0's own stop to swap a slow node."""
        if self.swap is not None:
            return "straggler"
        return signal.Signals(self.signum).name.removeprefix("SIG") if self.signum else "none"

    @property
    def name(self) -> str:
        """The stop as a log line says it: SIGUSR2, SIGTERM, straggler."""
        from hpc_train.records.stop import said
        return said(self.signal_name)

    def _handler(self, signum: int, frame: object) -> None:
        # Async-signal context: assign and return. No I/O, no locks, no raising of our own (the
        # program's handler, called last, does what it would have done without hpc_train).
        if self._raise_now:
            # The escalation's own signal (see _escalate), not a new stop: nobody else's handler.
            self._raise_now = False     # once: the unwinding code may itself be signalled again
            raise StopRun(signal.Signals(signum).name)
        self.count += 1
        if self.swap is not None:   # a real signal outranks rank 0's own straggler stop
            self.swap = self.signum = None
        self._record(signum)
        found = self._found.get(signum)
        if _chains_to(found):
            found(signum, frame)

    def _record(self, signum: int) -> None:
        if self._done:
            return      # the run finished: a signal now is no stop
        if self.signum is None:
            self.signum, self.received_at = signum, time.time()
            self._stopped_at = time.monotonic()
            self._quiet_at_stop = self._stopped_at - self._heard if self._heard is not None else 0.0
        if self._armed and self._timer is None:
            # Give the loop a moment to reach its next run.step_end (a stop during start-up, or
            # one that reached a single rank, is then still agreed and saved); code that never
            # calls it is ended after that, from the main thread, as a plain script would be.
            self._arm(ESCALATE_AFTER_S)

    def _arm(self, delay: float) -> None:
        self._timer = threading.Timer(delay, self._escalate)
        self._timer.daemon = True
        self._timer.start()

    def grace(self) -> float:
        """How long a listening loop may take to reach step_end after a stop: a few of its slowest
        steps so far, and never less than the time it had already been quiet when the stop came
        (a long first step), nor than ESCALATE_AFTER_S."""
        return max(ESCALATE_AFTER_S, 4 * self._longest, self._quiet_at_stop)

    def _escalate(self) -> None:
        if self.signum is None or self._stopped_at is None or not self._armed:
            return
        if self._listening:
            if self._heard is not None and self._heard >= self._stopped_at:
                return      # the loop reached a step boundary after the stop: it acts on it there
            left = self.grace() - (time.monotonic() - self._stopped_at)
            if left > 0:
                self._arm(left)
                return
        if not self._armed:
            return      # finish() or restore() meanwhile: the handler may be SIG_DFL again, which would kill
        self._raise_now = True
        # A real signal to the main thread, which runs _handler there (it raises). Not
        # _thread.interrupt_main: that only sets Python's flag, so code blocked in a call
        # (time.sleep, a socket read) would not see it until the call returned.
        signal.pthread_kill(threading.main_thread().ident, self.signum)

    def install(self, signals: list[str], armed: bool = False, back_at_finish: bool = True) -> None:
        """Handle ``signals`` (names without SIG; those past SIGTERM and SIGINT are the job's),
        keeping the handlers found, to call (:func:`_chains_to`) and to give back. ``armed``: a
        stop the code does not act on escalates; ``back_at_finish``: :meth:`finished` gives the
        handlers back (both the entry point's: :mod:`hpc_train.node.policy`)."""
        self._armed, self._back_at_finish = armed, back_at_finish
        if threading.current_thread() is not threading.main_thread():
            log.warning("not on the main thread; stop signals are not handled")
            return
        for name in dict.fromkeys(signals):
            sig = getattr(signal, f"SIG{name}")
            found = signal.signal(sig, self._handler)
            # An earlier Run's StopRequest left in place: nothing of the program's to call or give back.
            self._found[sig] = None if isinstance(getattr(found, "__self__", None), StopRequest) else found

    def _owned(self, sig: int) -> bool:
        """Ours is the handler in place, or the one restore() gave back: not one the program
        installed since."""
        now = signal.getsignal(sig)
        return now == self._handler or (sig in self._given and now == self._given[sig])

    def _given_back(self, sig: int) -> Any:
        found = self._found[sig]
        if sig not in (signal.SIGTERM, signal.SIGINT) and not _chains_to(found):
            # The job's signal: the scheduler sends it, because the job asked, as a warning ahead
            # of the time limit. After the run it asks for nothing, and its default action would
            # end the code that goes on after training (submitit's handler would requeue the
            # finished job): ignored, unless the program had a handler of its own.
            return signal.SIG_IGN
        return signal.SIG_DFL if found is None else found   # None: set outside Python, not settable from it

    def finished(self) -> None:
        """The run finished (``result.json`` is written): a signal from now on is no stop, and
        nothing escalates. The handlers found are given back, unless installed not to."""
        self._done = True
        self._quiet()
        if self._back_at_finish:
            self.restore()

    def restore(self) -> None:
        """Give back the handlers found at install (the job's signal: see :meth:`_given_back`),
        wherever ours is still in place: one the program installed after ``init()`` stays. Idempotent."""
        self._quiet()
        if threading.current_thread() is threading.main_thread():
            for sig in self._found:
                if signal.getsignal(sig) == self._handler:
                    self._given[sig] = self._given_back(sig)
                    signal.signal(sig, self._given[sig])

    def ignore_further(self) -> None:
        """hpc_train's own teardown once the work is over (the worker, the supervisor): nothing
        escalates; SIGTERM and SIGINT come to the recording handler again where finish() gave
        them back, so a late one neither ends the teardown (an exit code the launcher would take
        for a failure) nor, after a finish, counts as a stop; the job's signal is ignored for
        good (SIG_IGN survives interpreter teardown, a Python handler does not). The process
        then leaves through os._exit (lifecycle.exit_done), or through submitit's exit."""
        self._quiet()
        if threading.current_thread() is threading.main_thread():
            for sig in self._found:
                signal.signal(sig, self._handler if sig in (signal.SIGTERM, signal.SIGINT) else signal.SIG_IGN)

    def leaving_finished(self) -> None:
        """A finished run's process exits (``init()``'s exit handler, before its teardown): from
        here to the end SIGTERM and the job's signal are ignored, and SIGINT comes to our handler
        (no stop now) until ``close()`` gives it back. That exit (hpc_train's teardown, then the
        interpreter's: a second or more with torch loaded, where Python runs no handler) would
        otherwise end by a late SIGTERM with 143, a finished run looking killed. Left alone: a
        SIGTERM or job-signal handler of the program's own (its choice), and any handler it
        installed after ``finish()``. Ctrl-C still ends a stuck interpreter teardown, SIGKILL always.

        Hazard: an ignored signal is inherited by a process started from here on (by an exit
        handler registered before ``init()``), which SIGTERM then cannot end."""
        self._done = True
        self._quiet()
        if threading.current_thread() is threading.main_thread():
            for sig, found in self._found.items():
                if not self._owned(sig) or (sig != signal.SIGINT and _chains_to(found)):
                    continue
                signal.signal(sig, self._handler if sig == signal.SIGINT else signal.SIG_IGN)

    def _quiet(self) -> None:
        self._armed = False     # the work is done: a pending escalation must not end the teardown
        if self._timer is not None:
            self._timer.cancel()

    def straggler(self, rank: int, node: str) -> None:
        """Rank 0: stop at the next step boundary, with a checkpoint, so the batch shell's hook
        swaps ``node`` (where the slow ``rank`` runs) for a spare. Only this process asks: the
        agreement carries it to every rank. A stop already asked for wins; a signal after this
        replaces it (the scheduler's stop is then what the hook decides on)."""
        if self.signum is None and not self._done:
            self.swap = (rank, node)
            self._record(signal.SIGTERM)   # escalated as any stop, should the loop stop reaching step_end

    def adopt(self, signum: int, received_at: float | None) -> None:
        """A stop this rank took part in because a peer was asked (the agreement carried it):
        its signal and time, for the records. Nothing escalates: the loop is already leaving."""
        if self.signum is None and not self._done:
            self.signum, self.received_at = signum, received_at

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Ask for a stop from code (tests, a user's callback): recorded and escalated as a signal
        would be; the program's own handler is not called (no signal came)."""
        self._record(signum)


def _chains_to(found: Any) -> bool:
    """Whether a handler found at install is called after ours records the stop: only one the
    program installed itself. Never SIG_DFL (its action, ending the process, would come before
    the save the stop is for), SIG_IGN (nothing to call), None (installed outside Python: not
    callable from here), Python's ``default_int_handler`` (it raises KeyboardInterrupt wherever
    the loop is: a graceful stop would become an interrupted step), nor submitit's (it
    checkpoints on rank 0, requeues and exits by itself; one component owns the stop)."""
    return (callable(found) and found is not signal.default_int_handler
            and not str(getattr(found, "__module__", None) or "").startswith("submitit"))


def stop_signals(job_signal: str) -> list[str]:
    return ["TERM", "INT", job_signal]


class StopRun(BaseException):
    """Raised by the stop handler in code that never called ``run.step_end``: nothing there
    would ever look at the flag, so the stop ends the code the way it ends a plain script
    (a BaseException, like KeyboardInterrupt, so ``except Exception`` does not swallow it)."""


@dataclass(frozen=True)
class Votes:
    """One rank's votes at a step boundary (:meth:`encode`), and after the agreement every
    rank's, combined (:meth:`decode`): a vote is carried when any rank cast it. The same fields
    on every rank, whatever its tiers, so the collective's size never depends on a rank's state."""

    stop: bool = False           # a stop was asked of this rank (a signal, run.request_stop)
    timed: bool = False          # the shared tier's timer says a checkpoint is due
    local_timed: bool = False    # the node-local tier's timer says a save is due (False: tier off)

    def encode(self) -> list[float]:
        return [float(v) for v in astuple(self)]

    @classmethod
    def decode(cls, sums: Sequence[float]) -> tuple[Votes, list[float]]:
        """(the agreed votes, the loop's own sums that followed them)."""
        n = len(fields(cls))
        return cls(*(float(v) > 0 for v in sums[:n])), [float(v) for v in sums[n:]]


class Agreement:
    """What all ranks must agree on after each step, summed over ranks in one collective:
    ``[*votes, *values]`` where the votes are a rank's :class:`Votes` (encoded by ``flags``) and
    ``values`` optional sums the loop staged (the built-in trainer's loss sum, correct, count).
    ``flags`` runs inside DDP's communication hook: it only reads what the rank already holds.

    Under DDP (:meth:`attach`) it rides on the gradient all-reduce: a comm hook appends these
    values to bucket 0's all-reduce (or reduces them beside a bucket 0 over 1 MiB), so stopping
    together costs no extra collective. The flags are read inside the hook, during the step's
    last backward, and the sums read after it. Without DDP, or when no synced backward ran
    since the last :meth:`collect`, it is one small all-reduce. The hook averages gradients
    exactly as DDP's built-in one does (divide, then sum): on 2 ranks the weights are bitwise
    those of plain DDP. On more, the appended values shift where the all-reduce splits bucket 0
    among ranks, so an element of it may be summed in another order (an ulp's difference).
    """

    def __init__(self, multi: bool, flags: Callable[[], list[float]]) -> None:
        self.multi, self.flags = multi, flags
        self._staged = None
        self._inflight = None   # (work, values) of the agreement reduced beside DDP's bucket 0
        self.hooked = False
        self.on_last_bucket: Callable[[], None] | None = None   # the straggler watch's clock
        # Called where a step's gradient averaging begins (DDP's bucket 0, the averager's first
        # bucket), before its all-reduce: the keeping's send (hpc_train.ckpt.local.keep).
        self.on_sync: Callable[[], None] | None = None

    def attach(self, ddp_module) -> None:
        if self.multi and not self.hooked:
            # The hook calls DDP's group directly: dist.all_reduce's Python wrapper (argument
            # checks, logging decorator) costs ~20 us more per call, twice per step on bucket 0.
            self.pg = ddp_module.process_group
            self.world = self.pg.size()
            ddp_module.register_comm_hook(self, _agreement_hook)
            self.hooked = True

    def stage(self, values) -> None:
        """Values to sum with this step's agreement (a 1-D tensor on the training device)."""
        self._staged = values

    def _values(self, device, dtype):
        import torch
        flags = torch.tensor(self.flags(), dtype=dtype, device=device)
        return flags if self._staged is None else torch.cat([flags, self._staged.to(device, dtype)])

    def collect(self, device):
        """The summed values (a CPU float64 tensor); call after the step's last backward."""
        import torch
        import torch.distributed as dist
        result = None
        if self._inflight is not None:
            work, result = self._inflight
            self._inflight = None
            if work is not None:   # else carried in bucket 0, which DDP waited for in the backward
                work.wait()
        if result is None:
            result = self._values(device, torch.float32 if self._staged is None else self._staged.dtype)
            if self.multi:
                dist.all_reduce(result)
        self._staged = None
        return result.double().cpu()

    def all_reached(self, device) -> None:
        """Every rank got here (``Run.finish``, before result.json): a collective, which fails
        when a peer has left, so a run is never marked finished by the ranks that stayed."""
        if self.multi:
            import torch
            import torch.distributed as dist
            dist.all_reduce(torch.ones(1, device=device))


# Bucket 0 carries the agreement inside its own all-reduce when it is at most this big (DDP's
# first bucket is capped at 1 MiB by default): copying a small bucket in and out is cheaper than
# a second collective per step, which costs a round trip (benchmarks/no_agreement.py compares).
_CARRY_BYTES = 1 << 20


def _agreement_hook(state: Agreement, bucket):
    grads = bucket.buffer()
    grads.div_(state.world)                        # what DDP's built-in hook does first
    if bucket.index() == 0 and state.on_last_bucket is not None:
        state.on_last_bucket()                     # the backward's last bucket: this rank's own time ends
    if bucket.index() != 0:
        return state.pg.allreduce([grads]).get_future().then(_first)   # a sum, as dist.all_reduce
    if state.on_sync is not None:
        state.on_sync()
    values = state._values(grads.device, grads.dtype)
    if grads.numel() * grads.element_size() > _CARRY_BYTES:
        # A big bucket 0 (one large parameter): a small all-reduce of its own, issued just before
        # the gradients' (both async, same order on every rank), rather than copying the bucket.
        state._inflight = (state.pg.allreduce([values]), values)
        return state.pg.allreduce([grads]).get_future().then(_first)
    import torch
    n = grads.numel()
    flat = torch.cat([grads, values])              # the values are summed, not averaged

    def unpack(fut):
        _keep_thread_state()
        # value() raises when the all-reduce failed (a peer left: gloo's "connection closed by
        # peer"): the step fails, rather than train on with this rank's own, un-averaged gradients.
        fut.value()
        grads.copy_(flat[:n])
        return grads
    state._inflight = (None, flat[n:])             # read by collect(), after the backward
    return state.pg.allreduce([flat]).get_future().then(unpack)


def _first(fut):
    _keep_thread_state()
    # A Python comm hook's future must hold a Python object (DDP asserts it): the bucket tensor.
    return fut.value()[0]


_KEPT_STATES: set[int] = set()


def _keep_thread_state() -> None:
    """Give the communication thread that runs the hook's callbacks a Python thread state it keeps.

    Hazard: a callback on a thread Python did not start (gloo's work loop) makes a thread state
    on entry and drops it after, and making one takes CPython's runtime lock without the GIL. A
    fork at that moment (a data loader starting its workers at an epoch's start) leaves the child
    blocked on that lock for ever, before it runs a line (CPython gh-112275; fixed in 3.11.10 and
    3.12, and a cluster's Python may be older). A thread that keeps its state never makes one
    again. PyTorch keeps one on its autograd threads for the same reason (and the cost)."""
    ident = threading.get_ident()
    if ident not in _KEPT_STATES:          # called with the GIL held: no other thread races here
        _KEPT_STATES.add(ident)
        import ctypes
        ctypes.pythonapi.PyGILState_Ensure()   # never released: the count stays above zero


def agree_signal(stop: StopRequest, multi: bool, device: Any) -> None:
    """At an agreed stop, once: a rank that was not asked itself (a signal reached a peer only)
    takes the stop's signal and time from the ranks that were, by one small MAX all-reduce, so
    rank 0's record and line name the signal ("stopped by none" before). Every rank of an
    agreed stop calls it at the same step, so the collective matches."""
    if not multi:
        return
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(stop.signum or 0), float(stop.received_at or 0.0)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    signum, at = (float(v) for v in t.tolist())
    if signum > 0:
        stop.adopt(int(signum), at or None)


def record_stop(env: Any, run_dir: Path, stop: StopRequest, step: int | None, checkpoint: bool):
    """Rank 0 at a stop: the one writer of ``stopped.json``, the one stop record, with the
    requeue request under Slurm in it. ``step`` is None and ``checkpoint`` False when
    the code never acted on the stop (a plain script, or code that never called
    ``run.step_end``): hpc_train saved nothing, and the code resumes from what it saved itself."""
    if env.rank != 0:
        return None
    from hpc_train.records import stop as stop_record
    line = at = request = None
    if env.job_id:
        from hpc_train.requeue import request_for_stop
        (line, request), at = request_for_stop(env, step, stop), time.time()
    rec = stop_record.StopRecord(step, stop.signal_name, stop.received_at, checkpoint,
                                 time.time() if checkpoint else None, line, at, request)
    stop_record.write(Path(run_dir), rec)
    return rec
