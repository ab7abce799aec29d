"""What a script's framework did with the ranks hpc_train started, seen from outside: one line
that names a wrong setting, for the supervisor (:mod:`hpc_train.launch.supervise`) to act on.

hpc_train cannot read a script's ``Trainer(devices=..., num_nodes=..., strategy=...)``. It can
see what they did:

* the process group the framework says it made. Lightning and Fabric log on every rank, as they
  create it, ``Initializing distributed: GLOBAL_RANK: g, MEMBER: g+1/W``: W is devices x
  num_nodes, which must be the world size hpc_train started;
* the processes below the script. One that holds a socket of its own on the rendezvous port
  (``MASTER_PORT``, where every rank of the job meets) is a rank the script started itself
  (``strategy="ddp_spawn"``, ``mp.spawn``), on top of the ranks hpc_train started. A data
  loader's worker is not one: it holds only sockets inherited from the script.

:class:`Watch` keeps what one task's script reported and says the first thing wrong, once.
No torch here (the supervisor adds a process per task, and should add nothing else).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hpc_train.launch import joined
from hpc_train.node.environment import NodeEnv

# Lightning's and Fabric's line (lightning/fabric/utilities/distributed.py, _init_dist_connection).
_MEMBER = re.compile(r"Initializing distributed: GLOBAL_RANK: (\d+), MEMBER: \d+/(\d+)")


@dataclass
class Watch:
    """One task's script, as its supervisor sees it: :meth:`line` for each line it prints,
    :meth:`processes` now and then while it runs. Each returns a one-line diagnosis the first
    time something is wrong, and None otherwise (and ever after)."""

    env: NodeEnv
    reported: set[int] = field(default_factory=set)    # global ranks the script's output named
    said: str | None = None

    def line(self, text: str) -> str | None:
        # finditer: the processes a script started share its output, and their lines can run
        # together on one.
        for m in _MEMBER.finditer(text):
            if self.said is not None:
                break
            rank, world = int(m.group(1)), int(m.group(2))
            self.reported.add(rank)
            if world != self.env.world_size:
                return self._say(_world_size(self.env, world))
            # One script that reports two ranks runs ranks of its own (a lone rank that differs
            # from hpc_train's may be the first of those, so it is no verdict by itself).
            if len(self.reported) > 1:
                return self._say(_spawned(self.env, len(self.reported)))
        return None

    def processes(self, pid: int) -> str | None:
        """Look below the script (process ``pid``) for ranks it started itself: two or more
        processes with sockets of their own on the rendezvous port. One alone is a script that
        runs its training in a child (a wrapper), which is that rank, not one of its own."""
        if self.said is not None:
            return None
        spawned = spawned_ranks(pid, self.env.master_port)
        return self._say(_spawned(self.env, len(spawned))) if len(spawned) >= 2 else None

    def _say(self, msg: str) -> str:
        self.said = msg
        return msg


def _world_size(env: NodeEnv, world: int) -> str:
    if env.source == "local":
        want = f"`devices` must equal --nproc ({env.local_world_size}), and `num_nodes` be 1"
    else:
        want = (f"`devices` must equal the ranks per node ({env.local_world_size}) and `num_nodes` the nodes "
                f"({env.num_nodes})")
    return (f"{want}: Lightning made a process group of {world} (devices x num_nodes) where hpc_train started "
            f"{env.world_size} rank{'s' if env.world_size != 1 else ''}")


def _spawned(env: NodeEnv, n: int) -> str:
    return (f"the script of rank {env.rank} started {n} ranks of its own (Lightning's strategy=\"ddp_spawn\", or "
            f"mp.spawn): hpc_train starts every rank itself, so use strategy=\"ddp\" "
            f"({env.local_world_size} rank{'s' if env.local_world_size != 1 else ''} per node here)")


def spawned_ranks(pid: int, port: int) -> list[int]:
    """Processes below ``pid`` holding a socket on ``port`` (listening on it, or connected to or
    from it) that ``pid`` itself does not hold: ranks it started itself. A forked child shares
    its parent's sockets (same inode): only sockets it opened count."""
    on_port = joined.inodes_on_port(pid, port)
    script = joined.socket_inodes([pid])
    return [c for c in joined.descendants(pid) if (joined.socket_inodes([c]) & on_port) - script]
