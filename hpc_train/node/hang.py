"""The hang watch of a loop that steps through :class:`~hpc_train.run.Run` (the built-in
trainer and a user's loop alike). No torch here.

A step is hung when it has not ended for :data:`~hpc_train.node.liveness.HANG_STEP_FACTOR` (10) x
the run's recent p99 step time, and at least ``dist.hang_floor_s`` (``dist.hang_timeout_s: auto``),
or for ``dist.hang_timeout_s`` seconds when that is a number. The heartbeat alone
(:mod:`hpc_train.node.watchdog`) waits half of ``dist.timeout_s`` (300 s by default) before it names
a frozen rank; the run's own steps say much sooner that something is wrong.

Known long phases keep that long limit: the time up to the first step (rendezvous, model and
data, compilation), a restore, a save, whatever the code marks with :meth:`Run.long_phase
<hpc_train.run.Run.long_phase>` (an evaluation), and the step after each (a rank that saved or
evaluated alone keeps the others waiting in that step's collective). The first steps after a
start (:data:`~hpc_train.node.liveness.HANG_WARMUP_STEPS`) have it too, until there is a p99 to go by.

Past the limit, this rank's watch thread looks at its peers' heartbeats. A peer whose heartbeat
has stopped (a frozen process: SIGSTOP, a node that stopped answering) is the culprit, named at
once and asked for its Python stack; this rank writes its error file and exits, the local
launcher or ``srun --kill-on-bad-exit`` ends the step, and the restart in place follows. When
every peer still beats, the stall is either a hang (a wedged collective, a stuck data loader) or
a long phase the code did not mark (an evaluation on rank 0 while the others wait in the next
collective looks the same from here): this rank says so once, with its stack, and leaves the end
to the collectives' own limit, ``dist.timeout_s`` (or ends it at ``dist.hang_timeout_s`` when
that is a number). A single-process run has no peers and no watch. ``dist.timeout_s`` stays
the collectives' own limit, behind this one. A ``--script`` has no steps to see: its ranks keep
the heartbeat limit alone.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from hpc_train import rundir
from hpc_train.config import DistSection
from hpc_train.config_rules import hang_timeout
from hpc_train.node import beats, liveness, watchdog
from hpc_train.node.liveness import HANG_CHECK_S, HANG_STEP_FACTOR, HANG_WARMUP_STEPS
from hpc_train.node.environment import NodeEnv

log = logging.getLogger("hpc_train")


class Progress:
    """When this rank's last step ended, the recent step times, and the phase it is in. Written
    by the loop's thread (``step_end``, phases), read by the watch thread."""

    def __init__(self, fixed_s: float | None, floor_s: float, long_s: float) -> None:
        self.fixed_s, self.floor_s, self.long_s = fixed_s, floor_s, long_s
        self._lock = threading.Lock()
        self._times: deque[float] = deque(maxlen=liveness.HANG_WINDOW_STEPS)
        self.phase, self.since, self.step = "start-up", time.monotonic(), None   # guarded by _lock

    def stepped(self, step: int) -> None:
        """A step ended (``step_end``, after its collective)."""
        now = time.monotonic()
        with self._lock:
            if self.phase == "step":
                self._times.append(now - self.since)
            self.phase, self.since, self.step = "step", now, step

    def enter(self, phase: str) -> str:
        """A long phase begins; returns the phase it interrupts (for :meth:`leave`)."""
        with self._lock:
            before, self.phase, self.since = self.phase, phase, time.monotonic()
        return before

    def leave(self, before: str) -> None:
        """A long phase ended: the step timer restarts, and the next step has the long limit too
        (after a restore it is slower: caches, allocator; after a save or an evaluation that
        one rank did alone, the others wait for it in that step's collective)."""
        with self._lock:
            self.phase = "first step" if before in ("start-up", "restore") else f"the step after the {self.phase}"
            self.since = time.monotonic()

    @contextlib.contextmanager
    def marked(self, name: str) -> Iterator[None]:
        before = self.enter(name)
        try:
            yield
        finally:
            self.leave(before)

    def state(self) -> tuple[float, str, int | None, float, str]:
        """(seconds since the phase began, phase, last step ended, limit, how the limit was set)."""
        with self._lock:
            stalled, phase, step, times = time.monotonic() - self.since, self.phase, self.step, list(self._times)
        if self.fixed_s is not None:
            return stalled, phase, step, self.fixed_s, "dist.hang_timeout_s"
        if phase != "step" or len(times) < HANG_WARMUP_STEPS:
            return stalled, phase, step, self.long_s, "the long limit, half of dist.timeout_s"
        p99 = sorted(times)[int(0.99 * (len(times) - 1))]
        if HANG_STEP_FACTOR * p99 <= self.floor_s:
            return stalled, phase, step, self.floor_s, f"dist.hang_floor_s; p99 step {p99:.3f}s"
        return stalled, phase, step, HANG_STEP_FACTOR * p99, f"{HANG_STEP_FACTOR} x the p99 step time {p99:.3f}s"


