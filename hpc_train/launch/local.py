"""``python -m hpc_train run``: N worker processes on this machine, no Slurm.

Each worker is ``python -m hpc_train worker`` with torchrun-style variables plus
``HPC_TRAIN_LAUNCHER=local``, so it takes exactly the on-node path of a Slurm task.

Signals: workers run in their own session, so a terminal's Ctrl-C reaches only this process,
which decides what they get. The first Ctrl-C (or a SIGTERM) is forwarded as SIGTERM: every
rank finishes its step, saves, and exits. A second Ctrl-C, or a Ctrl-\\, kills them at once.
Nothing outlives this process: each worker is SIGKILLed by the kernel when it dies (a kill -9
forwards nothing), and every worker holds the run directory's lock, so the directory is free
only once no process of the run can still write to it.

Failure: when one worker exits non-zero, or with 0 before its work ended (it never said so:
:func:`hpc_train.node.watchdog.say_ended`), the others are stopped (SIGTERM, then SIGKILL after
a grace period) and the first failure is shown with its error and log path.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from hpc_train import config_local, rundir
from hpc_train.errors import EXIT_STOPPED, says_peer_lost, signal_name

GRACE_S = 10.0   # after a failure, how long the surviving ranks get to exit before SIGKILL (they cannot save: a save needs every rank)
HUNG_GRACE_S = 5.0   # after a rank stopped responding: the others wait on it in a collective, and cannot save


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_port(environ: dict[str, str] | None = None) -> int:
    """``MASTER_PORT`` if set (checked: a bad value is a usage error, before anything is written),
    else a port that is free now."""
    environ = os.environ if environ is None else environ
    if environ.get("MASTER_PORT"):
        from hpc_train.node.environment import derive_port
        return derive_port({"MASTER_PORT": environ["MASTER_PORT"]}, None)
    return free_port()


class SpawnFailed(Exception):
    """Starting worker ``rank`` failed (out of processes, memory, file descriptors); the workers
    already started have been ended."""

    def __init__(self, rank: int, nproc: int, error: OSError) -> None:
        from hpc_train.errors import os_error_line
        why = os_error_line(error).removeprefix("cannot use: ")
        super().__init__(f"could not start worker rank {rank} of {nproc} ({why}); the {rank} already started "
                         f"{'was' if rank == 1 else 'were'} ended")


def _spawn(nproc: int, config_path: Path, run_dir: Path, resume: str, port: int,
           lock_fd: int | None = None) -> list[subprocess.Popen]:
    from hpc_train.goodput import process_start_time
    from hpc_train.node.watchdog import die_with_parent
    launched_at = f"{process_start_time():.3f}"   # the goodput ledger counts start-up from here
    procs: list[subprocess.Popen] = []
    for rank in range(nproc):
        env = {**os.environ, rundir.LAUNCHER_ENV: "local", rundir.LAUNCHED_AT_ENV: launched_at,
               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
               "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1",
               rundir.RESUME_ENV: resume, rundir.LOCAL_ID_ENV: config_local.launcher_id(os.getpid())}
        # Slurm variables would make a worker think it is a Slurm task of some other job.
        for k in [k for k in env if k.startswith("SLURM_")]:
            del env[k]
        try:
            # Each worker dies with this process (a kill -9 here can forward nothing), and holds the
            # run directory's lock with it: the lock is free only once no process of the run writes.
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "hpc_train", "worker", "--config", str(config_path), "--run-dir", str(run_dir)],
                env=env, start_new_session=True, preexec_fn=die_with_parent(),
                pass_fds=(lock_fd,) if lock_fd is not None else ()))
        except OSError as e:
            # Out of processes part-way: the ones started would wait for their peers until the
            # rendezvous timed out, long after this launcher is gone.
            _signal_all(procs, signal.SIGKILL)
            for p in procs:
                p.wait()
            raise SpawnFailed(rank, nproc, e) from None
    return procs


# Ranks per CPU that `run` allows on gloo: more ranks than cores share them (slower, but a test
# of 4 ranks on a 2-core laptop is a fair thing to run); far more is a typo or a fork bomb.
RANKS_PER_CPU = 4


def check_nproc(nproc: int, backend: str) -> None:
    """``--nproc``: at least 1, and at most one process per GPU (nccl, or auto where GPUs are
    visible) or :data:`RANKS_PER_CPU` per CPU this process may run on (gloo). Counted without
    importing torch."""
    from hpc_train.errors import UsageError
    if nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {nproc}")
    gpus = _visible_gpus() if backend in ("nccl", "auto") else 0
    if gpus:
        bound, what = gpus, f"{gpus} GPU{'s' if gpus != 1 else ''} visible (one process per GPU with dist.backend={backend})"
    else:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        bound = RANKS_PER_CPU * cpus
        what = (f"{bound} processes that the {cpus} CPU{'s' if cpus != 1 else ''} this process may use can run "
                f"({RANKS_PER_CPU} per CPU)")
    if nproc > bound:
        raise UsageError(f"--nproc {nproc} is more than the {what}; use --nproc {bound} or less")


def _visible_gpus() -> int:
    """NVIDIA GPUs this process may use: CUDA_VISIBLE_DEVICES if set, else the driver's list."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        n = 0
        for dev in visible.split(","):     # CUDA stops at the first invalid entry ("-1", "")
            if not dev.strip() or dev.strip().startswith("-"):
                break
            n += 1
        return n
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def _signal_all(procs: list[subprocess.Popen], sig: int) -> None:
    """SIGTERM goes to the worker only (it stops its loader's processes itself); SIGKILL goes
    to its whole process group, so no data-loader process is left behind. Every group is
    stopped (SIGSTOP) before any is killed: otherwise a rank that outlives a peer by a moment
    sees the peer's sockets close in a collective and records that as its own failure, and an
    abort (a second Ctrl-C) would read as a failure afterwards."""
    live = [p for p in procs if p.poll() is None]
    for step in ((signal.SIGSTOP, signal.SIGKILL) if sig == signal.SIGKILL else (sig,)):
        for p in live:
            try:
                os.killpg(p.pid, step) if sig == signal.SIGKILL else os.kill(p.pid, step)
            except ProcessLookupError:
                pass


