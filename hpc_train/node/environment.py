"""On-node environment: who am I in this job, and where is the rendezvous?

:func:`derive` is a pure function from an environment mapping to a frozen :class:`NodeEnv`.
Tests hand it dicts; nothing here reads ``os.environ`` except :func:`current`. The sources,
in the order they are tried:

``local``
    workers started by ``python -m hpc_train run`` (``HPC_TRAIN_LAUNCHER=local``).
``torchrun``
    ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set by torchrun (also inside a Slurm job, for the
    torchrun-per-node sbatch variant: torchrun's ranks win, Slurm's ids are kept).
``slurm``
    tasks started by ``srun`` (``SLURM_STEP_ID`` set). A batch script of several tasks that
    runs Python without ``srun`` is an error that says so.
``single``
    a plain ``python`` process: rank 0 of 1.

Must not import torch: ``python -m hpc_train env`` runs on login nodes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from hpc_train import nodelist as nodelist_mod
from hpc_train import rundir
from hpc_train.errors import UsageError, show

# Derived ports live here; below 1024 is privileged, above ~60999 is the usual ephemeral range.
PORT_BASE, PORT_SPAN = 20000, 40000
# Step ids that are not srun tasks. Checked on Slurm 22.05: a batch script has SLURM_PROCID=0 but
# no SLURM_STEP_ID at all (srun tasks get 0, 1, ...). Older or patched Slurms have been seen to
# expose the batch/extern/interactive pseudo-steps (0xfffffffe/0xffffffff before 20.11;
# 0xfffffffb/0xfffffffc/0xfffffffa after), or their names.
_NON_SRUN_STEPS = {"4294967294", "4294967295", "4294967290", "4294967291", "4294967292",
                   "batch", "extern", "interactive"}


@dataclass(frozen=True)
class NodeEnv:
    source: str                 # local | torchrun | slurm | single
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    hosts: tuple[str, ...]
    job_id: str | None = None
    restart_count: int = 0
    array_job_id: str | None = None
    array_task_id: str | None = None
    node_name: str | None = None
    agent_store: bool = False   # torchrun's agent hosts the rendezvous store; workers only join it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def requeue_target(self) -> str | None:
        """What ``scontrol requeue`` must name: the array task, never the whole array."""
        if self.array_job_id and self.array_task_id:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id

    def to_dict(self) -> dict:
        """Every field, plus ``requeue_target`` (what a requeue of this job must name)."""
        return {**dataclasses.asdict(self), "requeue_target": self.requeue_target}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


# Ranks, counts and ids from Slurm and torchrun are unsigned 32-bit at most; a negative one
# would index lists from the end instead of failing.
_INT_MAX = 2**31 - 1


def _int(env: Mapping[str, str], name: str, default: int | None = None, lo: int = 0, hi: int = _INT_MAX) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise UsageError(f"environment: {name} is not set; it is required here "
                             f"(run `python -m hpc_train env` to see what was derived)")
        return default
    # ASCII digits only: int() also takes '1_0', '١٢' and ' 3', none of which Slurm writes.
    text = raw.strip()
    if not re.fullmatch(r"-?[0-9]{1,12}", text) or not lo <= int(text) <= hi:
        raise UsageError(f"environment: {name} must be an integer from {lo} to {hi}, got {name}={show(raw)}")
    return int(text)


def expand_hostlist(nodelist: str) -> list[str]:
    """Slurm's compressed host list (``gpu[001-004,010],login-a``) as a list of names."""
    return nodelist_mod.expand(nodelist)


# The expanded list is built in memory: a corrupt repeat count must fail, not allocate terabytes.
_MAX_NODES = 1_000_000


