"""The watchdog that names a rank that stopped responding. No torch here.

A collective timeout says only that *some* peer is missing, and every survivor reports it, so the
culprit goes unnamed (NCCL's maintainers: there is no such feature; pytorch #118369). Here every
task runs a daemon thread that beats every :data:`~hpc_train.node.liveness.BEAT_S` seconds
(:mod:`hpc_train.node.beats`: through the rendezvous store, or a ``--script``'s supervisor on its record).
The thread beats while the main thread computes, reads a checkpoint or waits in a collective
(those release the GIL), so a slow rank is never blamed; a rank that is stopped (SIGSTOP), frozen
in the kernel, or stuck holding the GIL stops beating. The watcher, the local ``run`` launcher or
rank 0 of a Slurm job, names the first rank whose heartbeat is older than its limit
(:mod:`hpc_train.node.liveness`: half of ``dist.timeout_s``, before the peers' collectives time
out), has every task write its Python stacks to its rank log (faulthandler on
:data:`DUMP_SIGNAL`), and ends the run; on Slurm that is a ``failure``, requeued within its budget.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from hpc_train import config_local, rundir, slurm
from hpc_train.node import beats, liveness
from hpc_train.records import ranks
from hpc_train.records.ranks import StepId

log = logging.getLogger("hpc_train")
_reader: beats._Beater | None = None     # this process's Run's heartbeat, once it has one (use_beats)
# A real-time signal nobody else uses: SIGUSR1/2 may be the job's stop signal (and NCCL's).
DUMP_SIGNAL = signal.SIGRTMIN + 7
_dump_file = None      # kept open: faulthandler writes to its file descriptor from a signal handler


_before_ending: Callable[[str], None] | None = None   # the Run's save at a failure (Run.save_at_failure)


def before_ending(save: Callable[[str], None] | None) -> None:
    """What a watcher runs before it ends this process for a hung or lost peer (None: nothing)."""
    global _before_ending
    _before_ending = save


def save_before_ending(why: str) -> None:
    """A watcher is about to end this process (``why``: its line): the Run saves the step it
    holds first (the training thread waits in the collective the peer left)."""
    save = _before_ending
    if save is not None:
        try:
            save(why)
        except Exception as e:  # noqa: BLE001 - the process ends either way
            log.warning("the save before ending the step failed: %s", e)


def use_beats(reader: beats._Beater | None) -> None:
    """The heartbeat channel this process's peers beat on, for :func:`lost_peer` (None: no channel
    is read there; a Run's ranks no longer touch their records, so their mtimes say nothing)."""
    global _reader
    _reader = reader


def launch_id() -> str:
    """The same string on every rank of one launch, and another on the next launch (a requeue, a
    restart, the next ``run``): a record left by an earlier launch is never taken for this one's."""
    return StepId.from_env().launch


def say_ended(run_dir: Path, rank: int, how: str) -> None:
    """This rank's work ended as it should (``how``: finished, stopped, returned) and its exit
    follows. A rank that exits, even with code 0, without having said so left early: the launcher
    and a script's rank 0 take that as a failure (see :func:`ended`)."""
    ranks.say(run_dir, rank, ended=how)


def _of_this_launch(run_dir: Path, rank: int) -> ranks.RankRecord | None:
    rec, _ = ranks.read(run_dir, rank)
    return rec if rec is not None and StepId.from_env().holds(rec) else None


def ended(run_dir: Path, rank: int, this_launch: bool = True) -> str | None:
    """How ``rank`` said its work ended (:func:`say_ended`), in this process's launch unless
    ``this_launch`` is False (the local launcher, which cleared older records itself); None: not
    (yet)."""
    rec = _of_this_launch(run_dir, rank) if this_launch else ranks.read(run_dir, rank)[0]
    return rec.ended if rec is not None else None


def say_left_for_stop(run_dir: Path, rank: int) -> None:
    """Before this rank leaves code that a stop ended: say so in its record, so that a peer
    whose collective then fails (this rank's exit closed it) can tell that from a crash
    (:func:`peer_left_for_stop`). The next start rewrites the record."""
    try:
        ranks.say(run_dir, rank, left="stop")
    except OSError:
        pass    # the peer then reports a lost peer: a failure, the safe side