def _first_error(run_dir: Path, rank: int, code: int | None = None) -> str:
    """The error's first paragraph (a script's failure: rank, host and its last lines; a
    Python error: its one-line summary, not the traceback under it). A rank that recorded none
    is described by how it ended (``code``: its exit status)."""
    text, _ = rundir.read_text(rundir.rank_error(run_dir, rank))   # any bytes, never blocking
    return (text or "").split("\n\n")[0].strip() or _unrecorded(code)


def _unrecorded(code: int | None) -> str:
    """Why a rank that wrote no error file ended, from its exit status alone."""
    from hpc_train.node.watchdog import memory_limits
    limits = memory_limits()
    if code == 0:
        return ("it exited before its work ended (it neither returned from the training code nor stopped): "
                "a rank that leaves early fails the run")
    if code is not None and code < 0:
        name = signal_name(-code)
        if -code == signal.SIGKILL:
            return (f"killed by {name}, which the kernel's out-of-memory killer sends" +
                    (f": the memory limit in force is {limits}" if limits else " (or someone's kill -9)"))
        return f"killed by {name}"
    if limits:
        return f"it recorded no error; it may have run out of memory (the memory limit in force is {limits})"
    return "its error could not be recorded (a full or read-only disk?): see its lines above"


def _failed(run_dir: Path, rank: int, code: int | None) -> bool:
    """A worker that exited non-zero, or with 0 but without saying its work ended (it left
    early: ``os._exit(0)``, a ``sys.exit(0)`` deep in a library)."""
    from hpc_train.node.watchdog import ended
    return code is not None and (code != 0 or ended(run_dir, rank, this_launch=False) is None)


def _culprit(run_dir: Path, ranks: list[tuple[int, int]]) -> int:
    """Among ranks seen failing in the same poll, the one that caused it: a rank whose error
    says a peer went away is a victim of another rank's death."""
    for rank, code in ranks:
        if not says_peer_lost(_first_error(run_dir, rank, code)):
            return rank
    return ranks[0][0]


def _name_frozen(run_dir: Path, procs: list[subprocess.Popen], rank: int, age: float) -> None:
    """Say which rank froze, and have every rank write its stack (the frozen one once continued)."""
    from hpc_train.node import watchdog
    msg = watchdog.describe(run_dir, rank, age)
    print(f"hpc_train: {msg}; ending the run", file=sys.stderr, flush=True)
    rundir.write_atomic(rundir.rank_error(run_dir, rank), f"WatchdogError: {msg}\n")
    for p in procs:
        if p.poll() is None:
            watchdog.ask_for_stack(p.pid)
    _signal_all(procs, signal.SIGCONT)
    time.sleep(1.0)


