"""Reading a checkpoint safely: no arbitrary code, only regular files, checked bytes.

* DCP's reader unpickles ``.metadata`` with plain ``pickle`` and byte items with
  ``weights_only=False``. Loading a checkpoint must not run arbitrary code, so the reader
  here allows only DCP's metadata classes, and byte items load with ``weights_only=True``.
* Every file is opened with :func:`hpc_train.ckpt.checksum.open_regular` (no symlinks, no
  FIFOs or devices, which would be read forever).
* Given the commit record's :class:`~hpc_train.ckpt.checksum.Checks`, what is read is checked
  as it is read: ``.metadata`` and the small files whole, DCP's shard files item by item (each
  rank reads only the items it loads), summed in the buffers ``torch.load`` reads them into
  (:class:`~hpc_train.ckpt.checksum.CheckedItem`) and checked when DCP is done with the file,
  before the load returns. A mismatch is the error even when the damaged bytes made
  ``torch.load`` fail first.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, IO

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem

from hpc_train.ckpt.checksum import Checks, open_regular
from hpc_train.ckpt.common import why
from hpc_train.errors import CheckpointError


class _MetadataUnpickler(pickle.Unpickler):
    # Exact (module, name) pairs only. A module prefix is not enough: with pickle protocol 4 a
    # dotted name resolves attribute by attribute, so ("torch.distributed.checkpoint.filesystem",
    # "os.system") would reach os.system; and DCP's modules hold callables that write files or
    # call torch.load(weights_only=False) (tests/cli/test_ckpt_commands.py crafts such a .metadata).
    _ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                ("pathlib", "WindowsPath"), ("collections", "OrderedDict"),
                ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                *(("torch.distributed.checkpoint.metadata", n) for n in (
                    "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                    "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"))}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class _RegularFS(FileSystem):
    def __init__(self, checks: Checks | None) -> None:
        super().__init__()
        self.checks = checks

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "r" not in mode or "+" in mode:
            raise ValueError(f"checkpoint reader opens files for reading only, not {mode!r}")
        with open_regular(Path(path)) as f:
            try:
                yield f
            except Exception:
                if self.checks is not None:
                    self.checks.settle()    # damaged bytes that torch.load choked on: name the damage
                raise
            if self.checks is not None:
                self.checks.settle()        # the items read from f, checked while f is open


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, reading safely (see the module docstring); ``checks``: the commit
    record's checksums, checked as the bytes are read (None: not checked).

    Call :meth:`read_metadata` before handing the reader to ``dcp.load``: it reads and checks
    ``.metadata`` once, and DCP's own call gets that copy. Hazard: when DCP's call fails, DCP logs
    the error with its traceback and tries a rank's own ``__R.metadata``, a file hpc_train never
    writes and no checksum covers (a planted one would be loaded); that read is refused here."""

    def __init__(self, path: str, checks: Checks | None = None) -> None:
        super().__init__(path)
        self.fs = _RegularFS(checks)
        self.checks = checks
        self._metadata: Any = None

    def read_metadata(self, *args: Any, **kwargs: Any):
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.path} has one .metadata for every rank; a rank's own is never read")
        if self._metadata is None:
            path = self._get_metadata_path()
            with self.fs.create_stream(path, "rb") as f:
                data = f.read()
            if self.checks is not None:
                self.checks.data(Path(path).name, data)
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
            if getattr(metadata, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import StorageMeta
                metadata.storage_meta = StorageMeta()
            self._metadata = metadata
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        # DCP reads each item it loads through one slice (torch.load reads the tensor's bytes
        # straight into its storage through it).
        if self.checks is not None:
            item = self.checks.item(str(sinfo.relative_path), file, sinfo.offset, sinfo.length)
            if item is not None:
                return item
        return super()._slice_file(file, sinfo)


class SafePlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # noqa: PLC0415
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_torch_load(path: Path, checks: Checks | None = None) -> Any:
    """One of hpc_train's own files (``app.pt``, ``rank-R.pt``): read whole, checked, then
    ``torch.load(weights_only=True)``. Errors name the file; the caller names the checkpoint."""
    try:
        with open_regular(path) as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"cannot load {path.name}: {e.strerror or e}") from None
    try:
        if checks is not None:
            checks.data(path.name, data)
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 - e.g. a pickle that names a forbidden global
        raise CheckpointError(f"cannot load {path.name}: {why(e)}") from None
