"""Process group: backend choice, device binding, rendezvous with a health check, teardown.

Hazards handled here:

* The rendezvous is an explicit ``TCPStore`` so that a failure to reach it can name
  ``MASTER_ADDR:MASTER_PORT`` and say what to check, instead of a bare ``ETIMEDOUT``.
* A long timeout for start-up (nodes boot at different speeds), a shorter one after the
  health check, so a dead rank fails the job within ``dist.timeout_s`` instead of hanging.
* Teardown: with gloo a rank sometimes hung at exit inside ``~ProcessGroupGloo`` when a DDP
  reducer outlived the group. Barrier, drop the model, collect garbage, then destroy
  (shared/notes/torch-stack-facts.md has the counts).
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from hpc_train import threads
from hpc_train.errors import RendezvousError
from hpc_train.config import DistSection
from hpc_train.node.environment import NodeEnv
from hpc_train.records.ranks import node_name

log = logging.getLogger("hpc_train")


def choose_backend(requested: str) -> str:
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        from hpc_train.errors import UsageError
        raise UsageError("config: dist.backend=nccl needs CUDA devices and none are visible here; "
                         "use dist.backend=gloo (or auto)")
    return requested


def bind_device(env: NodeEnv, backend: str, num_threads: int, strategy: str = "ddp") -> torch.device:
    """``num_threads``: torch's intra-op threads (0: torch's default); see :mod:`hpc_train.threads`."""
    if num_threads > 0:
        # Ranks sharing cores each with several threads oversubscribe them: slower than one each.
        torch.set_num_threads(num_threads)
    if backend == "nccl":
        count = torch.cuda.device_count()
        if env.local_rank >= count:
            raise RendezvousError(f"local rank {env.local_rank} has no GPU: this node shows {count} "
                                  f"(ask for --gpus-per-node equal to --tasks-per-node)")
        index = env.local_rank
        if strategy == "split":
            # Each process owns a block of the node's GPUs for its stages; it binds the first.
            from hpc_train.node.strategies import split_base_device
            index = split_base_device(count, env.local_rank, env.local_world_size)
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _store(env: NodeEnv, timeout: timedelta) -> dist.Store:
    if env.world_size == 1:
        return dist.HashStore()   # nothing to meet; no port to collide on
    t0 = time.monotonic()
    try:
        return dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                             is_master=env.rank == 0 and not env.agent_store, timeout=timeout, wait_for_workers=False,
                             use_libuv=True)
    except (RuntimeError, OSError, socket.gaierror) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        waited = time.monotonic() - t0
        if env.rank == 0 and "address already in use" in str(e).lower():
            raise RendezvousError(f"rank 0 cannot listen on port {env.master_port} on {node_name()}: it is "
                                  f"already in use (another job or a leftover process); set MASTER_PORT to a free "
                                  f"port") from None
        raise RendezvousError(
            f"rank {env.rank} could not reach the rendezvous at {env.master_addr}:{env.master_port} (gave up after "
            f"{waited:.0f}s of dist.init_timeout_s={timeout.total_seconds():.0f}s). Check that rank 0 started (its "
            f"log), that '{env.master_addr}' resolves and is reachable from this node (set MASTER_ADDR to a routable "
            f"name or address), and that port {env.master_port} is free and not firewalled (set MASTER_PORT). "
            f"Underlying error: {why}") from None


def _import_behind(names: tuple[str, ...]) -> threading.Thread:
    """Import ``names`` on a thread while this one waits for its peers (the rendezvous runs in
    C++, without the GIL). DDP's constructor imports ``torch._dynamo`` (to read its optimize-ddp
    mode) whatever the model, a slow import that would otherwise sit on a restart's critical
    path. The caller joins the thread before it imports anything else, so two threads never
    import at once."""
    import importlib

    def run() -> None:
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the caller's own import will say what is wrong
                return
    t = threading.Thread(target=run, name="hpc_train-import", daemon=True)
    t.start()
    return t


def init(env: NodeEnv, cfg: DistSection) -> torch.device:
    """Join the job's process group and check it with one small all-reduce."""
    backend = choose_backend(cfg.backend)
    device = bind_device(env, backend, threads.for_torch(os.environ, cfg.threads_per_rank), cfg.strategy)
    ahead = _import_behind(("torch._dynamo",)) if cfg.strategy == "ddp" and env.world_size > 1 else None
    try:
        return _join(env, cfg, backend, device)
    finally:
        if ahead is not None:
            ahead.join()