def parse_tasks_per_node(spec: str, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """``SLURM_TASKS_PER_NODE`` (``2(x3),1``) as one count per node."""
    valid = "Slurm writes N or N(xK) per group of nodes, N and K >= 1, comma-separated (e.g. 2(x3),1)"
    out: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"([0-9]{1,9})(?:\(x([0-9]{1,9})\))?", part.strip())
        if not m:
            raise UsageError(f"environment: cannot parse {name}={show(spec)}; {valid}")
        tasks, repeat = int(m.group(1)), int(m.group(2) or 1)
        if tasks < 1 or repeat < 1:
            raise UsageError(f"environment: {name}={show(spec)} has a count of 0 in {part.strip()!r}; {valid}")
        if len(out) + repeat > _MAX_NODES:
            raise UsageError(f"environment: {name}={show(spec)} describes more than {_MAX_NODES} nodes; {valid}")
        out += [tasks] * repeat
    return out


def derive_port(env: Mapping[str, str], job_id: str | None) -> int:
    """The rendezvous port: same on every rank of a job, different across jobs.

    ``MASTER_PORT`` wins, then the first of Slurm's reserved ports (``--resv-ports``), then a
    port derived from the job id. Consecutive job ids get different ports (a modulus, not a
    hash, so two jobs collide only 40000 ids apart); every array task has its own job id.
    """
    if env.get("MASTER_PORT"):
        return _int(env, "MASTER_PORT", lo=1024, hi=65535)
    resv = env.get("SLURM_STEP_RESV_PORTS")
    if resv:
        m = re.match(r"([0-9]{1,6})", resv)
        if m:
            if not 1 <= int(m.group(1)) <= 65535:
                raise UsageError(f"environment: SLURM_STEP_RESV_PORTS={show(resv)} does not start with a port "
                                 f"(1-65535); Slurm writes e.g. 12000-12003")
            return int(m.group(1))
    if (number := rundir.decimal(job_id or "")) is not None:
        return PORT_BASE + number % PORT_SPAN
    if job_id:  # non-numeric ids (never seen from Slurm, but be total)
        return PORT_BASE + sum(map(ord, job_id)) * 7919 % PORT_SPAN
    return 29500


def _slurm_ids(env: Mapping[str, str]) -> dict:
    return dict(
        job_id=env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"),
        restart_count=_int(env, "SLURM_RESTART_COUNT", 0),
        array_job_id=env.get("SLURM_ARRAY_JOB_ID"),
        array_task_id=env.get("SLURM_ARRAY_TASK_ID"),
        node_name=env.get("SLURMD_NODENAME"),
    )