def launch(nproc: int, config_path: Path, run_dir: Path, resume: str = "latest", port: int | None = None,
           hang_s: float = 600.0, lock_fd: int | None = None, script: bool = False, local_dir: str = "") -> int:
    """Start, supervise and reap the workers. Returns the exit code for the CLI.

    ``hang_s`` (``dist.timeout_s``): a rank whose heartbeat is older than this has stopped
    responding (see :mod:`hpc_train.node.watchdog`); it is named, every rank writes its stack, and
    the run ends. ``lock_fd``: the run directory's lock, held by every worker too. ``script``: the
    workers run a ``--script`` (a stop reaches it as SIGTERM; the message says so), whose
    supervisors beat in node memory under ``local_dir`` (``checkpoint.local_dir``,
    :mod:`hpc_train.node.beats`)."""
    from hpc_train.records import ranks, stop
    # An earlier launch's error files, rank records (which say how each rank ended) and stop
    # record are not this one's. (Told apart by time alone, a stop record written just before
    # this launch began, within the clocks' slack, was once taken for this launch's own.)
    for stale in (run_dir / rundir.LOGS).glob("rank-*.error"):
        stale.unlink()
    ranks.clear(run_dir)
    stop.remove(run_dir)
    started = time.time()
    try:
        procs = _spawn(nproc, config_path, run_dir, resume, rendezvous_port() if port is None else port, lock_fd)
    except SpawnFailed as e:
        print(f"hpc_train: error: {e}", file=sys.stderr)
        return 1
    interrupts = {"n": 0, "sig": 0}

    def on_signal(signum: int, frame: object) -> None:
        interrupts["n"] += 1 if signum != signal.SIGQUIT else 2   # Ctrl-\\: abort at once, as a second Ctrl-C
        interrupts["sig"] = interrupts["sig"] or signum
        if interrupts["n"] == 1:
            how = ("sending SIGTERM to every rank's script (a script using hpc_train.init() stops after its "
                   "current step)" if script else "asking every rank to stop after its current step")
            print(f"\nhpc_train: {signal.Signals(signum).name}: {how} (press Ctrl-C again to abort at once)",
                  file=sys.stderr, flush=True)
            _signal_all(procs, signal.SIGTERM)
        else:
            _signal_all(procs, signal.SIGKILL)

    # SIGHUP: the terminal closed. Workers live in their own sessions, so without this they would
    # train on as orphans; it stops them like the first Ctrl-C.
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    try:
        from hpc_train.node import beats
        failed = _watch(procs, run_dir, hang_s, started, beats.script_reader(run_dir, local_dir, os.getpid())
                        if script else None)
    finally:
        from hpc_train.records import result
        finished = result.written_since(run_dir, started)
        for s, h in old.items():
            # A finished run's launcher has only its exit left (the lock, a goodput line, then the
            # interpreter's teardown: most of a second with torch loaded, where Python runs no
            # handler): a late SIGTERM or SIGHUP would make it 143, a finished run looking
            # killed. Ctrl-C and SIGQUIT still end it.
            signal.signal(s, signal.SIG_IGN if finished and s in (signal.SIGTERM, signal.SIGHUP) else h)
        from hpc_train.goodput import exited, process_start_time
        exited(run_dir, process_start_time())
        _remove_local_tier(config_path)
    return _outcome(run_dir, failed, interrupts["n"], interrupts["sig"], started, finished)


def _remove_local_tier(config_path: Path) -> None:
    """The run's node-local checkpoint tier (hpc_train.ckpt.local.tier) ends with the run: this launch's
    directory (named by the ID this process handed its workers, which their --script's programs
    inherit) under the config's checkpoint.local_dir and under the default base (a script may set
    its own), even after a failure (nothing restarts a `run` in place) or a kill of the workers."""
    import shutil
    from hpc_train import config as config_mod
    env, me = config_local.as_workers_see(os.environ), config_local.launcher_id(os.getpid())
    try:
        dirs = {config_local.job_dir(config_mod.load(config_path).checkpoint.local_dir, env, os.getpid(), me)}
    except Exception:  # noqa: BLE001 - an unreadable config: the default base is still cleaned
        dirs = set()
    for d in dirs | {config_local.job_dir("", env, os.getpid(), me)}:
        shutil.rmtree(d, ignore_errors=True)


def _frozen(procs: list[subprocess.Popen], alive: list[int], limit_s: float, started: float,
            reader) -> tuple[int, float | None] | None:
    """A worker that stopped responding: one whose process is stopped (this host's kernel says
    so), or, for a ``--script``'s supervisors (whose beats ``reader`` reads,
    :mod:`hpc_train.node.beats`), one whose heartbeat is older than ``limit_s``. A Run's ranks
    beat through the rendezvous store, which this process (torch-free) does not read: their own
    hang watch names a silent peer, and its rank's failure brings this check round."""
    from hpc_train.node import watchdog
    for r in alive:
        if watchdog.stopped(procs[r].pid):
            return r, None
    from hpc_train.node import beats
    return beats.stale(reader, alive, limit_s, started) if reader is not None else None


