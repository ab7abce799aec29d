"""The one sequence before a run trains, on every path. No torch here.

``run`` (before it starts its processes), ``submit`` and sweeps (before anything is queued),
``hpc_train.init()`` in a user's own program, and rank 0 of a plain ``sbatch`` script's job step
(whose config travels inside the script) all call :func:`prelaunch`:

1. the run directory: a path no batch script can carry, or a file in its place, is refused;
2. its lock (when the caller asks: ``run`` holds it for the run, ``submit`` only checks that no
   run holds it, ``init()`` and the job step took it already);
3. the config is compared with the one the run's checkpoints were made with: a change that
   cannot apply to them (another model, optimizer, strategy, a script of another name) is refused
   before anything trains, so a changed model is never trained over its old checkpoints; a
   finished run asked for something else (other script arguments) is refused, not ignored;
4. the resume plan (:func:`hpc_train.ckpt.store.plan`): what to resume from, ``none`` moving
   old checkpoints aside (never deleting them), a finished run said so;
5. the config is written (``RUN_DIR/config.yaml``): from here on it is the run's.

Every refusal is a :class:`~hpc_train.errors.UsageError` raised before anything in the run
directory changed. ``status`` foresees steps 3 and 4 of a rerun with :func:`predict`, the same
code, read-only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_train import config as config_mod
from hpc_train import config_local, rundir
from hpc_train.advice import FLAGS, Advice
from hpc_train.ckpt import compat, store, tiers
from hpc_train.config import Config
from hpc_train.errors import UsageError


def prelaunch(run_dir: Path, cfg: Config, resume: str, *, warn: Callable[[str], None],
              signature: dict[str, Any] | None = None, lock: rundir.RunDirLock | None = None,
              hold: bool = True, verify: bool = True, requeued: bool = False,
              advice: Advice = FLAGS) -> store.ResumePlan:
    """Steps 1-5 of the module docstring; returns the plan (``plan.finished``: the run finished,
    nothing was written). ``lock``: taken here (``hold``: kept on return, else released: a check
    that no run holds it); None when the caller holds it. ``signature``: the model signature the
    checkpoint must match (the built-in trainer's); ``verify``: read the chosen checkpoint's
    checksums now; ``requeued``: a later incarnation of a job (``--resume PATH`` yields to the
    run's own newest checkpoint); ``advice``: a refusal's way out names flags (``--run-dir``),
    else the variables a user's own program takes (``HPC_TRAIN_RUN_DIR``)."""
    run_dir = Path(run_dir)
    rundir.check_path(run_dir, "the run directory")
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"the run directory {run_dir} is a file, not a directory")
    took: rundir.RunDirLock | None = None    # the lock, once this call has taken it
    # A directory that does not exist yet holds nothing to protect: it is made, and locked, only
    # once the checks pass.
    if lock is not None and lock.fd is None and run_dir.is_dir():
        lock.acquire()
        took = lock
    try:
        plan = _decide(run_dir, cfg, resume, signature, warn, verify, requeued, advice)
        if plan.finished:
            if took is not None and not hold:
                took.release()
            return plan
        run_dir.mkdir(parents=True, exist_ok=True)
        if lock is not None and lock.fd is None:
            lock.acquire()
            took = lock
        config_mod.write(cfg, run_dir)
    except BaseException:
        if took is not None:
            took.release()
        raise
    if took is not None and not hold:
        took.release()
    return plan


def _decide(run_dir: Path, cfg: Config | None, resume: str, signature: dict[str, Any] | None,
            warn: Callable[[str], None], verify: bool, requeued: bool, advice: Advice = FLAGS) -> store.ResumePlan:
    """Steps 3 and 4: what a launch decides, and what :func:`predict` foresees of it."""
    if resume != "none" and cfg is not None:
        if store.is_finished(run_dir):
            compat.check_finished(run_dir, cfg, advice)
        compat.check_resume_changes(run_dir, cfg, warn, advice)
    try:
        return store.plan(run_dir, resume, signature, warn=warn, verify=verify, requeued=requeued)
    except store.NoneComplete as e:
        # No complete shared checkpoint, but this node's local tier (hpc_train.ckpt.local.tier) holds
        # this run's work: the restore tries it first, and refuses as this would if it cannot.
        if resume != "latest" or not _local_items_here(run_dir, cfg):
            raise
        warn(f"{e.what}; this node's local checkpoint tier holds newer work: trying it")
        return store.ResumePlan(None)


def _local_items_here(run_dir: Path, cfg: Config | None) -> bool:
    """Whether this process's node directory of the local tier holds a complete item of this run
    (rank 0's: the pre-launch runs on rank 0; every rank's is checked by the restore)."""
    if cfg is None or not config_local.enabled(cfg.checkpoint):
        return False
    ident = tiers.Identity.of(run_dir, cfg.digest())
    return any(i.slot == 0 and not i.copy and i.info.complete and i.why_not(ident) is None
               for i in tiers.on_node(tiers.node_here(cfg.checkpoint.local_dir, run_dir)))


# status reads a checkpoint's checksums (as a rerun would before it starts) only up to this size;
# a bigger one would make a read-only command take seconds per GB.
PREDICT_VERIFY_BYTES = 512 << 20


def predict(run_dir: Path, cfg: Config | None, signature: dict[str, Any] | None = None
            ) -> tuple[store.ResumePlan, bool]:
    """What :func:`prelaunch` decides when the same config runs again with ``--resume latest``
    (the default), changing nothing: no lock, no config written, nothing moved aside (``latest``
    moves nothing; only ``none`` does). Raises the :class:`UsageError` that refuses the rerun.
    ``cfg``: the run's own config.yaml (None when it cannot be read: the rerun has nothing to
    compare its config with either). Returns the plan and whether the chosen checkpoint's
    checksums were read (only up to :data:`PREDICT_VERIFY_BYTES`, else sizes only: the rerun
    then checks them as it loads, and may fall back to an older one)."""
    quick = _decide(Path(run_dir), cfg, "latest", signature, lambda _line: None, False, False)
    if quick.source is None or quick.source.size > PREDICT_VERIFY_BYTES:
        return quick, quick.source is None
    return _decide(Path(run_dir), cfg, "latest", signature, lambda _line: None, True, False), True
