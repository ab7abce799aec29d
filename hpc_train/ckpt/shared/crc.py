"""Checksums computed as a checkpoint is written, by the rank and the thread that write the bytes.

:class:`ChecksummingWriter` is DCP's ``FileSystemWriter`` with its file system's write streams
wrapped: every buffer DCP writes (each tensor's ``torch.save`` bytes, ``.metadata``'s pickle)
extends the file's CRC32C and the current item's. DCP asks a stream for its position before
and after each item (``_write_item``: ``offset = stream.tell()``, ``length = tell() - offset``),
so the stream cuts an item's checksum at each ``tell()``; an item whose range is not such a
span (a future DCP that writes otherwise) gets no item checksum, and readers then check its
whole file instead. Each rank's checksums, and those of the files hpc_train writes itself
(:func:`save_pt`), ride to rank 0 as one extra write result, which DCP already gathers there
for ``finish()``; ``finish`` takes them out before DCP's ``.metadata`` is written, so
``.metadata`` stays exactly DCP's.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageWriterTransforms
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from hpc_train.ckpt.checksum import CRC32C, extend, hexdigest

_SUMS = "__hpc_train_checksums__"   # the fqn of the write result that carries a rank's checksums
_METADATA_TMP = ".metadata.tmp"     # what DCP's finish() writes, then renames to .metadata
_PIECE = 1 << 20                    # bytes summed at a time (see _Summing.write)
_SMALL = 64 << 10                   # writes below this are gathered (see _Gathering)


class _Summing:
    """A binary file being written, summed as it goes: the whole file, and each span between
    two ``tell()`` calls."""

    def __init__(self, raw: Any, errors: list[OSError]) -> None:
        self.raw, self.pos, self.crc, self.errors = raw, 0, 0, errors
        self._start, self._span = 0, 0
        self.spans: dict[tuple[int, int], int] = {}

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        try:
            n = self.raw.write(view)
        except OSError as e:     # kept: torch.save's C++ writer would report it as "unexpected pos"
            self.errors.append(e)
            raise
        if n != view.nbytes:
            raise OSError(f"short write: {n} of {view.nbytes} bytes")
        # DCP hands over memoryviews of whole tensors: summed in place (copying a large view costs
        # more than both CRCs together), _PIECE bytes at a time so the second CRC finds them in cache.
        for i in range(0, n, _PIECE):
            piece = view[i:i + _PIECE]
            self.crc = extend(self.crc, piece)
            self._span = extend(self._span, piece)
        self.pos += n
        return n

    def cut(self) -> None:
        if self.pos > self._start:
            self.spans[(self._start, self.pos)] = self._span
        self._start, self._span = self.pos, 0

    def tell(self) -> int:
        self.cut()
        return self.pos

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        self.raw.close()


class _Gathering:
    """What ``torch.save`` of one item writes to, in place of DCP's per-item wrapper: its many
    small writes (zip headers, names, padding: about 30 per tensor) are gathered and reach the
    summing stream as one; a large write (a tensor's bytes) goes straight through, after what
    was gathered. Every write through :class:`_Summing` costs Python calls and two CRC
    extensions, which for a state of many small tensors cost more than the bytes themselves.
    ``close()`` (DCP's ``_write_item`` calls it before it asks the position) hands the rest
    over, leaving the file open for the next item."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.buf = raw, bytearray()

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if view.nbytes >= _SMALL:
            self.flush()
            return self.raw.write(view)
        self.buf += view
        return view.nbytes

    def flush(self) -> None:
        if self.buf:
            buf, self.buf = self.buf, bytearray()
            self.raw.write(buf)

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        self.flush()


class _GatheringTransforms(_StorageWriterTransforms):
    """DCP's stream transforms with none configured (hpc_train configures none): each item's
    stream is a :class:`_Gathering` (DCP builds a wrapper class per item otherwise)."""

    def transform_save_stream(self, write_item: Any, raw_stream: Any) -> tuple[Any, list[str]]:
        if self.extensions:
            return super().transform_save_stream(write_item, raw_stream)
        return _Gathering(raw_stream), []


# The niceness of a background save's writer threads: under contention the training threads get
# the CPU first (CFS weights: nice 10 is ~1/10 of nice 0); an idle core still runs them at full
# speed. Per thread (Linux's setpriority takes a thread id); the training threads keep theirs.
BACKGROUND_NICE = 10


def _lower_this_thread(nice: int) -> None:
    if threading.current_thread() is threading.main_thread():
        return              # a background save never writes from the training thread
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    except (OSError, AttributeError):   # not Linux, or not allowed: the save runs as it is
        pass


class _SummingFS(FileSystem):
    def __init__(self, sink: dict[str, _Summing], nice: int = 0) -> None:
        super().__init__()
        self.sink, self.nice = sink, nice
        self.errors: list[OSError] = []     # what the file system said, e.g. ENOSPC (see write_data)

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as s:
                yield s
            return
        if self.nice:
            _lower_this_thread(self.nice)
        with super().create_stream(path, mode) as raw:
            s = _Summing(raw, self.errors)
            yield s
            s.cut()
            self.sink[Path(path).name] = s     # each file is written by one thread


class ChecksummingWriter(dcp.FileSystemWriter):
    """DCP's file writer, checksumming as it writes (see the module docstring). ``own``: this
    rank's checksums of files it wrote itself (name -> CRC32C), sent to rank 0 with DCP's;
    ``facts``: anything else small and picklable to send to rank 0 along. After the save, on
    rank 0: ``checksums`` (``{"files", "items"}``, for :func:`hpc_train.ckpt.store.write_commit`)
    and ``facts`` (one per rank, in rank order). ``background``: an async save's, whose writer threads yield the CPU to training
    (:data:`BACKGROUND_NICE`)."""

    def __init__(self, path: str, *, own: dict[str, str] | None = None, facts: Any = None,
                 background: bool = False, **kw: Any) -> None:
        super().__init__(path, **kw)
        self._sink: dict[str, _Summing] = {}
        self.fs = _SummingFS(self._sink, BACKGROUND_NICE if background else 0)
        self.transforms = _GatheringTransforms(getattr(self.transforms, "extensions", None))
        self._own, self._facts = dict(own or {}), facts
        self.checksums: dict[str, Any] | None = None
        self.facts: list[Any] = []

    def write_data(self, plan: Any, planner: Any) -> Future[list[WriteResult]]:
        try:
            results = super().write_data(plan, planner).wait()   # DCP's writer returns it done
        except Exception:
            # An item DCP pickles goes through torch.save, whose C++ writer turns the stream's
            # OSError (a full disk) into "enforce fail ... unexpected pos": name the cause.
            if self.fs.errors:
                raise self.fs.errors[0] from None
            raise
        files = {**self._own, **{name: hexdigest(s.crc) for name, s in self._sink.items() if name != _METADATA_TMP}}
        items: dict[str, list[list[Any]]] = {}
        for wr in results:
            info = wr.storage_data
            s = self._sink.get(str(info.relative_path))
            crc = s.spans.get((info.offset, info.offset + info.length)) if s is not None else None
            if crc is not None:
                items.setdefault(str(info.relative_path), []).append([info.offset, info.length, hexdigest(crc)])
        mine = {"rank": self.rank or 0, "files": files, "items": items, "facts": self._facts}
        out: Future[list[WriteResult]] = Future()
        out.set_result([*results, WriteResult(index=MetadataIndex(_SUMS), size_in_bytes=0, storage_data=mine)])
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        ranks = [wr.storage_data for rs in results for wr in rs if wr.index.fqn == _SUMS]
        super().finish(metadata, [[wr for wr in rs if wr.index.fqn != _SUMS] for rs in results])
        files: dict[str, str] = {}
        items: dict[str, list[list[Any]]] = {}
        for r in sorted(ranks, key=lambda r: r["rank"]):
            files.update(r["files"])
            items.update(r["items"])
        meta = self._sink.get(_METADATA_TMP)
        if meta is not None:
            files[".metadata"] = hexdigest(meta.crc)
        self.checksums = {"algorithm": CRC32C, "files": files, "items": items}
        self.facts = [r["facts"] for r in sorted(ranks, key=lambda r: r["rank"])]
