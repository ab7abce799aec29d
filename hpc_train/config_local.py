"""Where the node-local checkpoint tier lives, and the rules of its config (torch-free).

The local tier (:mod:`hpc_train.ckpt.local.tier`) keeps each rank's whole state in its own node's
memory or disk. Its directory is a pure function of the config, the environment, the run directory and two
facts of the process (its parent's pid, the host's name), so that the worker that saves, the one
restarted in place that restores, the launcher and the batch script that remove it, and
``ckpt list`` all name the same path without passing it around::

    BASE/hpc_train-ID/RUN/NODE/rank-R/step-N/     a rank's own items (DCP files, app.pt, rank-R.pt, commit.json)
    BASE/hpc_train-ID/RUN/NODE/copies/rank-R/step-N/  a copy of rank R's item, R on the previous node (hpc_train.ckpt.local.peer)
    BASE/hpc_train-ID/RUN/NODE/.beats/rank-R          a ``--script`` supervisor's heartbeat (hpc_train.node.beats)
    BASE/hpc_train-ID/.alive                          held (a shared flock) by each process that uses the directory

* BASE: ``checkpoint.local_dir``, else ``$SLURM_TMPDIR``, else ``$TMPDIR``, else ``/dev/shm``.
* ID: under ``run``, ``p<launcher pid>``, which the launcher hands its workers (and a
  ``--script``'s supervisors hand their programs) in the environment, so that the launcher removes
  all of it at the end, whoever wrote it; else the Slurm job id (the same across in-place
  restarts, which are new job steps; an array task has a job id of its own); else ``p<parent
  pid>``: torchrun's agent, which outlives the workers it restarts, or a plain ``python
  train.py``'s shell.
  A ``p<PID>`` directory whose process is gone and whose ``.alive`` no process holds is what a
  run killed with -9 left: the next process to use the base removes it (:func:`sweep`).
* RUN: ``run-`` and a digest of the run directory's real path: two runs of one job (two ``srun``
  steps of one allocation) or of one shell keep their items apart, and each removes only its own.
* NODE: ``SLURMD_NODENAME``, else the host name. The local dev cluster's nodes share one disk,
  so a path per node keeps what each "node" holds apart, as real node-local storage would.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shlex
import shutil
import socket
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Protocol

from hpc_train.errors import UsageError

PREFIX = "hpc_train-"
CLEANUP_STEP = "hpc_train-cleanup"   # the cleanup's job step name (sacct tells it from training's steps)
DEFAULT_BASE = "/dev/shm"
COPIES = "copies"   # a buddy's copies beside the node's own (hpc_train.ckpt.local.peer)
BEATS = ".beats"    # a --script's supervisors' heartbeats, where every rank runs on this node (hpc_train.node.beats)
ALIVE = ".alive"    # in BASE/hpc_train-ID: a shared flock held by each process that uses the directory (enter)


class LocalTierConfig(Protocol):
    """The local tier's fields of the CheckpointSection (hpc_train.config, a layer above)."""

    enabled: bool
    local_every_steps: int
    local_every_seconds: float
    local_dir: str
    local_replicas: int


def check(section: LocalTierConfig, nodes: int = 1) -> None:
    """The local tier's rules beyond each field's type and range (the CheckpointSection).
    ``nodes``: job.nodes; copies go to other nodes, so at most nodes - 1 of them (a run on one
    node, such as ``run``, keeps the default 1 and is told once that copies are off)."""
    n = section.local_replicas
    if nodes > 1 and n >= nodes:
        raise UsageError(f"config: checkpoint.local_replicas={n} must be less than job.nodes={nodes} (each copy "
                         f"goes to another node); valid: 0..{nodes - 1}, 0 = no copies")
    d = section.local_dir
    if d and not os.path.isabs(d):
        raise UsageError(f"config: checkpoint.local_dir must be an absolute path or '' (the job's $SLURM_TMPDIR, "
                         f"$TMPDIR or /dev/shm), got {d!r}")
    if d and ("\n" in d or "\0" in d):
        raise UsageError("config: checkpoint.local_dir holds a newline or a NUL byte")


def enabled(section: LocalTierConfig) -> bool:
    """Whether the config asks for the local tier at all (every rank decides the same)."""
    return bool(section.enabled and (section.local_every_steps or section.local_every_seconds))


def base_dir(local_dir: str, env: Mapping[str, str]) -> Path:
    return Path(local_dir or env.get("SLURM_TMPDIR") or env.get("TMPDIR") or DEFAULT_BASE)


def run_id(env: Mapping[str, str], ppid: int, launcher: str | None = None) -> str:
    """ID: ``launcher`` (the ``run`` launcher's, as its workers inherit it), the Slurm job id, or
    ``p<ppid>``."""
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    return launcher or job or f"p{ppid}"


def launcher_id(pid: int) -> str:
    """The ID a ``run`` launcher of process ``pid`` hands its workers."""
    return f"p{pid}"


def run_key(run_dir: Path | str) -> str:
    """RUN: the run directory's real path, as a short digest (a path may hold any character)."""
    return "run-" + hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def node_name(env: Mapping[str, str], hostname: str | None = None) -> str:
    return env.get("SLURMD_NODENAME") or hostname or socket.gethostname()