def _from_rank_vars(env: Mapping[str, str], source: str) -> NodeEnv:
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    local_rank = _int(env, "LOCAL_RANK", 0)
    local_world = _int(env, "LOCAL_WORLD_SIZE", world)
    if not (0 <= rank < world and 0 <= local_rank < local_world <= world):
        raise UsageError(f"environment: inconsistent ranks RANK={rank} WORLD_SIZE={world} "
                         f"LOCAL_RANK={local_rank} LOCAL_WORLD_SIZE={local_world}")
    addr = env.get("MASTER_ADDR") or "127.0.0.1"
    ids = _slurm_ids(env) if env.get("SLURM_JOB_ID") else {}
    if source == "torchrun":
        ids["restart_count"] = ids.get("restart_count", 0) or _int(env, "TORCHELASTIC_RESTART_COUNT", 0)
        ids["agent_store"] = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    hosts = tuple(expand_hostlist(env["SLURM_JOB_NODELIST"])) if env.get("SLURM_JOB_NODELIST") else (addr,)
    return NodeEnv(
        source=source, rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world,
        node_rank=_int(env, "GROUP_RANK", rank // local_world), num_nodes=max(1, world // local_world),
        master_addr=addr, master_port=derive_port(env, None) if env.get("MASTER_PORT") else 29500, hosts=hosts,
        **ids,
    )


def _from_slurm(env: Mapping[str, str]) -> NodeEnv:
    ids = _slurm_ids(env)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise UsageError("environment: SLURM_JOB_NODELIST is not set; this does not look like an srun task "
                         "(start it with `srun python -m hpc_train ...`)")
    hosts = tuple(expand_hostlist(nodelist))
    world = _int(env, "SLURM_STEP_NUM_TASKS", 0) or _int(env, "SLURM_NTASKS")
    rank, local_rank = _int(env, "SLURM_PROCID"), _int(env, "SLURM_LOCALID")
    node_rank = _int(env, "SLURM_NODEID")
    spec_name = "SLURM_STEP_TASKS_PER_NODE" if env.get("SLURM_STEP_TASKS_PER_NODE") else "SLURM_TASKS_PER_NODE"
    per_node_spec = env.get(spec_name)
    per_node = parse_tasks_per_node(per_node_spec, spec_name) if per_node_spec else [world // max(len(hosts), 1)]
    local_world = per_node[node_rank] if node_rank < len(per_node) else per_node[-1]
    if not (0 <= rank < world and 0 <= local_rank < local_world):
        raise UsageError(f"environment: inconsistent Slurm ranks SLURM_PROCID={rank} SLURM_NTASKS={world} "
                         f"SLURM_LOCALID={local_rank} tasks on this node={local_world}")
    return NodeEnv(
        source="slurm", rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world,
        node_rank=node_rank, num_nodes=len(hosts), master_addr=env.get("MASTER_ADDR") or hosts[0],
        master_port=derive_port(env, ids["job_id"]), hosts=hosts, **ids,
    )


def derive(env: Mapping[str, str]) -> NodeEnv:
    """Map an environment (``os.environ`` or a dict) to this process's place in the job."""
    if env.get(rundir.LAUNCHER_ENV) == "local":
        return _from_rank_vars(env, "local")
    if env.get("RANK") is not None and env.get("WORLD_SIZE") is not None:
        return _from_rank_vars(env, "torchrun")
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    if env.get("SLURM_JOB_ID") and env.get("SLURM_PROCID") is not None and step not in (None, *_NON_SRUN_STEPS):
        return _from_slurm(env)
    if env.get("SLURM_JOB_ID"):
        ntasks = _int(env, "SLURM_NTASKS", 1)
        if ntasks > 1:
            raise UsageError(
                f"environment: this Slurm allocation (job {env['SLURM_JOB_ID']}) has {ntasks} tasks but this "
                f"process was not started by srun; run `srun python -m hpc_train ...` so that every task "
                f"gets its rank (or use the script from `python -m hpc_train sbatch`)")
        return NodeEnv(source="single", rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                       num_nodes=1, master_addr="127.0.0.1", master_port=derive_port(env, env["SLURM_JOB_ID"]),
                       hosts=(env.get("SLURMD_NODENAME") or "localhost",), **_slurm_ids(env))
    return NodeEnv(source="single", rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                   num_nodes=1, master_addr="127.0.0.1", master_port=derive_port(env, None),
                   hosts=("localhost",))


def current() -> NodeEnv:
    return derive(os.environ)


def torchrun_vars(env: NodeEnv) -> dict[str, str]:
    """torchrun's variables for this task, whatever launched it: a torchrun-style script reads
    ``LOCAL_RANK`` etc. and must find them under ``srun`` as it does under ``torchrun``."""
    return {"RANK": str(env.rank), "LOCAL_RANK": str(env.local_rank), "WORLD_SIZE": str(env.world_size),
            "LOCAL_WORLD_SIZE": str(env.local_world_size), "GROUP_RANK": str(env.node_rank),
            "MASTER_ADDR": env.master_addr, "MASTER_PORT": str(env.master_port)}


def _address() -> str:
    """This host's address as the other nodes would reach it (for the log; never fatal)."""
    import socket
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "address unknown"


def log_placement(env: NodeEnv) -> None:
    logging.getLogger("hpc_train").info(
        "on-node environment: source=%s rank %d/%d local %d/%d node %d/%d host %s (%s) pid %d job %s restart %d",
        env.source, env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank, env.num_nodes,
        os.uname().nodename, _address(), os.getpid(), env.job_id, env.restart_count)