def peer_left_for_stop(run_dir: Path, world_size: int, rank: int) -> bool:
    return any((rec := _of_this_launch(run_dir, r)) is not None and rec.left == "stop"
               for r in range(world_size) if r != rank)


_PEER_ADDR = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")   # gloo: "Read error [10.0.0.2]:40595: ..."


def lost_peer(run_dir: Path, world_size: int, rank: int, error: str = "", wait_s: float = 1.0) -> str | None:
    """Which peer this rank lost, for the one line that reports a failed collective, named at
    once: a peer of this launch whose process is gone (on this host), the peer at the address the
    transport's error names (elsewhere), or one whose heartbeat is already stale. Never waits for
    a heartbeat to go stale: the step must end at once (the requeue hook names the culprit from
    every rank's record anyway). Waits at most ``wait_s`` for a dead local process to be reaped.
    None when none is found."""
    deadline = time.time() + wait_s
    me = socket.gethostname()
    addrs = set(_PEER_ADDR.findall(error))
    elsewhere: dict[int, float | None] | None = None
    while True:
        now = time.time()
        recs = {r: h for r in range(world_size) if r != rank and (h := _of_this_launch(run_dir, r)) is not None
                and not h.said_its_end}
        for r, h in recs.items():
            if h.host == me and h.pid is not None and not config_local.pid_alive(h.pid):
                return f"rank {r} (pid {h.pid} on {h.node}) exited"
        there = sorted(r for r, h in recs.items() if h.host != me and h.addr and h.addr in addrs)
        if len(there) == 1:
            h = recs[there[0]]
            return f"rank {there[0]} (pid {h.pid} on {h.node}) dropped its connection"
        if there:
            return f"a rank on {recs[there[0]].node} (ranks {', '.join(map(str, there))}) dropped its connection"
        if elsewhere is None:     # read once: a frozen store takes liveness.READ_WAIT_S to say so
            far = [r for r, h in recs.items() if h.host != me]
            try:
                elsewhere = _reader.ages(far, now) if far and _reader is not None else {}
            except beats.Silent:
                elsewhere = {}
        for r, age in elsewhere.items():
            if liveness.silent(age, liveness.LOST_AFTER_S):
                h = recs[r]
                return f"rank {r} (pid {h.pid} on {h.node}) stopped beating {age:.0f}s ago"
        if now >= deadline:
            return None
        time.sleep(0.1)


def lost_peer_line(error: str, run_dir: Path, world_size: int, rank: int) -> str:
    """The one line for a collective that failed because a peer went away: which peer, then the
    transport's own first line about it (gloo's "Connection reset by peer", a store timeout)."""
    from hpc_train.errors import says_peer_lost
    first = next((ln.strip() for ln in error.splitlines() if says_peer_lost(ln)), error.strip())
    who = lost_peer(run_dir, world_size, rank, error)
    return f"lost a peer: {who or 'a peer left (no record names it yet)'} ({first[:300]})"


def enable_stack_dumps(log_path: Path) -> None:
    """On :data:`DUMP_SIGNAL`, write every thread's Python stack to ``log_path``."""
    global _dump_file
    log_path.parent.mkdir(parents=True, exist_ok=True)
    _dump_file = rundir.open_append(log_path)  # must stay open for faulthandler; never through a symlink
    faulthandler.register(DUMP_SIGNAL, file=_dump_file, all_threads=True, chain=False)


def stack_dumps_to_stderr() -> None:
    """A user's program on ``init()``: on :data:`DUMP_SIGNAL`, every thread's Python stack to its
    own stderr. A hang's request for the stacks (the signal, through Slurm to every task of the
    step) reaches the program too, and a real-time signal's default is to end the process: the
    frozen rank died of it, its stack unwritten. Nothing in the run directory (a start that is
    then refused writes nothing there)."""
    try:
        faulthandler.register(DUMP_SIGNAL, all_threads=True, chain=False)
    except (ValueError, OSError, AttributeError, RuntimeError):   # no stderr with a descriptor (a notebook)
        pass