def _watch(procs: list[subprocess.Popen], run_dir: Path, hang_s: float, started: float,
           reader=None) -> tuple[int, int | None] | None:
    """Until every worker exited: the first failure, (rank, exit code; None for a rank that
    stopped responding), after which the others are ended (SIGTERM, SIGKILL after a grace)."""
    from hpc_train.node import liveness
    failed: tuple[int, int | None] | None = None
    deadline = None
    next_check = time.monotonic() + 1.0
    # Poll every worker on every tick (not `any(p.poll() ...)`, which stops at the first one
    # still running: rank 1's death went unseen for as long as rank 0 lived).
    while [p.poll() for p in procs].count(None):
        if failed is None:
            dead = [(rank, p.returncode) for rank, p in enumerate(procs) if _failed(run_dir, rank, p.returncode)]
            if dead:
                # A peer that froze makes the others fail in their collectives: name it, not them.
                alive = [r for r, p in enumerate(procs) if p.poll() is None]
                frozen = _frozen(procs, alive, liveness.FROZEN_AFTER_S, started, reader)
                rank = _culprit(run_dir, dead) if frozen is None else frozen[0]
                failed = (rank, procs[rank].returncode if frozen is None else None)
                if frozen is not None:
                    _name_frozen(run_dir, procs, *frozen)
                _signal_all(procs, signal.SIGTERM)
                deadline = time.monotonic() + GRACE_S
        if failed is None and time.monotonic() >= next_check:
            next_check = time.monotonic() + 1.0
            alive = [rank for rank, p in enumerate(procs) if p.poll() is None]
            hung = (_frozen(procs, alive, liveness.heartbeat_limit(hang_s), started, reader)
                    if reader is not None else None)
            if hung is not None:
                _name_frozen(run_dir, procs, *hung)
                failed = (hung[0], None)
                _signal_all(procs, signal.SIGTERM)
                deadline = time.monotonic() + HUNG_GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            _signal_all(procs, signal.SIGKILL)
        time.sleep(0.1)
    if failed is None:
        dead = [(rank, p.returncode) for rank, p in enumerate(procs) if _failed(run_dir, rank, p.returncode)]
        if dead:
            rank = _culprit(run_dir, dead)
            failed = (rank, procs[rank].returncode)
    return failed


def _outcome(run_dir: Path, failed: tuple[int, int | None] | None, interrupts: int, signum: int,
             started: float, finished: bool) -> int:
    """The launcher's last line and exit code: aborted, a failure named, a stop, or 0.
    ``finished``: result.json was written by this launch; a stop that came after it is no stop."""
    if interrupts > 1:
        print("hpc_train: aborted; workers killed", file=sys.stderr)
        return 130
    if failed is not None and not interrupts:
        rank, code = failed
        how = "stopped responding" if code is None else \
            f"signal {signal_name(-code).removeprefix('signal ')}" if code < 0 else f"exit code {code}"
        print(f"hpc_train: worker rank {rank} failed ({how}): {_first_error(run_dir, rank, code)}\n"
              f"hpc_train: full log: {rundir.rank_log(run_dir, rank)}", file=sys.stderr)
        return 1
    if finished:
        # Workers the forwarded stop ended during the code after finish(), or their exit, did
        # not fail the run: it had finished.
        if interrupts:
            print(f"hpc_train: the run had finished (result.json written) when {signal.Signals(signum).name} came; "
                  "nothing to stop", file=sys.stderr)
        return 0
    from hpc_train.records import result, stop
    rec, written = stop.written_since(run_dir, started)
    ended_by_stop = failed is None and written and not result.finished(run_dir)
    if not (interrupts or ended_by_stop):
        return 0
    # A stop that did not come through this launcher (a SIGTERM sent to one worker, a
    # request_stop() in the code) ends the run unfinished too: say so, and exit non-zero.
    if ended_by_stop:
        # A damaged record is said as a stop without its details.
        if rec is not None and rec.checkpoint:
            print(f"hpc_train: checkpoint saved at step {rec.steps}; run the same command to resume", file=sys.stderr)
        elif rec is not None and rec.steps is not None:
            print(f"hpc_train: stopped at step {rec.steps} with checkpoints disabled; nothing was saved",
                  file=sys.stderr)
        else:
            print("hpc_train: stopped before the code reached a step boundary (run.step_end), so hpc_train saved "
                  "nothing this time; run the same command to resume (from the last checkpoint, or from "
                  "whatever the code saved itself)", file=sys.stderr)
    # One code for a stop on every path that can carry it (docs/faults.md): what a program on
    # init() exits with, not 128 + the signal, which a shell reads as "killed" and a user's own
    # code can also produce.
    return EXIT_STOPPED
