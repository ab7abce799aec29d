"""The wire of the local tier's copies (:mod:`hpc_train.ckpt.local.peer`): one item, rank to rank, over gloo.

Plain bytes, never a pickle: a header (two int64: the manifest's length and the data's), the
manifest (JSON: the sender's node, its commit record, and the files in order) and the files'
bytes in pieces of at most :data:`PIECE` bytes, never crossing a file. The receiver sums every
byte as it writes it and keeps the item only if each file's CRC32C matches the sender's record;
whatever goes wrong on its side (a full disk), it drains the rest of the stream, so the sender
is never left waiting in a send until ``dist.timeout_s``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpc_train.ckpt import store
from hpc_train.ckpt.checksum import CRC32C, extend, hexdigest, open_regular

log = logging.getLogger("hpc_train")
PIECE = 64 << 20        # bytes per message: a whole multi-GB shard in one tensor would double memory
_MANIFEST_MAX = 1 << 24


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]


class Outgoing:
    """An item to send: its commit record and files, read from disk as they go out (a file
    that is damaged there is caught by the receiver's checksums). ``path`` None: nothing."""

    def __init__(self, path: Path | None, node: str) -> None:
        self.path, self.files = path, []
        self.manifest = b""
        if path is None:
            return
        info = store.inspect(path)
        if not info.complete:
            self.path = None
            return
        self.files = [(name, int(size)) for name, size in sorted(info.record["files"].items())]
        self.manifest = json.dumps({"node": node, "record": info.record, "files": self.files}).encode()

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.files)

    def header(self) -> torch.Tensor:
        return torch.tensor([len(self.manifest), self.nbytes], dtype=torch.int64)

    def pieces(self):
        """The files' bytes, piece by piece. A file that cannot be read goes out as zeros of
        its recorded length: the receiver's checksum then fails, and it is not left waiting."""
        for name, size in self.files:
            done = 0
            try:
                with open_regular(self.path / name) as f:
                    while done < size:
                        buf = bytearray(min(PIECE, size - done))
                        if f.readinto(buf) != len(buf):
                            raise OSError(f"{self.path / name} is shorter than its commit record says")
                        done += len(buf)
                        yield torch.frombuffer(buf, dtype=torch.uint8)
            except OSError as e:
                log.warning("cannot send %s to a peer (%s); the peer will refuse it", self.path / name, e)
                while done < size:
                    n = min(PIECE, size - done)
                    done += n
                    yield torch.zeros(n, dtype=torch.uint8)


def _pieces(files: list[tuple[str, int]]) -> list[tuple[int, int]]:
    """(file index, length) of every piece, in order: what sender and receiver both walk."""
    return [(i, min(PIECE, size - at)) for i, (_, size) in enumerate(files) for at in range(0, size, PIECE)]


def manifest(raw: bytes) -> dict:
    """A peer's manifest (JSON it wrote itself, bounded by ``_MANIFEST_MAX``), or an OSError
    saying it is malformed: bytes from another process are parsed like any record."""
    try:
        m = json.loads(raw.decode())
    except (ValueError, RecursionError):    # UnicodeDecodeError is a ValueError
        m = None
    if not (isinstance(m, dict) and "node" in m and isinstance(m.get("record"), dict)
            and isinstance(m.get("files"), list)):
        raise OSError("the item's manifest is malformed")
    return m