_PROCESS_START = time.time()


def write_error(run_dir: Path, rank: int, text: str) -> None:
    """This rank's error file (``logs/rank-R.error``), unless the local launcher already named
    this rank frozen in it since this process started: that is why the rank failed, and what it
    did once continued (a peer gone, its collective failed) is only a consequence."""
    p = rundir.rank_error(run_dir, rank)
    try:
        fresh = p.stat().st_mtime >= _PROCESS_START
    except OSError:
        fresh = False
    if fresh and (rundir.read_text(p)[0] or "").startswith("WatchdogError:"):
        return
    rundir.write_atomic(p, text)


def dump_file():
    """The file this process's stack dumps go to (its log), once :func:`enable_stack_dumps` ran."""
    return _dump_file


def ask_for_stack(pid: int) -> None:
    """Have process ``pid`` write its Python stacks (see :func:`enable_stack_dumps`), sent to its
    main thread (tgkill; the main thread's id is the pid). A signal sent to the process goes to
    any of its threads: for a stopped process continued right after, another thread could take
    it while the main thread runs on, and the dump would show where it went next instead of
    where it stopped. The main thread takes its own signals first, before it runs any code."""
    try:
        import ctypes
        tgkill = ctypes.CDLL(None, use_errno=True).tgkill
    except (OSError, AttributeError):
        tgkill = None                     # not Linux, or a libc older than 2.30
    try:
        if tgkill is None or tgkill(pid, pid, int(DUMP_SIGNAL)) != 0:
            os.kill(pid, DUMP_SIGNAL)
    except ProcessLookupError:
        pass


def ask_step_for_stacks(job_step: str) -> None:
    """Every task of the Slurm job step ``job_step`` writes its stacks: the dump signal, then
    SIGCONT for a stopped one. The asking process is one of those tasks, and takes no dump
    signal from then on (it is ending; its caller writes its stack from Python if it wants it).
    faulthandler's dump of every thread, run in a signal handler, reads the other threads'
    frames without the GIL, and crashed the asking rank 0 (SIGSEGV, its dump cut off) while its
    own thread ran this function's subprocess call: the step's error then named rank 0, lost,
    instead of the rank that hung."""
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal(int(DUMP_SIGNAL), ctypes.c_void_p(1))      # SIG_IGN, process-wide, from any thread
    except (OSError, AttributeError):
        pass
    for sig in (str(int(DUMP_SIGNAL)), "CONT"):
        slurm.scancel(f"--signal={sig}", job_step)     # best effort: the step ends anyway


def holder(run_dir: Path, rank: int) -> tuple[str, int | None]:
    """Where rank ``rank`` runs (its node, as Slurm names it) and its pid, from its record."""
    rec, _ = ranks.read(run_dir, rank)
    return (rec.node, rec.pid) if rec is not None else ("unknown host", None)


def describe(run_dir: Path, rank: int, age: float | None) -> str:
    """``age``: how old its heartbeat is; None: its process was seen stopped (:func:`stopped`)."""
    host, pid = holder(run_dir, rank)
    how = "its process is stopped (SIGSTOP, or a debugger)" if age is None else f"no heartbeat for {age:.0f}s"
    return f"rank {rank} (pid {pid} on {host}) stopped responding: {how}; its Python stack is in {rundir.rank_log(run_dir, rank)}"


def stopped(pid: int, settle_s: float = liveness.STOPPED_SETTLE_S) -> bool:
    """The process is stopped (state T: SIGSTOP, SIGTSTP; t: a debugger holds it), as this host's
    kernel says: what the local launcher asks of its own workers, with no heartbeat to read. Seen
    so twice, ``settle_s`` apart, with no context switch between: a process that a tracer such as
    ``strace`` stops for a moment at each system call is caught in state t now and then, and is
    not frozen (a run being traced was once ended as 'stopped responding' within a second)."""
    first = _stop_state(pid)
    if first is None:
        return False
    time.sleep(settle_s)
    return _stop_state(pid) == first


