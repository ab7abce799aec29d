"""The run directory's layout, its lock, and the one atomic write. No torch here.

``RUN_DIR/`` holds ``config.yaml`` (the resolved config), ``logs/rank-R.log`` (and
``rank-R.error`` when a rank fails), ``metrics.jsonl``, ``tb/``, ``checkpoints/step-N/``,
``submission.sh`` (the batch script, as submitted), and the records of the run's fate, each
with its own owner in :mod:`hpc_train.records` (``result.json``, ``stopped.json``,
``requeue.json``, ``job.json``, the ranks' records) or
:mod:`hpc_train.goodput` (``goodput.json``). This module reads and writes bytes and JSON for
them; what a record means is its owner's.
"""

from __future__ import annotations

import re

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

CONFIG = "config.yaml"          # the resolved config
SUBMISSION = "submission.sh"    # the batch script of the last `submit`, as submitted
LOGS = "logs"                   # rank-R.log, rank-R.error, the heartbeats
METRICS = "metrics.jsonl"       # one line per logged step (rank 0)
TB = "tb"                       # TensorBoard events
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
ATTEMPT_ENV = "HPC_TRAIN_ATTEMPT"        # the batch script's job step in its allocation: 1, 2, ...
BATCH_START_ENV = "HPC_TRAIN_BATCH_START"   # when the batch shell started (its job's own saves are newer)
LOCAL_ID_ENV = "HPC_TRAIN_LOCAL_ID"     # the `run` launcher's ID for its workers' node-local tier (config_local)
LOCAL_STEP_ENV = "HPC_TRAIN_LOCAL_STEP"   # the hook's choice: the next step restores this node-local tier's step
STANDBY_ENV = "HPC_TRAIN_STANDBY"       # "1": a standby task, waiting for its go (launch.standby)
JOIN_WARN_ENV = "HPC_TRAIN_JOIN_WARN_S"  # tests only: when a script that never joined its group is named


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace ``path`` in one rename, so a reader (or a kill) never sees half a file. Every
    record in a run directory is written this way (or through :func:`atomic_writer`), and only
    this way."""
    with atomic_writer(path) as f:
        f.write(data.encode() if isinstance(data, str) else data)


@contextmanager
def atomic_writer(path: Path) -> Iterator[BinaryIO]:
    """A new file, written in pieces, that replaces ``path`` in one rename when the block ends
    without an error (and is removed when it does not): for what is too big to hold whole.

    The temporary file is created new (``O_EXCL``) and never through a symlink (``O_NOFOLLOW``),
    and the rename replaces a symlink at ``path`` instead of writing to where it points: a link
    planted in a run directory cannot make hpc_train overwrite another file.
    """
    import os
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:   # left by a process of ours that died mid-write (same pid reused)
        os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        if path.is_dir() and not path.is_symlink():   # a directory where the record belongs
            set_aside(path, "is a directory, not a record", logging.getLogger("hpc_train").warning)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove_record(path: Path) -> None:
    """Remove a record that no longer applies (a file or a link: never what a link points to); a
    directory in its place is set aside, with one warning, not deleted."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        set_aside(path, "is a directory, not a record", logging.getLogger("hpc_train").warning)
        return
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        logging.getLogger("hpc_train").warning("could not remove %s: %s", path, e.strerror or e)


def rank_log(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / LOGS / f"rank-{rank}.log"


def rank_error(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / LOGS / f"rank-{rank}.error"


LOCK = ".lock"


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

        from hpc_train.errors import RunDirBusy
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_nofollow(self.path, os.O_RDWR | os.O_CREAT)   # not inherited by child processes
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = self.holder()
            os.close(fd)
            raise RunDirBusy(f"{self.path.parent} is in use by {holder}; wait for it to end, stop it, or use "
                             f"another --run-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "what": self.what,
                                 "since": time.time()}).encode())
        self.fd = fd
        return self

    def holder(self) -> str:
        text, _ = read_text(self.path)
        try:
            h = json.loads(text or "")
        except (ValueError, RecursionError):
            h = None
        if not isinstance(h, dict) or "pid" not in h or "host" not in h:
            return "another process"
        return f"{h.get('what', 'a run')} (pid {h['pid']} on host {h['host']})"

    def release(self) -> None:
        import os
        if self.fd is not None:
            os.close(self.fd)       # closing drops the flock
            self.fd = None


def check_path(path: Path | str, what: str) -> None:
    """Refuse a path that no quoting can carry into a batch script: ``#SBATCH`` lines end at a
    newline, so a newline or other control character in a path cannot be rendered safely."""
    from hpc_train.errors import UsageError
    bad = sorted({repr(c) for c in str(path) if ord(c) < 32 or ord(c) == 127})
    if bad:
        raise UsageError(f"{what} {str(path)!r} contains control characters ({', '.join(bad)}), which cannot go "
                         f"into a batch script; choose a path without them")


