"""Where the node-local checkpoint tier lives, and the rules of its config (torch-free).

The local tier (:mod:`hpc_train.ckpt.local`) keeps each rank's whole state in its own node's
memory or disk. Its directory is a pure function of the config, the environment and two facts
of the process (its parent's pid, the host's name), so that the worker that saves, the one
restarted in place that restores, the launcher and the batch script that remove it, and
``ckpt list`` all name the same path without passing it around::

    BASE/hpc_train-ID/NODE/rank-R/step-N/     a rank's own items (DCP files, app.pt, rank-R.pt, commit.json)
    BASE/hpc_train-ID/NODE/copies/rank-R/step-N/  a copy of rank R's item, R on the previous node (hpc_train.ckpt.peer)
    BASE/hpc_train-ID/NODE/.beats/rank-R          a ``--script`` supervisor's heartbeat (hpc_train.node.beats)

* BASE: ``checkpoint.local_dir``, else ``$SLURM_TMPDIR``, else ``$TMPDIR``, else ``/dev/shm``.
* ID: the Slurm job id (the same across in-place restarts, which are new job steps; an array
  task has a job id of its own), else ``p<parent pid>``: the ``run`` launcher or torchrun's
  agent, which outlive the workers they restart. A plain ``python train.py`` gets its shell's
  pid: a restore also checks the run directory recorded in each item.
* NODE: ``SLURMD_NODENAME``, else the host name. The local dev cluster's nodes share one disk,
  so a path per node keeps what each "node" holds apart, as real node-local storage would.
"""

from __future__ import annotations

import os
import shlex
import socket
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from hpc_train.errors import UsageError

PREFIX = "hpc_train-"
CLEANUP_STEP = "hpc_train-cleanup"   # the cleanup's job step name (sacct tells it from training's steps)
DEFAULT_BASE = "/dev/shm"
COPIES = "copies"   # a buddy's copies beside the node's own (hpc_train.ckpt.peer)
BEATS = ".beats"    # a --script's supervisors' heartbeats, where every rank runs on this node (hpc_train.node.beats)


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


def run_id(env: Mapping[str, str], ppid: int) -> str:
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    return job if job else f"p{ppid}"


def node_name(env: Mapping[str, str], hostname: str | None = None) -> str:
    return env.get("SLURMD_NODENAME") or hostname or socket.gethostname()


def job_dir(local_dir: str, env: Mapping[str, str], ppid: int) -> Path:
    """``BASE/hpc_train-ID``: what the launcher and the batch script remove at the end."""
    return base_dir(local_dir, env) / f"{PREFIX}{run_id(env, ppid)}"


def as_workers_see(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without Slurm's variables, as the ``run`` launcher's workers get it: the launcher
    names their node directories (ID: its own pid) through this."""
    return {k: v for k, v in env.items() if not k.startswith("SLURM_")}


def node_dir(local_dir: str, env: Mapping[str, str], ppid: int, hostname: str | None = None) -> Path:
    return job_dir(local_dir, env, ppid) / node_name(env, hostname)


def rank_dir(node: Path, rank: int) -> Path:
    return node / f"rank-{rank}"


def this_process(local_dir: str) -> Path:
    """This process's node directory (as a worker sees it: its parent is the launcher)."""
    return node_dir(local_dir, os.environ, os.getppid())


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