def _stop_state(pid: int) -> tuple[bytes, bytes] | None:
    """(state, context switches so far) when the process is in a stopped state, else None."""
    state = config_local.process_state(pid)
    if state not in (b"T", b"t"):
        return None
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            switches = b" ".join(line.split()[-1] for line in f if b"ctxt_switches:" in line)
        return state, switches
    except (OSError, IndexError):
        return None


def watch_slurm_job(run_dir: Path, world: int, timeout_s: float, job_step: str,
                    reader: beats._Beater) -> threading.Thread:
    """Rank 0 of a Slurm job: a thread that ends the step when a peer stops beating on ``reader``.

    The peers' processes are on other nodes: their stacks are asked for through Slurm (the dump
    signal, then SIGCONT for a stopped process), then this process exits non-zero and
    ``srun --kill-on-bad-exit`` ends the step; the batch shell's hook counts a failure.
    """
    since = time.time()
    limit_s = liveness.heartbeat_limit(timeout_s)

    def loop() -> None:
        while True:
            time.sleep(liveness.look_every(limit_s))
            try:
                found = beats.stale(reader, list(range(1, world)), limit_s, since)
            except beats.Silent:
                continue          # torchrun's agent store: the agent's own watch covers it
            if found is None:
                continue
            msg = describe(run_dir, *found)
            log.error("%s; ending the job step", msg)
            save_before_ending(msg)
            rundir.write_atomic(rundir.rank_error(run_dir, 0), f"WatchdogError: {msg}\n")
            ask_step_for_stacks(job_step)
            time.sleep(3)
            logging.shutdown()
            os._exit(1)

    t = threading.Thread(target=loop, name="hpc_train-watchdog", daemon=True)
    t.start()
    return t


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for a child process: the kernel SIGKILLs the child when the thread that
    forked it exits, so a worker never outlives a launcher killed with -9 (which can forward
    nothing). Fork from the main thread, which lives as long as the process. None where there
    is no prctl (not Linux). libc is looked up here, in the parent: the child only calls it."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def child() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:      # the parent died before the call took effect
            os.kill(os.getpid(), signal.SIGKILL)
    return child


def die_with_launcher() -> bool:
    """The same for this process, started by a launcher that is not hpc_train's (torchrun, whose
    agent starts its workers from its main thread): SIGKILLed when that launcher dies. True once
    set. A launcher that died before this call is not detected: its pid is not known here, and a
    parent of pid 1 may be a live launcher (torchrun as a container's first process)."""
    prctl = _prctl()
    return prctl is not None and prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) == 0


def _prctl():
    import ctypes
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PR_SET_PDEATHSIG = 1


def memory_limits() -> str | None:
    """The memory limits on this process, as one phrase ("RLIMIT_AS 48 GiB, cgroup memory 4 GiB");
    None when none is set. A rank killed by SIGKILL under one was most likely the OOM killer's."""
    import resource
    found = []
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        found.append(f"RLIMIT_AS {_size(soft)}")
    cg = _cgroup_memory_limit()
    if cg is not None:
        found.append(f"cgroup memory {_size(cg)}")
    return ", ".join(found) or None


def _cgroup_memory_limit() -> int | None:
    """memory.max (cgroup v2) or memory.limit_in_bytes (v1) of this process's cgroup, if limited."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            root, name = Path("/sys/fs/cgroup"), "memory.max"
        elif "memory" in controllers.split(","):
            root, name = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"
        else:
            continue
        # Inside a container the cgroup's own directory is mounted as the root.
        for d in (root / path.lstrip("/"), root):
            try:
                raw = (d / name).read_text().strip()
            except OSError:
                continue
            n = rundir.decimal(raw)
            if n is not None and n < 1 << 60:   # "max", or v1's near-2^63 "unlimited"
                return n
            break
    return None


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n} bytes"
