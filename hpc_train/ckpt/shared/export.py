"""``ckpt export``: a checkpoint's model as one plain ``state_dict`` file."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from hpc_train.ckpt import store
from hpc_train.ckpt.common import why
from hpc_train.ckpt.safe import SafePlanner, SafeReader
from hpc_train.errors import CheckpointError

__all__ = ["CheckpointError", "export"]


def export(path: Path, out: Path, key: str = "model") -> int:
    """The module saved as ``state[key]``, as one consolidated ``state_dict`` with its plain
    parameter names, that ``torch.load(out, weights_only=True)`` reads. The checkpoint is
    verified first, whole (sizes, regular files, every checksum): a damaged one is refused,
    never exported; so is a key with no tensors (never an empty file)."""
    info = store.inspect(Path(path))
    problem = store.verify_checksums(info)
    if problem is not None:
        raise CheckpointError(f"checkpoint {info.label} is damaged: {problem} (`ckpt verify` checks every step; "
                              f"--step N exports another)")
    try:
        reader = SafeReader(str(path))
        meta = reader.read_metadata()
        state: dict[str, Any] = {}
        for fqn, md in meta.state_dict_metadata.items():
            if fqn.startswith(f"{key}.") and hasattr(md, "size"):
                state[fqn] = torch.empty(md.size, dtype=md.properties.dtype)
        if state:
            dcp.load(state, storage_reader=reader, planner=SafePlanner(), no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - one clear line, not a traceback
        raise CheckpointError(f"cannot load checkpoint {info.label}: {why(e)}") from None
    if not state:
        raise CheckpointError(f"checkpoint {info.label} holds no tensors of state[{key!r}]; nothing to export")
    model = {k[len(key) + 1:]: v for k, v in state.items()}
    # The temporary file is opened exclusively: an existing "OUT.tmp" is not ours to overwrite.
    tmp = Path(str(out) + ".tmp")
    try:
        with open(tmp, "xb") as f:
            torch.save(model, f)      # streamed: a model-sized buffer would double the memory
    except FileExistsError:
        raise CheckpointError(f"{tmp} exists (left over from an interrupted export?); remove it first") from None
    except (OSError, RuntimeError) as e:
        # torch's writer reports a full disk as "enforce fail ... unexpected pos": name it.
        if not isinstance(e, OSError) and shutil.disk_usage(tmp.parent).free < (1 << 20):
            e = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        tmp.unlink(missing_ok=True)   # ours (opened exclusively above) and incomplete
        raise CheckpointError(f"cannot write {out}: {why(e)}") from None
    tmp.replace(out)
    return len(model)
