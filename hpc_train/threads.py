"""Threads per rank: ``OMP_NUM_THREADS`` from ``dist.threads_per_rank``, as torchrun sets it. Torch-free.

Ranks that share a node's cores, each with torch's default of one thread per core, oversubscribe
them: a 2-process script ran 7x slower under ``run --script`` than under torchrun, which sets
``OMP_NUM_THREADS=1`` for each worker (when it starts more than one and the variable is unset)
and says so. hpc_train does the same for every rank it starts, with ``dist.threads_per_rank``:

* each task's worker sets the variable before any code of the run imports torch: a ``--script``
  child reads it at its own ``import torch``; the built-in trainer and ``--fn`` also set torch's
  threads from it (:func:`for_torch`), since torch may be loaded already (submitit's worker
  imports what it unpickles);
* the torchrun batch script sets it before torchrun starts, which would otherwise set its own 1
  first, leaving the workers unable to tell it from the user's;
* a value the user set wins (torchrun's rule); ``dist.threads_per_rank: 0`` leaves torch's default.

Said once per launch (rank 0, or the batch shell), not once per rank.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping

VAR = "OMP_NUM_THREADS"


def to_set(environ: Mapping[str, str], threads_per_rank: int) -> int | None:
    """The value hpc_train gives ``OMP_NUM_THREADS`` in ``environ``, or None: the user set it, or
    ``threads_per_rank`` is 0. An empty value counts as unset (OpenMP ignores it, with a complaint)."""
    if threads_per_rank <= 0 or environ.get(VAR, "").strip():
        return None
    return threads_per_rank


def apply(environ: MutableMapping[str, str], threads_per_rank: int) -> int | None:
    """Set ``OMP_NUM_THREADS`` in ``environ`` where :func:`to_set` says so; the value set, or None."""
    n = to_set(environ, threads_per_rank)
    if n is not None:
        environ[VAR] = str(n)
    return n


def line(n: int) -> str:
    """What is said when hpc_train sets the variable (torchrun's warning, shorter)."""
    return f"setting OMP_NUM_THREADS={n} for each rank (dist.threads_per_rank; tune it there, or set OMP_NUM_THREADS)"


def for_torch(environ: Mapping[str, str], threads_per_rank: int) -> int:
    """torch's intra-op threads for this rank (0: leave torch's default): ``OMP_NUM_THREADS``
    where it is set (a count is applied; anything else, an OpenMP list such as ``4,2``, is left
    to OpenMP), else ``threads_per_rank``."""
    raw = environ.get(VAR, "").strip()
    if not raw:
        return threads_per_rank
    return int(raw) if re.fullmatch(r"[0-9]{1,6}", raw) else 0
