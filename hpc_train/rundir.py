"""The run directory's file names, in one place, and atomic JSON writes. No torch here.

``RUN_DIR/`` holds ``config.yaml`` (the resolved config), ``logs/rank-R.log`` (and
``rank-R.error`` when a rank fails), ``metrics.jsonl``, ``tb/``, ``checkpoints/step-N/``,
``stopped.json`` (the last stop: step, signal, timeline), ``result.json`` (a finished run;
it never trains again), ``requeue.json`` (budgets used), ``job.json`` (the Slurm job) and
``submission.sh`` (its batch script, as submitted).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG = "config.yaml"          # the resolved config
SUBMISSION = "submission.sh"    # the batch script of the last `submit`, as submitted
RESULT = "result.json"          # a finished run: it never trains again
STOPPED = "stopped.json"        # the last stop: step, signal, timeline (node.stops.record_stop)
LOGS = "logs"                   # rank-R.log, rank-R.error, the heartbeats
METRICS = "metrics.jsonl"       # one line per logged step (rank 0)
TB = "tb"                       # TensorBoard events
GOODPUT = "goodput.json"        # where the wall time went (goodput.Ledger)
REQUEUE = "requeue.json"        # requeues per cause (requeue)
REQUEUE_PENDING = "requeue.pending"   # a stop's request, for the batch shell's hook
JOB = "job.json"                # the Slurm jobs of this run (login.scheduler)
SUBMITIT = "submitit"           # submitit's own folder
SWEEP_MANIFEST = "sweep.json"   # a sweep directory's tasks (login.sweep)
CHECKPOINTS = "checkpoints"     # step-N/ directories (ckpt.store)
COMMIT = "commit.json"          # a complete checkpoint's record, written last
APP_STATE = "app.pt"            # a checkpoint's plain values (rank 0)

# What a launcher tells the processes it starts (a script's `hpc_train.init()` reads them).
CONFIG_ENV = "HPC_TRAIN_CONFIG"
RUN_DIR_ENV = "HPC_TRAIN_RUN_DIR"
RESUME_ENV = "HPC_TRAIN_RESUME"          # latest (default), none, or a checkpoint path
LAUNCHER_ENV = "HPC_TRAIN_LAUNCHER"      # "local": started by `run`, which holds the lock
LAUNCHED_AT_ENV = "HPC_TRAIN_LAUNCHED_AT"   # the local launcher's start (goodput's first submit)
LOCK_HELD_ENV = "HPC_TRAIN_LOCK_HELD"    # the pid of this job's process that holds the lock


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace ``path`` in one rename, so a reader (or a kill) never sees half a file. Every
    record in a run directory is written this way, and only this way.

    The temporary file is created new (``O_EXCL``) and never through a symlink (``O_NOFOLLOW``),
    and the rename replaces a symlink at ``path`` instead of writing to where it points: a link
    planted in a run directory cannot make hpc_train overwrite another file.
    """
    import os
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    raw = data.encode() if isinstance(data, str) else data
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:   # left by a process of ours that died mid-write (same pid reused)
        os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: Path, obj: Any) -> None:
    write_atomic(Path(path), json.dumps(obj, indent=2, default=str))


def rank_log(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / LOGS / f"rank-{rank}.log"


def rank_error(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / LOGS / f"rank-{rank}.error"


LOCK = ".lock"
HEARTBEAT_DIR = ".heartbeat"


class RunDirLock:
    """One run directory, one run: an exclusive ``flock`` on ``RUN_DIR/.lock``, held for the run.

    Held by the ``run`` launcher, and by rank 0 of a Slurm job. The kernel drops the lock when
    its holder dies, so a stale lock from a dead process never blocks; the file's content (host,
    pid, what) is only there to name a live holder. Two runs in one directory would resume from
    each other's checkpoints and move each other's saves aside.
    """

    def __init__(self, run_dir: Path, what: str) -> None:
        self.path = Path(run_dir) / LOCK
        self.what = what
        self.fd: int | None = None

    def acquire(self) -> RunDirLock:
        import fcntl
        import os
        import socket
        import time

        from hpc_train.errors import UsageError
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)   # not inherited by child processes
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = self.holder()
            os.close(fd)
            raise UsageError(f"{self.path.parent} is in use by {holder}; wait for it to end, stop it, or use "
                             f"another --run-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "what": self.what,
                                 "since": time.time()}).encode())
        self.fd = fd
        return self

    def holder(self) -> str:
        try:
            h = json.loads(self.path.read_text())
            return f"{h.get('what', 'a run')} (pid {h['pid']} on host {h['host']})"
        except (OSError, ValueError, KeyError, TypeError):
            return "another process"

    def release(self) -> None:
        import os
        if self.fd is not None:
            os.close(self.fd)       # closing drops the flock
            self.fd = None


def heartbeat_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / LOGS / HEARTBEAT_DIR / f"rank-{rank}"


def check_path(path: Path | str, what: str) -> None:
    """Refuse a path that no quoting can carry into a batch script: ``#SBATCH`` lines end at a
    newline, so a newline or other control character in a path cannot be rendered safely."""
    from hpc_train.errors import UsageError
    bad = sorted({repr(c) for c in str(path) if ord(c) < 32 or ord(c) == 127})
    if bad:
        raise UsageError(f"{what} {str(path)!r} contains control characters ({', '.join(bad)}), which cannot go "
                         f"into a batch script; choose a path without them")


def busy(run_dir: Path) -> str | None:
    """Who holds the run directory's lock right now (a live run), or None. Only reads: a shared
    lock taken and dropped on a read-only descriptor (status and dry runs leave the file as it is)."""
    import fcntl
    import os
    lock = RunDirLock(run_dir, "")
    try:
        fd = os.open(lock.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:      # no lock file (never locked), or not a plain file: nothing holds it
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return lock.holder()
    finally:
        os.close(fd)     # closing drops the shared lock
    return None