def busy(run_dir: Path) -> str | None:
    """Who holds the run directory's lock right now (a live run), or None. A probe that writes
    nothing: a read-only open (never through a link: no run can hold one, ``acquire`` refuses
    links) and a shared ``flock``, which fails only while a run holds the exclusive one."""
    import fcntl
    import os
    import stat
    lock = RunDirLock(run_dir, "")
    try:
        fd = os.open(lock.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:      # none, a link, or unreadable: no run holds it
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except OSError:
        return lock.holder()
    finally:
        os.close(fd)     # drops the probe's shared lock


def open_nofollow(path: Path, flags: int) -> int:
    """``os.open`` for writing into a run directory, never through a symbolic link (and never a
    FIFO, device or directory in a record's place): a link planted there cannot make hpc_train
    write to the file it points to. Refused with a :class:`UsageError` naming the file."""
    import os
    import stat

    from hpc_train.errors import UsageError
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        import errno
        if e.errno == errno.ELOOP:
            raise UsageError(f"{path} is a symbolic link; hpc_train never writes through a link in a run directory: "
                             f"remove it, or use another --run-dir") from None
        if e.errno in (errno.ENXIO, errno.EISDIR):
            raise UsageError(f"{path} is not a regular file; remove it, or use another --run-dir") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(f"{path} is not a regular file; remove it, or use another --run-dir")
    return fd


def open_append(path: Path, binary: bool = False):
    """A run-directory log (``metrics.jsonl``, a rank's log) opened for appending, through
    :func:`open_nofollow`."""
    import os
    fd = open_nofollow(Path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    return os.fdopen(fd, "ab" if binary else "a")


_MAX_RECORD = 64 << 20   # a JSON record larger than this is damage, not something to read into memory


def open_read(path: Path) -> tuple[BinaryIO | None, str | None]:
    """A run-directory file opened for reading in pieces, whatever its size (a log,
    ``metrics.jsonl``): (file, None); (None, None) when it does not exist; (None, what is wrong)
    when it cannot be read (a directory, FIFO or link in its place, unreadable)."""
    import os
    import stat
    try:
        # A FIFO must not block the open; a link is not followed (a record is never a link: one
        # planted there could make a run read, and copy, a file that is not its own).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        import errno
        if e.errno == errno.ELOOP:
            return None, "is a symbolic link, which hpc_train does not follow in a run directory"
        return None, f"cannot be read ({e.strerror or type(e).__name__})"
    try:
        mode = os.fstat(fd).st_mode
    except OSError as e:
        os.close(fd)
        return None, f"cannot be read ({e.strerror or type(e).__name__})"
    if not stat.S_ISREG(mode):
        os.close(fd)
        return None, "is a directory, not a file" if stat.S_ISDIR(mode) else "is not a regular file"
    return os.fdopen(fd, "rb"), None


def read_text(path: Path) -> tuple[str | None, str | None]:
    """A run-directory record's text, taking whatever bytes are there: (text, None); (None, None)
    when it does not exist; (None, what is wrong) when it cannot be read (a directory or FIFO
    in its place, unreadable, too large for a record). Bytes that are not UTF-8 become U+FFFD,
    so a reader of lines sees a bad line, not an exception. Logs and metrics, which grow with
    the run, are read in pieces through :func:`open_read` instead."""
    import os
    f, problem = open_read(path)
    if f is None:
        return None, problem
    try:
        with f:
            size = os.fstat(f.fileno()).st_size
            if size > _MAX_RECORD:
                return None, f"is {size} bytes, too large for a record"
            # Read what fstat saw, and more only if it grew since: a read of _MAX_RECORD bytes
            # allocates that much each time (0.1 ms a record, 0.45 s over 4096 ranks' records).
            raw = f.read(size + 1)
            if len(raw) > size:
                raw += f.read(_MAX_RECORD + 1 - len(raw))
    except OSError as e:
        return None, f"cannot be read ({e.strerror or type(e).__name__})"
    return raw.decode("utf-8", errors="replace"), None


# A number as hpc_train writes it into a name (step-12, rank-3.error): ASCII digits, no leading
# zero, at most 18 of them. str.isdigit() and the regex \d also take '²' and '٣', and int()
# refuses the first and a 5000-digit one; a name "step-5\n" matched ^step-(\d+)$.
NAME_NUMBER = r"0|[1-9][0-9]{0,17}"
_NAME_NUMBER = re.compile(NAME_NUMBER)


def name_number(name: str, prefix: str, suffix: str = "") -> int | None:
    """N of a name ``PREFIX N SUFFIX`` spelled as its writer spells it, else None: every reader
    of step and rank names parses them here, one way."""
    if not (name.startswith(prefix) and name.endswith(suffix)) or len(name) < len(prefix) + len(suffix):
        return None
    digits = name[len(prefix):len(name) - len(suffix)]
    return int(digits) if _NAME_NUMBER.fullmatch(digits) else None


def decimal(raw: str, digits: int = 18) -> int | None:
    """A count as a program, Slurm or the kernel writes it (an environment variable, a field of
    sacct's, a cgroup file): ASCII digits only, at most ``digits`` of them, else None. Every reader
    of such a number parses it here: ``str.isdigit()`` is true for '²', which ``int()`` refuses."""
    return int(raw) if 0 < len(raw) <= digits and raw.isascii() and raw.isdigit() else None


def damaged_name(path: Path) -> Path:
    """A free ``NAME.damaged-<time>[-n]`` beside ``path``, for what is set aside from it."""
    import time
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = path.with_name(f"{path.name}.damaged-{stamp}"), 1
    while aside.exists() or aside.is_symlink():
        aside, n = path.with_name(f"{path.name}.damaged-{stamp}-{n}"), n + 1
    return aside


def set_aside(path: Path, problem: str, warn: Callable[[str], None] | None = None) -> Path | None:
    """Move a damaged record out of the way (``NAME.damaged-<time>``), never deleting it, so the
    run goes on without it; ``warn`` gets one line saying so. None if it could not be moved."""
    path = Path(path)
    target = damaged_name(path)
    aside: Path | None = target
    try:
        path.rename(target)
    except OSError:
        aside = None
    if warn is not None:
        where = f"moved to {aside.name}" if aside else "left in place (it could not be moved)"
        warn(f"{path} {problem}; {where}, and the run goes on without it")
    return aside
