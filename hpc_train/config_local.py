"""Where the node-local checkpoint tier lives, and the rules of its config (torch-free).

The local tier (:mod:`hpc_train.ckpt.local.tier`) keeps each rank's whole state in its own node's
memory or disk. Its directory is a pure function of the config, the environment, the run directory and two
facts of the process (its parent's pid, the host's name), so that the worker that saves, the one
restarted in place that restores, the launcher and the batch script that remove it, and
``ckpt list`` all name the same path without passing it around::

    BASE/hpc_train-ID/RUN/NODE/rank-R/step-N/     a rank's own items (DCP files, app.pt, rank-R.pt, commit.json)
    BASE/hpc_train-ID/RUN/NODE/copies/rank-R/step-N/  a copy of rank R's item, R on the previous node (hpc_train.ckpt.local.peer)
    BASE/hpc_train-ID/RUN/NODE/.beats/rank-R          a ``--script`` supervisor's heartbeat (hpc_train.node.beats)

* BASE: ``checkpoint.local_dir``, else ``$SLURM_TMPDIR``, else ``$TMPDIR``, else ``/dev/shm``.
* ID: under ``run``, ``p<launcher pid>``, which the launcher hands its workers (and a
  ``--script``'s supervisors hand their programs) in the environment, so that the launcher removes
  all of it at the end, whoever wrote it; else the Slurm job id (the same across in-place
  restarts, which are new job steps; an array task has a job id of its own); else ``p<parent
  pid>``: torchrun's agent, which outlives the workers it restarts, or a plain ``python
  train.py``'s shell.
* RUN: ``run-`` and a digest of the run directory's real path: two runs of one job (two ``srun``
  steps of one allocation) or of one shell keep their items apart, and each removes only its own.
* NODE: ``SLURMD_NODENAME``, else the host name. The local dev cluster's nodes share one disk,
  so a path per node keeps what each "node" holds apart, as real node-local storage would.
"""

from __future__ import annotations

import hashlib
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
COPIES = "copies"   # a buddy's copies beside the node's own (hpc_train.ckpt.local.peer)
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
    another run's items keep theirs)."""
    for d in reversed(made_dirs(node)):
        try:
            d.rmdir()
        except OSError:
            break


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
