"""Whether a script joined its process group, seen from outside it: torch-free, from ``/proc``.

A torchrun-style script joins through the environment (``init_method='env://'``, the default):
rank 0's store listens on ``MASTER_PORT``, and every rank, rank 0 too, connects to it and keeps
the connection for the life of the group. A script that never reads those variables (another
``init_method``, or no ``init_process_group`` at all) trains alone on every rank: N silent
copies with identical losses. So a rank whose script, or any process under it, holds a TCP
socket with either end on ``MASTER_PORT`` has joined; one that holds none after
:data:`JOIN_WARN_S` is named, once, with a WARNING (every rank's reaches the console). It is a
warning, not a failure: a script may take longer to start, or meet its peers another way.

Sockets are found as the kernel lists them: ``/proc/PID/fd/*`` links read ``socket:[INODE]``,
and ``/proc/PID/net/tcp`` and ``tcp6`` (the script's own network namespace) give each inode's
ports. A process that cannot be read (it ended meanwhile) holds nothing.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping

from hpc_train import rundir

log = logging.getLogger("hpc_train")
# Long enough for torch's import and a rendezvous on a busy node; short enough that two silent
# copies are named in their first minute (tests lower it through rundir.JOIN_WARN_ENV).
JOIN_WARN_S = 60.0
LOOK_EVERY_S = 2.0   # until the join is seen: a script that joined and left early is not named


def warn_after(environ: Mapping[str, str]) -> float:
    """:data:`JOIN_WARN_S`, or the test's value from :data:`rundir.JOIN_WARN_ENV` (a value that is
    not a positive number is ignored: this is no user's setting)."""
    try:
        value = float(environ.get(rundir.JOIN_WARN_ENV, ""))
    except ValueError:
        return JOIN_WARN_S
    return value if 0 < value < float("inf") else JOIN_WARN_S


class JoinWatch:
    """Looks, from the script's start, for its connection to the rendezvous; :meth:`poll` gives
    the warning line once, if none was seen by the deadline. Inert for a single rank."""

    def __init__(self, pid: int, rank: int, world_size: int, addr: str, port: int, after_s: float) -> None:
        self.pid, self.rank, self.addr, self.port, self.after_s = pid, rank, addr, port, after_s
        self.deadline = time.monotonic() + after_s
        self.next_look = time.monotonic() + min(LOOK_EVERY_S, after_s)
        self.done = world_size <= 1

    def poll(self) -> str | None:
        now = time.monotonic()
        if self.done or now < min(self.next_look, self.deadline):
            return None
        self.next_look = now + LOOK_EVERY_S
        if holds_port(self.pid, self.port):
            self.done = True
            log.debug("rank %d joined the process group at %s:%d", self.rank, self.addr, self.port)
            return None
        if now < self.deadline:
            return None
        self.done = True
        return (f"rank {self.rank} has not joined the process group at {self.addr}:{self.port} after "
                f"{self.after_s:.0f} s; is the script reading the environment (init_method='env://')?")


def holds_port(root: int, port: int) -> bool:
    """Whether ``root`` or a process under it holds a TCP socket with either end on ``port``."""
    inodes = socket_inodes([root, *descendants(root)])
    return bool(inodes) and any(i in inodes for i in inodes_on_port(root, port))


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, each before its own children (``/proc/PID/task/*/children``:
    no scan of every process on the node)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:         # gone meanwhile: nothing below it
            continue
        for task in tasks:
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except (OSError, ValueError):
                continue
            out += kids
            todo += kids
    return out


def socket_inodes(pids: Iterable[int]) -> set[int]:
    """The inodes of the sockets the processes ``pids`` hold open."""
    inodes: set[int] = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            # an inode is a 64-bit count: up to 20 digits
            if target.startswith("socket:[") and (inode := rundir.decimal(target[8:-1], 20)) is not None:
                inodes.add(inode)
    return inodes


def inodes_on_port(pid: int, port: int) -> set[int]:
    """Inodes of the TCP sockets (IPv4 and IPv6) with either end on ``port``, in ``pid``'s namespace."""
    found: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            # "sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...",
            # addresses as HEXADDR:HEXPORT.
            fields = line.split()
            if len(fields) < 10:
                continue
            try:
                local, remote, inode = int(fields[1].rpartition(":")[2], 16), int(fields[2].rpartition(":")[2], 16), \
                    int(fields[9])
            except ValueError:
                continue
            if port in (local, remote) and inode:
                found.add(inode)
    return found