class Incoming:
    """An item being received into ``dest`` (``.../step-N``; None: drained and dropped). Written
    into ``step-N.part`` beside it (made new, mode 0700, files opened without following links),
    summed as written, committed and renamed into place by :meth:`finish` only if every file's
    CRC32C matches the sender's record."""

    def __init__(self, m: dict, nbytes: int, dest_parent: Path | None) -> None:
        """``m``: the sender's manifest, as :func:`manifest` parsed it."""
        try:
            self.node, self.record = str(m["node"]), dict(m["record"])
            self.files = [(str(n), int(s)) for n, s in m["files"]]
        except (KeyError, TypeError, ValueError):
            raise OSError("the item's manifest is malformed") from None
        sums = (self.record.get("checksums") or {})
        self.want = dict(sums.get("files", {})) if sums.get("algorithm") == CRC32C else {}
        step = self.record.get("step")
        if not (isinstance(step, int) and step >= 0) or sum(s for _, s in self.files) != nbytes:
            raise OSError("the item's manifest is malformed")
        for name, size in self.files:
            if "/" in name or name in ("", ".", "..", store.COMMIT) or size < 0 or name not in self.want:
                raise OSError(f"the item's manifest lists {name!r}, which is not a checksummed file of an item")
        self.step = step
        self.dest = None if dest_parent is None else dest_parent / f"step-{step}"
        self.part = None if dest_parent is None else dest_parent / f"step-{step}.part"
        self.crcs = [0] * len(self.files)
        self._plan = _pieces(self.files)
        self.fds: dict[int, int] = {}
        self.error: str | None = None
        if self.part is not None:
            try:
                dest_parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                if os.path.lexists(self.part):
                    shutil.rmtree(self.part)
                self.part.mkdir(mode=0o700)
                for i, (name, _) in enumerate(self.files):   # empty files have no piece
                    self.fds[i] = os.open(self.part / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                                          0o600)
            except OSError as e:   # drained all the same: the sender must not be left waiting
                self.error = f"cannot write under {dest_parent} ({e.strerror or type(e).__name__})"

    def sizes(self) -> list[int]:
        return [n for _, n in _pieces(self.files)]

    def take(self, index: int, buf: torch.Tensor) -> None:
        i = self._plan[index][0]
        view = memoryview(buf.numpy())
        self.crcs[i] = extend(self.crcs[i], view)
        if self.error is None and i in self.fds:
            try:
                _write_all(self.fds[i], view)
            except OSError as e:   # a full disk: drain the rest, so the sender is not left waiting
                self.error = f"cannot write {self.files[i][0]} ({e.strerror or type(e).__name__})"

    def finish(self, extra: dict[str, Any]) -> Path | None:
        """Check every file against the sender's checksums, commit and rename into place.
        Returns the item's path (None when dropped); a mismatch raises and leaves nothing."""
        for fd in self.fds.values():   # not fsync'd, as the holder's own items (hpc_train.ckpt.local.tier)
            os.close(fd)
        self.fds = {}
        bad = [name for i, (name, _) in enumerate(self.files) if hexdigest(self.crcs[i]) != self.want[name]]
        if self.part is None:
            return None
        if self.error is not None:
            shutil.rmtree(self.part, ignore_errors=True)
            raise OSError(self.error)
        if bad:
            shutil.rmtree(self.part, ignore_errors=True)
            raise OSError(f"{', '.join(bad)} failed the crc32c check on arrival from {self.node}")
        record = {k: v for k, v in self.record.items() if k not in ("files", "checksums")}
        sums = {"files": {name: hexdigest(self.crcs[i]) for i, (name, _) in enumerate(self.files)}}
        store.write_commit(self.part, {**record, **extra}, sums=sums, warn=log.warning, durable=False)
        if os.path.lexists(self.dest):
            shutil.rmtree(self.dest)
        os.rename(self.part, self.dest)
        return self.dest

    def abandon(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}
        if self.part is not None:
            shutil.rmtree(self.part, ignore_errors=True)


def _wait(works) -> None:
    for w in works:
        w.wait()


def swap(group, out: Outgoing | None, dst: int | None, src: int | None,
         dest_parent) -> Incoming | None:
    """Send ``out`` to ``dst`` while receiving from ``src`` (either may be None), in lockstep:
    each phase posts its send and its receive before waiting on either, so a ring of ranks
    that all do this at once cannot deadlock. ``dest_parent(manifest)``: where the received
    item goes (None: drained and dropped). Returns the received item, not yet finished. Every
    tensor sent is held in a local until its send is waited on (gloo reads it until then)."""
    works, head = [], torch.zeros(2, dtype=torch.int64)
    h_out = out.header() if out is not None else torch.zeros(2, dtype=torch.int64)
    if dst is not None:
        works.append(dist.isend(h_out, dst, group))
    if src is not None:
        works.append(dist.irecv(head, src, group))
    _wait(works)
    m_len, n_in = (int(head[0]), int(head[1])) if src is not None else (0, 0)
    if m_len > _MANIFEST_MAX:
        raise OSError(f"rank {src} announced a manifest of {m_len} bytes")
    sending = dst is not None and out is not None and out.path is not None
    works, m_in = [], torch.empty(m_len, dtype=torch.uint8)
    m_out = torch.frombuffer(bytearray(out.manifest), dtype=torch.uint8) if sending else None
    if sending:
        works.append(dist.isend(m_out, dst, group))
    if m_len:
        works.append(dist.irecv(m_in, src, group))
    _wait(works)
    inc = None
    if m_len:
        m = manifest(bytes(m_in.numpy()))
        inc = Incoming(m, n_in, dest_parent(m))
    outs = out.pieces() if sending else iter(())
    sizes = inc.sizes() if inc is not None else []
    try:
        i, more_out = 0, sending and out.nbytes > 0
        while more_out or i < len(sizes):
            works, buf = [], None
            if more_out:
                piece = next(outs, None)
                if piece is None:
                    more_out = False
                else:
                    works.append(dist.isend(piece, dst, group))
            if i < len(sizes):
                buf = torch.empty(sizes[i], dtype=torch.uint8)
                works.append(dist.irecv(buf, src, group))
            _wait(works)
            if buf is not None:
                inc.take(i, buf)
                i += 1
    except BaseException:
        if inc is not None:
            inc.abandon()
        raise
    return inc