class HangWatch:
    """The thread that ends a hung step (see the module docstring)."""

    def __init__(self, progress: Progress, beating: beats._Beater, run_dir: Path, rank: int, world_size: int,
                 job_step: str | None) -> None:
        self.progress, self.beats, self.run_dir, self.rank, self.world_size = progress, beating, Path(run_dir), rank, world_size
        self.job_step = job_step         # JOB.STEP under Slurm: peers elsewhere are signalled through it
        self._stop = threading.Event()
        self._started = time.time()
        self._thread = threading.Thread(target=self._loop, name="hpc_train-hang-watch", daemon=True)

    def start(self) -> HangWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        warned = frozen_here = False
        peers = [r for r in range(self.world_size) if r != self.rank]
        last = recheck = time.monotonic()
        while not self._stop.wait(HANG_CHECK_S):
            stalled, phase, step, limit, why = self.progress.state()
            now = time.monotonic()
            # This process was stopped itself (SIGSTOP, then SIGCONT): the stall is its own, and
            # the peer that named it may be gone already; nothing to say until a step ends.
            frozen_here = frozen_here or now - last > 3 * HANG_CHECK_S
            last = now
            if stalled <= limit:
                warned = frozen_here = False
                continue
            if frozen_here:
                continue
            if warned and now < recheck:
                continue
            try:
                frozen = beats.stale(self.beats, peers, liveness.FROZEN_AFTER_S, self._started)
            except beats.Silent as e:      # torchrun's agent store: nobody to name, nothing learnt
                log.warning("%s", e)
                frozen = None
            # Every rank of a stalled collective reads every peer's beat: at thousands of ranks,
            # not every second (one read is a key per rank from one store server).
            recheck = now + max(5.0, self.world_size / 100)
            if self._stop.is_set():
                return
            if frozen is not None or self.progress.fixed_s is not None:
                self._end(stalled, phase, step, limit, why, frozen)
            elif not warned:
                # Every peer beats: a long phase the code did not mark (an evaluation on rank 0
                # while the others wait in the next collective looks the same from here) or a
                # stuck collective. Said once, with this rank's stack; ending it is left to the
                # collectives' own limit, dist.timeout_s, as without this watch.
                warned = True
                log.warning("no step ended for %.0fs in %s (limit %.0fs: %s), and every peer still beats: a long "
                            "phase (mark it with run.long_phase) or a hang; this rank's Python stack is in %s; "
                            "a stuck collective ends at dist.timeout_s", stalled, _at(phase, step), limit, why,
                            rundir.rank_log(self.run_dir, self.rank))
                _dump_own_stack()

    def _end(self, stalled: float, phase: str, step: int | None, limit: float, why: str,
             frozen: tuple[int, float] | None) -> None:
        waited = f"rank {self.rank} waited {stalled:.0f}s in {_at(phase, step)} (limit {limit:.0f}s: {why})"
        _dump_own_stack()
        if frozen is not None:
            node, pid = watchdog.holder(self.run_dir, frozen[0])
            msg = (f"rank {frozen[0]} (pid {pid} on {node}) hung: no heartbeat for {frozen[1]:.0f}s while {waited}; "
                   f"its Python stack is in {rundir.rank_log(self.run_dir, frozen[0])}")
            # Before the frozen peer is continued for its stack (its collective may then complete).
            watchdog.save_before_ending(f"rank {frozen[0]} hung")
            if os.environ.get(rundir.LAUNCHER_ENV) != "local":   # the local launcher asks for it itself
                self._ask_for_stack(node, pid)
        else:
            msg = (f"the step hung: {waited}, and every peer still beats (a collective or the loop's own code "
                   f"is stuck); each rank's Python stack is in its log, this one's in "
                   f"{rundir.rank_log(self.run_dir, self.rank)}")
        log.error("%s; ending the step", msg)
        try:
            watchdog.write_error(self.run_dir, self.rank, f"HangError: {msg}\n")
        except OSError:
            pass
        time.sleep(1.0)          # peers that see the same hang dump their own stacks first
        logging.shutdown()
        os._exit(1)

    def _ask_for_stack(self, node: str, pid: int | None) -> None:
        """The frozen peer's stack: the dump signal, then SIGCONT (a stopped process takes its
        signals once continued); through Slurm for a peer on another node."""
        import socket
        if pid is not None and node in (socket.gethostname(), os.environ.get("SLURMD_NODENAME")):
            watchdog.ask_for_stack(pid)
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
        elif self.job_step:
            watchdog.ask_step_for_stacks(self.job_step)   # this rank's own stack is written (above)


class Watches:
    """A Run's heartbeat (:mod:`hpc_train.node.beats`) and its hang watch, stopped together when
    the Run closes. Rank 0's Slurm watchdog, started beside them, is not stopped: it reads the
    beats until the process exits, as it did when the session started it."""

    def __init__(self, beating: beats._Beater | None, hang: HangWatch | None) -> None:
        self.beats, self.hang = beating, hang

    def stop(self) -> None:
        for part in (self.hang, self.beats):
            if part is not None:
                part.stop()


def watch(d: DistSection, session) -> tuple[Progress, Watches]:
    """A Run's progress, and its heartbeat and watches over the ``session``'s run directory, started."""
    long_s = liveness.heartbeat_limit(d.timeout_s)
    progress = Progress(hang_timeout(d.hang_timeout_s, d.timeout_s, d.hang_floor_s),
                        d.hang_floor_s or min(liveness.HANG_FLOOR_S, long_s), long_s)
    env, run_dir = session.env, session.run_dir
    # Alone, a rank has no peer to name and no collective to wait in.
    beating = beats.for_run(env, run_dir, through_store=session.policy.owns_group)
    if beating is None:
        return progress, Watches(None, None)
    watchdog.use_beats(beating)
    from hpc_train.node.session import watch_slurm
    watch_slurm(session, beating)
    step = os.environ.get("SLURM_STEP_ID")
    job_step = f"{env.job_id}.{step}" if env.job_id and step else None
    return progress, Watches(beating, HangWatch(progress, beating, run_dir, env.rank, env.world_size, job_step).start())


def _at(phase: str, step: int | None) -> str:
    return f"step {step + 1}" if step is not None and phase == "step" else phase


def _dump_own_stack() -> None:
    out = watchdog.dump_file() or sys.stderr
    try:
        faulthandler.dump_traceback(file=out, all_threads=True)
    except (OSError, ValueError):
        pass
