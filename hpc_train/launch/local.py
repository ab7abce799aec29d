"""``python -m hpc_train run``: N worker processes on this machine, no Slurm.

Each worker is ``python -m hpc_train worker`` with torchrun-style variables plus
``HPC_TRAIN_LAUNCHER=local``, so it takes exactly the on-node path of a Slurm task.

Signals: workers run in their own session, so a terminal's Ctrl-C reaches only this process,
which decides what they get. The first Ctrl-C (or a SIGTERM) is forwarded as SIGTERM: every
rank finishes its step, saves, and exits. A second Ctrl-C kills them at once.

Failure: when one worker exits non-zero, the others are stopped (SIGTERM, then SIGKILL after a
grace period) and the first failure is shown with its error and log path.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from hpc_train.errors import says_peer_lost

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


def _spawn(nproc: int, config_path: Path, run_dir: Path, resume: str, port: int) -> list[subprocess.Popen]:
    from hpc_train.goodput import process_start_time
    launched = f"{process_start_time():.3f}"   # the goodput ledger counts start-up from here
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, HPC_TRAIN_LAUNCHER="local", HPC_TRAIN_LAUNCHED_AT=launched, RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1",
                   HPC_TRAIN_RESUME=resume)
        # Slurm variables would make a worker think it is a Slurm task of some other job.
        for k in [k for k in env if k.startswith("SLURM_")]:
            del env[k]
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "hpc_train", "worker", "--config", str(config_path), "--run-dir", str(run_dir)],
            env=env, start_new_session=True))
    return procs


def _signal_all(procs: list[subprocess.Popen], sig: int) -> None:
    """SIGTERM goes to the worker only (it stops its loader's processes itself); SIGKILL goes
    to its whole process group, so no data-loader process is left behind."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig) if sig == signal.SIGKILL else os.kill(p.pid, sig)
            except ProcessLookupError:
                pass


def _first_error(run_dir: Path, rank: int) -> str:
    """The error's first paragraph (a script's failure: rank, host and its last lines; a
    Python error: its one-line summary, not the traceback under it)."""
    err = run_dir / "logs" / f"rank-{rank}.error"
    try:
        text = err.read_text().split("\n\n")[0].strip()
    except OSError:
        text = ""
    return text or "its error could not be recorded (a full or read-only disk?): see its lines above"


def _culprit(run_dir: Path, ranks: list[int]) -> int:
    """Among ranks seen failing in the same poll, the one that caused it: a rank whose error
    says a peer went away is a victim of another rank's death."""
    for rank in ranks:
        if not says_peer_lost(_first_error(run_dir, rank)):
            return rank
    return ranks[0]


def _name_frozen(run_dir: Path, procs: list[subprocess.Popen], rank: int, age: float) -> None:
    """Say which rank froze, and have every rank write its stack (the frozen one once continued)."""
    from hpc_train.node import watchdog
    msg = watchdog.describe(run_dir, rank, age)
    print(f"hpc_train: {msg}; ending the run", file=sys.stderr, flush=True)
    from hpc_train.rundir import write_atomic
    write_atomic(run_dir / "logs" / f"rank-{rank}.error", f"WatchdogError: {msg}\n")
    _signal_all(procs, watchdog.DUMP_SIGNAL)
    _signal_all(procs, signal.SIGCONT)
    time.sleep(1.0)


def launch(nproc: int, config_path: Path, run_dir: Path, resume: str = "latest", port: int | None = None,
           hang_s: float = 600.0) -> int:
    """Start, supervise and reap the workers. Returns the exit code for the CLI.

    ``hang_s`` (``dist.timeout_s``): a rank whose heartbeat is older than this has stopped
    responding (see :mod:`hpc_train.watchdog`); it is named, every rank writes its stack, and
    the run ends."""
    from hpc_train.node import watchdog
    for stale in (run_dir / "logs").glob("rank-*.error"):
        stale.unlink()
    started = time.time()
    procs = _spawn(nproc, config_path, run_dir, resume, rendezvous_port() if port is None else port)
    interrupts = {"n": 0, "sig": 0}
    next_check = time.monotonic() + 1.0

    def on_signal(signum: int, frame: object) -> None:
        interrupts["n"] += 1
        interrupts["sig"] = interrupts["sig"] or signum
        if interrupts["n"] == 1:
            print(f"\nhpc_train: {signal.Signals(signum).name}: asking every rank to stop after its "
                  f"current step (press Ctrl-C again to abort at once)", file=sys.stderr, flush=True)
            _signal_all(procs, signal.SIGTERM)
        else:
            _signal_all(procs, signal.SIGKILL)

    # SIGHUP: the terminal closed. Workers live in their own sessions, so without this they would
    # train on as orphans; it stops them like the first Ctrl-C.
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        failed: tuple[int, int] | None = None
        deadline = None
        # Poll every worker on every tick (not `any(p.poll() ...)`, which stops at the first one
        # still running: rank 1's death went unseen for as long as rank 0 lived).
        while [p.poll() for p in procs].count(None):
            if failed is None:
                dead = [rank for rank, p in enumerate(procs) if p.returncode not in (None, 0)]
                if dead:
                    # A peer that froze makes the others fail in their collectives: name it, not them.
                    alive = [r for r, p in enumerate(procs) if p.poll() is None]
                    frozen = watchdog.stale(run_dir, alive, 3 * watchdog.BEAT_S, started)
                    rank = _culprit(run_dir, dead) if frozen is None else frozen[0]
                    failed = (rank, procs[rank].returncode if frozen is None else None)
                    if frozen is not None:
                        _name_frozen(run_dir, procs, *frozen)
                    _signal_all(procs, signal.SIGTERM)
                    deadline = time.monotonic() + GRACE_S
            if failed is None and time.monotonic() >= next_check:
                next_check = time.monotonic() + 1.0
                alive = [rank for rank, p in enumerate(procs) if p.poll() is None]
                hung = watchdog.stale(run_dir, alive, watchdog.limit_for(hang_s), started)
                if hung is not None:
                    _name_frozen(run_dir, procs, *hung)
                    failed = (hung[0], None)
                    _signal_all(procs, signal.SIGTERM)
                    deadline = time.monotonic() + HUNG_GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                _signal_all(procs, signal.SIGKILL)
            time.sleep(0.05)
        if failed is None:
            dead = [rank for rank, p in enumerate(procs) if p.returncode != 0]
            if dead:
                rank = _culprit(run_dir, dead)
                failed = (rank, procs[rank].returncode)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        from hpc_train.goodput import exited, process_start_time
        exited(run_dir, process_start_time())
    if interrupts["n"] > 1:
        print("hpc_train: aborted; workers killed", file=sys.stderr)
        return 130
    if failed is not None and not interrupts["n"]:
        rank, code = failed
        how = "stopped responding" if code is None else \
            f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        print(f"hpc_train: worker rank {rank} failed ({how}): {_first_error(run_dir, rank)}\n"
              f"hpc_train: full log: {run_dir / 'logs' / f'rank-{rank}.log'}", file=sys.stderr)
        return 1
    stopped = run_dir / "stopped.json"
    ended_by_stop = failed is None and stopped.exists() and stopped.stat().st_mtime >= started and \
        not (run_dir / "result.json").exists()
    if interrupts["n"] or ended_by_stop:
        # A stop that did not come through this launcher (a SIGTERM sent to one worker, a
        # request_stop() in the code) ends the run unfinished too: say so, and exit non-zero.
        if ended_by_stop:
            from hpc_train.rundir import read_json
            rec = read_json(stopped)[0] or {}   # damaged: said as a stop without its details
            if rec.get("checkpoint"):
                print(f"hpc_train: checkpoint saved at step {rec.get('steps')}; run the same command to resume",
                      file=sys.stderr)
            elif rec.get("steps") is not None:
                print(f"hpc_train: stopped at step {rec['steps']} with checkpoints disabled; nothing was saved",
                      file=sys.stderr)
            else:
                print("hpc_train: stopped before the code reached a step boundary (run.step_end), so hpc_train saved "
                      "nothing this time; run the same command to resume (from the last checkpoint, or from "
                      "whatever the code saved itself)", file=sys.stderr)
        return 128 + (interrupts["sig"] or signal.SIGTERM)
    return 0