def _join(env: NodeEnv, cfg: DistSection, backend: str, device: torch.device) -> torch.device:
    # The store also carries sub-group rendezvous (the checkpoint group), so it is kept alive.
    init_timeout = timedelta(seconds=cfg.init_timeout_s)
    store = _store(env, init_timeout)
    if env.agent_store:
        # torchrun's agent keeps one store over its restarts: without a prefix per attempt, a group
        # of a restarted attempt reads the keys of the attempt before (dead peers' addresses) and
        # fails with "Gloo connectFullMesh failed ... Connection refused", most of the time.
        store = dist.PrefixStore(f"hpc_train/attempt-{env.restart_count}/", store)
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size,
                            timeout=init_timeout, **kwargs)
    probe = torch.ones(1, device=device)
    try:
        dist.all_reduce(probe)
    except Exception as e:  # noqa: BLE001 - every backend raises its own type here
        raise RendezvousError(f"health check failed on rank {env.rank}: the first all-reduce over "
                              f"{env.master_addr}:{env.master_port} ({backend}) did not complete: "
                              f"{str(e).splitlines()[0]}. Check that every rank can reach every other "
                              f"(gloo and NCCL open ports beyond MASTER_PORT)") from None
    if int(probe.item()) != env.world_size:
        raise RendezvousError(f"health check: all-reduce gave {probe.item()}, expected {env.world_size}")
    # After start-up a dead peer should fail the job in timeout_s, not init_timeout_s.
    _set_timeout(timedelta(seconds=cfg.timeout_s))
    log.info("process group ready: %s, world %d, rendezvous %s:%d, device %s", backend, env.world_size,
             env.master_addr, env.master_port, device)
    return device


def _set_timeout(timeout: timedelta) -> None:
    try:
        dist.distributed_c10d._set_pg_timeout(timeout)  # private in 2.x; absent in some builds
    except Exception:  # noqa: BLE001 - fall back to the init timeout
        log.debug("could not shorten the process group timeout; keeping the init timeout")


def shutdown(clean: bool = True, destroy: bool = True) -> None:
    """Destroy the group without the gloo exit hang (see the module docstring).

    The caller must drop its own references to DDP-wrapped models first. After an error
    (``clean=False``) there is no barrier: the peers are blocked in some other collective, and
    waiting for them would hang this rank for the whole collective timeout instead of letting
    it exit so the launcher (or srun) can stop the rest. ``destroy=False``: only the barrier;
    the process leaves through ``os._exit`` (hpc_train's worker), which runs no destructor that
    could hang, so the collection and the destroy (a noticeable share of a restart with
    torch._dynamo loaded, between a stop's checkpoint and the requeue) are skipped; :func:`release` does them if it
    must exit normally after all.
    """
    if not dist.is_initialized():
        return
    if not clean:
        return  # process exit releases the group; destroying it could block on the dead peers
    try:
        dist.barrier()
    except Exception:  # noqa: BLE001 - peers may be gone already; destroying is still right
        log.warning("barrier at shutdown failed; peers may have exited")
    if destroy:
        release()


def release() -> None:
    """Collect garbage (no DDP reducer may outlive the group), then destroy the group."""
    if dist.is_initialized():
        gc.unfreeze()   # what start-up made, DDP included, was frozen (see goodput.resume_gc)
        gc.collect()
        dist.destroy_process_group()