def job_dir(local_dir: str, env: Mapping[str, str], ppid: int, launcher: str | None = None) -> Path:
    """``BASE/hpc_train-ID``: what the launcher and the batch script remove at the end."""
    return base_dir(local_dir, env) / f"{PREFIX}{run_id(env, ppid, launcher)}"


def as_workers_see(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without Slurm's variables, as the ``run`` launcher's workers get it."""
    return {k: v for k, v in env.items() if not k.startswith("SLURM_")}


def node_dir(job: Path, run_dir: Path | str, env: Mapping[str, str], hostname: str | None = None) -> Path:
    """``BASE/hpc_train-ID/RUN/NODE``: the run's directory on this node, under ``job``."""
    return job / run_key(run_dir) / node_name(env, hostname)


def made_dirs(node: Path) -> tuple[Path, Path, Path]:
    """The directories a node directory's first user makes under BASE (the job's, the run's, the
    node's), parents first: the same ones its last user removes when they are left empty."""
    return node.parent.parent, node.parent, node


def base_of(node: Path) -> Path:
    return node.parent.parent.parent


def rank_dir(node: Path, rank: int) -> Path:
    return node / f"rank-{rank}"


def this_id(launcher: str | None) -> str:
    """This process's tier ID (:func:`run_id` of its environment and parent: a worker's parent is
    its launcher; ``launcher``: the ``run`` launcher's ID from this process's environment, if
    any). The rank record keeps it; the tier's path is built from it."""
    return run_id(os.environ, os.getppid(), launcher)


def this_process(local_dir: str, run_dir: Path | str, launcher: str | None) -> Path:
    """This process's node directory of ``run_dir`` (its ID: :func:`this_id`)."""
    return node_dir(job_dir(local_dir, os.environ, os.getppid(), launcher), run_dir, os.environ)


def remove_empty(node: Path) -> None:
    """The node's, the run's and the job's directories, each once left empty (another rank's,
    another run's items keep theirs); the job's ``.alive`` goes when this process was its last
    holder (:func:`enter`)."""
    job = made_dirs(node)[0]
    fd = _release(job)
    try:
        for d in (node, node.parent):
            with contextlib.suppress(FileNotFoundError):   # another rank of this node removed it first
                d.rmdir()
        if fd >= 0 and os.listdir(job) == [ALIVE]:
            _hold_alone(fd)   # raises while another process holds it
            os.unlink(job / ALIVE)
        job.rmdir()
    except OSError:
        pass   # not empty: what is left is another's
    finally:
        if fd >= 0:
            os.close(fd)


def _hold_alone(fd: int, tries: int = 20) -> None:
    """The job's ``.alive`` held by this process alone, or OSError. Another rank of this node
    leaving at the same moment lets go of its hold within milliseconds (a failed attempt to hold
    it alone drops its shared hold first: flock(2)), so a few tries apart; a process that still
    uses the directory keeps its hold."""
    for i in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if i == tries - 1:
                raise
            time.sleep(0.01)


# What this process holds: job directory -> (its open .alive, how many users in this process).
_held: dict[Path, tuple[int, int]] = {}
_swept: set[Path] = set()


def enter(node: Path, *more: Path) -> str | None:
    """Make the node directory, its parents and ``more`` this user's (:func:`private_dirs`) and
    hold the job directory for the rest of this process's use of it: a shared flock on its
    ``.alive``, which the kernel releases when the process ends, however it ends. First, once per
    base in this process, remove what runs that are gone left there (:func:`sweep`). Returns why a
    directory is not this user's, else None; raises OSError when one cannot be made. Each enter
    is paired with a :func:`remove_empty` of the same node, or with the process's end."""
    base, job = base_of(node), made_dirs(node)[0]
    if base not in _swept:
        _swept.add(base)
        sweep(base)
    for _ in range(3):   # a sweep of a leftover with this ID (its pid reused) may remove it meanwhile
        bad = private_dirs(*made_dirs(node), *more)
        if bad or _hold(job):
            return bad
    raise OSError(errno.ENOENT, f"{job} was removed while this process made it")


def _hold(job: Path) -> bool:
    if job in _held:
        fd, n = _held[job]
        _held[job] = (fd, n + 1)
        return True
    try:
        fd = os.open(job / ALIVE, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)   # a sweeper holds it alone only while it removes a leftover
    except OSError:
        pass   # a file system without flock: a sweep's flock fails there too, and it removes nothing
    try:
        same = os.fstat(fd).st_ino == os.lstat(job / ALIVE).st_ino
    except FileNotFoundError:
        same = False
    if not same:
        os.close(fd)
        return False
    _held[job] = (fd, 1)
    return True


def _release(job: Path) -> int:
    """One user of ``job`` in this process leaves: the open ``.alive`` to close when it was the
    last (-1 while another user here still needs it, or when it was never held)."""
    fd, n = _held.pop(job, (-1, 0))
    if n > 1:
        _held[job] = (fd, n - 1)
        return -1
    return fd


def leftovers(entries: Iterable[tuple[str, bool, int]], uid: int, alive: Callable[[int], bool]) -> list[str]:
    """Of a base's ``entries`` (name, a real directory, its owner), the names that may be what a
    run that is gone left: ``hpc_train-p<PID>`` (an ID a ``run`` launcher, torchrun's agent or a
    shell gave it), a directory of this user, its PID's process gone. A Slurm job's directory is
    its batch script's to remove. Whether a process still uses one is the caller's second check
    (its ``.alive``): a program can outlive the shell it was started from."""
    out = []
    for name, is_dir, owner in entries:
        pid = name[len(PREFIX) + 1:] if name.startswith(PREFIX + "p") else ""
        if is_dir and owner == uid and pid.isdigit() and pid.isascii() and 0 < int(pid) < 1 << 22 \
                and not alive(int(pid)):
            out.append(name)
    return out


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs: not when there is no such process, nor when it is a
    zombie its parent has not reaped yet (it has exited: its files and locks are released).
    Another user's process (EPERM) runs. The one answer for every "is that process gone"."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True   # another user's process (EPERM): alive
    return process_state(pid) != b"Z"


def process_state(pid: int) -> bytes | None:
    """The state letter of process ``pid`` in ``/proc/PID/stat`` (R, S, T, t, Z, ...), read after
    the last ")" (the name may hold any bytes); None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def sweep(base: Path) -> list[Path]:
    """Remove from ``base`` what runs that are gone left (a ``run`` launcher killed with -9, a
    program killed with its shell gone): each of :func:`leftovers` that no process holds (its
    ``.alive`` taken alone here, held while it is removed; never through a symlink). Returns
    what was removed; any names, bytes and file types in ``base`` are taken as they are."""
    try:
        with os.scandir(base) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False), e.stat(follow_symlinks=False).st_uid)
                       for e in it if e.name.startswith(PREFIX)]
    except OSError:
        return []
    removed = []
    for name in leftovers(entries, os.getuid(), pid_alive):
        job = base / name
        try:
            fd = os.open(job / ALIVE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            fd = -1   # written before .alive existed, or by a process killed as it made the directory
        except OSError:
            continue
        try:
            if fd >= 0:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if real_dir(job) is None:
                shutil.rmtree(job, ignore_errors=True)
                removed.append(job)
        except OSError:
            pass   # held: a process still uses it
        finally:
            if fd >= 0:
                os.close(fd)
    return removed


def visible_bases(local_dir: str, env: Mapping[str, str]) -> list[Path]:
    """Where ``ckpt list`` looks for a run's local items from this machine."""
    out: list[Path] = []
    # /tmp too: slurmd sets a job's TMPDIR to its TmpFS (/tmp unless configured), which the shell
    # that runs ``status`` or ``ckpt list`` does not have.
    for b in (local_dir, env.get("SLURM_TMPDIR"), env.get("TMPDIR"), DEFAULT_BASE, "/tmp"):
        if b and Path(b) not in out:
            out.append(Path(b))
    return out


# The allocation's node count now: after a lost node (--no-kill) it is below $SLURM_JOB_NUM_NODES,
# which the batch shell keeps from the start, and an srun that asks for the old count waits forever.
# A failed scontrol (a slow or restarting controller) says nothing, and under the script's
# ``set -e -o pipefail`` must not end the job with its own status.
NODES_NOW = ('hpc_train_nodes=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null '
             "| sed -n 's/.*NumNodes=\\([0-9][0-9]*\\).*/\\1/p' | head -n 1) || hpc_train_nodes=''")


def shell_cleanup(local_dir: str) -> str:
    """The batch script's line that removes the job's local tier on every node of the allocation,
    at the job's end (also before a requeue: a requeued job lands on nodes whose memory holds
    nothing of it), after :data:`NODES_NOW`. ``|| true``: a lost node must not change the job's
    exit status; ``timeout``: nor hold the job's end."""
    base = f"${{0:-${{SLURM_TMPDIR:-${{TMPDIR:-{DEFAULT_BASE}}}}}}}"
    arg = shlex.quote(local_dir) if local_dir else "''"
    return (f'timeout 60 srun --job-name={CLEANUP_STEP} --nodes="${{hpc_train_nodes:-$SLURM_JOB_NUM_NODES}}" '
            f'--ntasks-per-node=1 '
            f"--kill-on-bad-exit=0 bash -c 'rm -rf -- \"{base}/{PREFIX}$SLURM_JOB_ID\"' {arg} >/dev/null 2>&1 || true")


def private_dirs(*dirs: Path) -> str | None:
    """Make each of ``dirs`` (parents first) this user's alone (mode 0700), or find it so: why one
    is not (a symlink another user planted in /dev/shm, another owner's), else None. Raises
    OSError when one cannot be made."""
    for d in dirs:
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            pass
        bad = real_dir(d)
        if bad:
            return bad
    return None


def real_dir(path: Path) -> str | None:
    """Why ``path`` is not a real directory of this user (a symlink, another owner's), else None."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != os.getuid():
        return f"{path} belongs to another user"
    return None
