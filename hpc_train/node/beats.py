"""Heartbeats: each rank says every :data:`~hpc_train.node.liveness.BEAT_S` seconds that it is
alive, and a watcher reads how long ago each peer last did. Torch only inside :class:`StoreBeats`.

Two channels, one per kind of process:

* :class:`StoreBeats`, every rank of hpc_train's own process group (the built-in trainer, ``--fn``,
  a loop through ``Run``, under ``run``, Slurm, torchrun or a plain launch): a key per rank in
  the rendezvous store (``TCPStore``) every rank is already connected to. The store is the one
  channel that already reaches every rank across nodes, so a watcher on one node learns of a
  peer frozen on another without reading that node's files, and the shared file system gets no
  liveness traffic at all: 4096 ranks beating every 2 s are ~2000 small ``set`` requests a second
  to one store server (a ``TCPStore`` serves tens of thousands), where they were ~2000 metadata
  operations a second on Lustre's or NFS's metadata server (issue 32). On NFS a file's mtime as
  another client sees it may also lag by the attribute-cache time, so an mtime could not be
  trusted across nodes anyway. A beat holds the writer's wall clock; the reader compares it
  with its own, which assumes the nodes' clocks agree within a few seconds (NTP; Slurm's
  munge credentials need that much too).
* :class:`NodeBeats`, a ``--script``'s supervising workers (torch-free: no store to reach) when
  every rank runs on this node (``run``, a one-node job): a file per rank in the job's private
  directory in node memory (:mod:`hpc_train.config_local`), touched; the shared file system sees
  none of it, and the launcher and the batch script remove that directory at the end.
* :class:`FileBeats`, the same supervisors across nodes (a reader on one node cannot see another
  node's memory) and a script that set up its own process group: the rank's record
  (``logs/.heartbeat/rank-R``, :mod:`hpc_train.records.ranks`), touched.

Hazard: a ``TCPStore`` whose server is frozen (rank 0 stopped with SIGSTOP hosts it, unless
torchrun's agent does) blocks every request, with no timeout, even a new connection's (its kernel
still accepts). So reads run on a thread of their own and one is given up after
:data:`~hpc_train.node.liveness.READ_WAIT_S`: the store's host is then the culprit
(:class:`Silent`). That thread lives as long as the heartbeat, and reads one request at a time: a
thread made per read was, now and then, half made when its process was stopped (a thread state
linked in, its thread not yet run), and faulthandler's dump of every thread, which the watchdog asks
of a frozen rank, crashed on it with nothing written past that thread's header. The beating thread
may block the same way; nothing waits on it (it is a daemon, and the fork lock of the file channel
is not taken around it: a data loader's fork would wait as long as the store is frozen).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path

from hpc_train import config_local
from hpc_train.ckpt import tiers
from hpc_train.node import liveness
from hpc_train.records import ranks

log = logging.getLogger("hpc_train")

# Held while the file channel touches its file, and by a fork (data-loader workers fork the
# training process): a child must never be made while that thread is inside a C call that may
# hold an allocator or filesystem lock, which the child would inherit locked and hang on.
_beat_lock = threading.Lock()
os.register_at_fork(before=_beat_lock.acquire, after_in_parent=_beat_lock.release,
                    after_in_child=_beat_lock.release)


class Silent(Exception):
    """The store did not answer: ``host_rank`` is the rank whose process hosts it (None: torchrun's
    agent hosts it, no rank to blame)."""

    def __init__(self, what: str, host_rank: int | None) -> None:
        super().__init__(what)
        self.host_rank = host_rank


class _Beater:
    """A daemon thread that calls ``self._beat()`` every :data:`~hpc_train.node.liveness.BEAT_S`
    seconds until stopped."""

    def __init__(self) -> None:
        self._stop = threading.Event()

    def start(self):
        """Beat once, then every :data:`~hpc_train.node.liveness.BEAT_S` seconds. A reader that only asks for ages (a
        watcher's own ``FileBeats``) never starts, and so never makes a thread."""
        self._beat()
        threading.Thread(target=self._loop, name="hpc_train-heartbeat", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(liveness.BEAT_S):
            self._beat()

    def _beat(self) -> None:
        raise NotImplementedError

    def ages(self, rank_list: list[int], now: float | None = None) -> dict[int, float | None]:
        """Seconds since each rank last beat; None for one that never did."""
        raise NotImplementedError


class FileBeats(_Beater):
    """The rank's record, touched (see the module docstring for who uses it)."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        super().__init__()
        self.run_dir, self.rank = Path(run_dir), rank
        self._path = ranks.path(run_dir, rank)

    def _beat(self) -> None:
        with _beat_lock:
            try:
                ranks.touch(self._path)
            except OSError:      # a full or vanished disk must not kill the task from here
                pass

    def ages(self, rank_list: list[int], now: float | None = None) -> dict[int, float | None]:
        now = time.time() if now is None else now
        return {r: ranks.age(self.run_dir, r, now) for r in rank_list}


class NodeBeats(_Beater):
    """A file per rank in ``node``'s ``.beats`` directory, touched (see the module docstring). A
    rank with no file there is read from its record: one whose directory could not be made
    (another user's symlink in its place, a full memory) beats there instead, said once."""

    def __init__(self, node: Path, run_dir: Path, rank: int) -> None:
        super().__init__()
        self.dir, self.run_dir, self.rank = node / config_local.BEATS, Path(run_dir), rank
        self._path = config_local.rank_dir(self.dir, rank)
        self._instead: FileBeats | None = None

    def start(self):
        try:
            bad = config_local.enter(self.dir.parent, self.dir)
        except OSError as e:
            bad = f"{self.dir} cannot be made ({e.strerror or type(e).__name__})"
        if bad:
            log.warning("heartbeat in node memory: %s; beating on the run directory's files instead", bad)
            self._instead = FileBeats(self.run_dir, self.rank)
        return super().start()

    def _beat(self) -> None:
        if self._instead is not None:
            self._instead._beat()
            return
        with _beat_lock:
            if self._stop.is_set():
                return      # stop() removed the file: a beat now would leave it behind
            try:
                try:
                    os.utime(self._path, follow_symlinks=False)
                except FileNotFoundError:
                    os.close(os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
            except OSError:      # a full memory must not kill the task from here
                pass

    def stop(self) -> None:
        """Beating ends, and this rank's file goes with it, then each directory above it up to the
        job's that is left empty (a local tier's items keep theirs): a job cancelled before its
        batch script's cleanup (its tasks get SIGTERM and end) leaves nothing of the beats in node
        memory. A SIGKILLed supervisor (its ``run`` launcher killed with -9) still leaves its file,
        as the local tier leaves its items. The directories are this user's (``start`` checked them)."""
        super().stop()
        if self._instead is not None:
            return
        with _beat_lock:
            try:
                self._path.unlink()
            except OSError:
                pass
            try:
                self.dir.rmdir()
            except OSError:   # not empty (another rank beats there): kept
                pass
            # Each left empty (a local tier's items keep theirs), and this rank's hold let go.
            config_local.remove_empty(self.dir.parent)

    def ages(self, rank_list: list[int], now: float | None = None) -> dict[int, float | None]:
        now = time.time() if now is None else now
        out: dict[int, float | None] = {}
        for r in rank_list:
            try:
                out[r] = now - os.stat(config_local.rank_dir(self.dir, r), follow_symlinks=False).st_mtime
            except OSError:
                out[r] = ranks.age(self.run_dir, r, now)
        return out


def for_script(env, run_dir: Path, local_dir: str) -> _Beater:
    """A ``--script`` supervisor's heartbeat (started): in node memory when every rank runs on
    this node, else on its record. ``local_dir``: ``checkpoint.local_dir``, where node memory is."""
    if env.local_world_size == env.world_size:
        return NodeBeats(tiers.node_here(local_dir, run_dir), run_dir, env.rank).start()
    return FileBeats(run_dir, env.rank).start()


def script_reader(run_dir: Path, local_dir: str, launcher_pid: int) -> _Beater:
    """What the ``run`` launcher reads its ``--script`` workers' beats with (never started): the
    node directory its workers name from their parent's pid, this process's."""
    env = config_local.as_workers_see(os.environ)
    job = config_local.job_dir(local_dir, env, launcher_pid, config_local.launcher_id(launcher_pid))
    return NodeBeats(config_local.node_dir(job, run_dir, env), run_dir, -1)


class StoreBeats(_Beater):
    """A key per rank in the rendezvous store, through a connection of its own: the process
    group's connection may be held by a long ``wait`` of the main thread (a barrier, a sub-group's
    rendezvous), which would hold the beats up behind it."""

    def __init__(self, addr: str, port: int, rank: int, prefix: str, host_rank: int | None) -> None:
        super().__init__()
        from datetime import timedelta

        import torch.distributed as dist
        self.rank, self.host_rank, self.where = rank, host_rank, f"{addr}:{port}"
        client = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False,
                               use_libuv=True)
        self._store = dist.PrefixStore(prefix, client)
        self._failed = False
        self._asks: queue.SimpleQueue[_Read] = queue.SimpleQueue()
        self._asking = threading.Lock()      # ages() may be called from several threads
        self._last: _Read | None = None
        self._reader: threading.Thread | None = None

    def _beat(self) -> None:
        if self._failed:
            return
        try:
            self._store.set(str(self.rank), repr(time.time()))
        except Exception:  # noqa: BLE001 - the store is gone (its host exited): the run is ending
            self._failed = True

    def ages(self, rank_list: list[int], now: float | None = None) -> dict[int, float | None]:
        deadline = time.monotonic() + liveness.READ_WAIT_S
        with self._asking:
            # A read still out is waited for first: the store answers one request at a time.
            before = self._last
            if before is not None and not before.done.wait(max(0.0, deadline - time.monotonic())):
                raise Silent(f"the rendezvous store at {self.where} did not answer in {liveness.READ_WAIT_S:.0f}s",
                             self.host_rank)
            read = self._last = _Read([str(r) for r in rank_list])
            if self._reader is None:
                self._reader = threading.Thread(target=self._serve, name="hpc_train-beats-read", daemon=True)
                self._reader.start()
            self._asks.put(read)
        if not read.done.wait(max(0.0, deadline - time.monotonic())):
            raise Silent(f"the rendezvous store at {self.where} did not answer in {liveness.READ_WAIT_S:.0f}s",
                         self.host_rank)
        if read.error is not None:
            raise Silent(f"the rendezvous store at {self.where} failed: {str(read.error).splitlines()[0][:200]}",
                         self.host_rank)
        now = time.time() if now is None else now
        vals = read.values
        return {r: max(0.0, now - float(vals[str(r)])) if str(r) in vals else None for r in rank_list}

    def _serve(self) -> None:
        """The reader thread: one read at a time, for as long as the process lives. Not ended by
        :meth:`stop`, which ends the beating: rank 0's Slurm watchdog reads on after its Run
        closed, until the process exits."""
        while True:
            read = self._asks.get()
            try:
                if self._store.check(read.keys):
                    read.values = dict(zip(read.keys, self._store.multi_get(read.keys)))
                else:
                    read.values = {k: self._store.get(k) for k in read.keys if self._store.check([k])}
            except Exception as e:  # noqa: BLE001 - a store that went away
                read.error = e
            read.done.set()


class _Read:
    """One read of the beats' keys, answered by :meth:`StoreBeats._serve`."""

    def __init__(self, keys: list[str]) -> None:
        self.keys, self.done = keys, threading.Event()
        self.values: dict[str, bytes] = {}
        self.error: Exception | None = None


def for_run(env, run_dir: Path, through_store: bool):
    """This rank's heartbeat for a Run (started), or None alone. Through the store when the
    Run's own process group has one to reach (``through_store``: the Run's lifecycle made the
    group, at ``MASTER_ADDR:MASTER_PORT``), else the file."""
    if env.world_size <= 1:
        return None
    if through_store and env.master_addr and env.master_port:
        # torchrun's agent store outlives its attempts: a prefix per attempt, as the group's.
        prefix = f"hpc_train/beats/attempt-{env.restart_count}/" if env.agent_store else "hpc_train/beats/"
        try:
            return StoreBeats(env.master_addr, env.master_port, env.rank, prefix,
                              None if env.agent_store else 0).start()
        except Exception as e:  # noqa: BLE001 - the group just met through this store; say it, beat on files
            log.warning("heartbeats through the rendezvous store failed (%s); beating on the run directory's "
                        "files instead", str(e).splitlines()[0][:200])
    return FileBeats(run_dir, env.rank).start()


def stale(beats: _Beater, rank_list: list[int], limit_s: float, since: float) -> tuple[int, float] | None:
    """The rank whose heartbeat is oldest, if older than ``limit_s``; a rank that has not beaten
    yet counts from ``since`` (the watcher's start). A store that does not answer names its host
    (see :class:`Silent`), as old as the watch itself; with no rank to blame it is raised."""
    now = time.time()
    try:
        ages = beats.ages(rank_list, now)
    except Silent as e:
        if e.host_rank is not None and e.host_rank in rank_list:
            log.warning("%s: its host, rank %d, is frozen or gone", e, e.host_rank)
            return e.host_rank, liveness.READ_WAIT_S      # at least that long: how long it did not answer
        raise
    worst: tuple[int, float] | None = None
    for r in rank_list:
        age = liveness.age(ages[r], now - since)
        if liveness.silent(age, limit_s) and (worst is None or age > worst[1]):
            worst = (r, age)
    return worst
