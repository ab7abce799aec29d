"""Checksums of a checkpoint's files, and reading only regular files (torch-free).

``commit.json`` records, under ``checksums``, the algorithm, one checksum per file and, for
DCP's shard files, one per storage item (``items``: ``[offset, length, checksum]``). They are
computed by whoever writes the bytes, as they are written (:mod:`hpc_train.ckpt.shared.crc`), never by
reading the files back. Readers check what they read against them (:class:`Checks`): a resume
sums each item it loads in the buffers ``torch.load`` reads it into (:class:`CheckedItem`), so
verifying costs one CRC of bytes already in cache, not a second read or a copy; ``ckpt verify``
and ``ckpt export`` read whole files up front.

CRC32C (the ``crc32c`` package: the CPU's CRC instruction, on any buffer without a copy) is what
new checkpoints record; CRC-32 (``zlib``) is what they recorded before, and records that name it
still verify. A CRC detects every single-bit error and every burst up to 32 bits; it guards
against rot, not against someone who edits ``commit.json`` too (safe loading in :mod:`hpc_train.ckpt.safe` covers that).

Every read goes through :func:`open_regular`: a checkpoint file that is a symlink, a FIFO or a
device is refused instead of read (a FIFO or ``/dev/zero`` would never end).
"""

from __future__ import annotations

import errno
import io
import os
import stat
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

from hpc_train.errors import CheckpointError

CRC32C = "crc32c"          # what new checkpoints record
CRC32 = "crc32"            # what checkpoints recorded before; still verified
ALGORITHMS = (CRC32C, CRC32)
CHUNK = 4 << 20            # read 4 MiB at a time: whole shards would double peak memory


def extend(crc: int, data: ReadableBuffer, algorithm: str = CRC32C) -> int:
    """``crc`` extended by ``data`` (bytes, or any buffer: a memoryview is summed in place)."""
    if algorithm == CRC32:
        return zlib.crc32(data, crc)
    import crc32c
    return crc32c.crc32c(data, crc)


def hexdigest(crc: int) -> str:
    return f"{crc:08x}"


def sum_reads(read: Callable[[int, int], bytes | memoryview], crc: int = 0, algorithm: str = CRC32C,
              length: int | None = None) -> tuple[int, int]:
    """The one read loop of every checksum read from a file: ``crc`` extended by what
    ``read(size, at)`` returns (``at``: the bytes summed so far), :data:`CHUNK` bytes at a time,
    until it returns nothing or ``length`` bytes are summed. Returns (crc, bytes summed)."""
    done = 0
    while length is None or done < length:
        data = read(CHUNK if length is None else min(CHUNK, length - done), done)
        if not data:
            break
        crc = extend(crc, data, algorithm)
        done += len(data)
    return crc, done


class NotRegular(OSError):
    """A checkpoint file that is not a regular file (symlink, FIFO, device, directory)."""


def open_regular(path: Path) -> io.BufferedReader:
    """Open ``path`` for reading only if it is a regular file, never through a symlink.
    ``O_NONBLOCK``: opening a FIFO must not wait for a writer; regular files ignore it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:   # the last component is a symlink
            raise NotRegular(e.errno, "is a symlink, not a regular file") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegular(0, f"is {_kind(mode)}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def regular_problem(path: Path) -> str | None:
    """Why ``path`` (not followed if a symlink) is not a regular file, else None. Raises OSError
    if it cannot be seen at all."""
    mode = os.lstat(path).st_mode
    return None if stat.S_ISREG(mode) else f"is {_kind(mode)}, not a regular file"


def file_checksum(path: Path, algorithm: str = CRC32C) -> str:
    # One buffer read into and summed in place: a new 4 MiB bytes object per chunk made the
    # sum of a 100 MB file in memory about 1.5 times slower (the requeue hook checks the
    # items a restart would load before it restarts).
    view = memoryview(bytearray(CHUNK))
    with open_regular(path) as f:
        return hexdigest(sum_reads(lambda size, _: view[:f.readinto(view[:size])], algorithm=algorithm)[0])


def record_problem(sums: object, files: Mapping[str, object]) -> str | None:
    """What is wrong with a commit record's ``checksums`` field, if anything."""
    if not isinstance(sums, dict) or sums.get("algorithm") not in ALGORITHMS or not isinstance(sums.get("files"), dict):
        return f"checksums is not a {' or '.join(ALGORITHMS)} record"
    if set(sums["files"]) != set(files) or not all(isinstance(v, str) for v in sums["files"].values()):
        return "checksums do not cover exactly the files listed"
    items = sums.get("items", {})
    if not isinstance(items, dict) or not set(items) <= set(files):
        return "checksums has items for files it does not list"
    for name, rows in items.items():
        ok = isinstance(rows, list) and all(
            isinstance(r, list) and len(r) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in r[:2])
            and isinstance(r[2], str) for r in rows)
        if not ok:
            return f"the item checksums of {name} are not [offset, length, checksum] rows"
    return None


class CheckedItem(io.RawIOBase):
    """One storage item of an open shard file (``length`` bytes at ``offset``), read by its
    consumer (``torch.load``) through this object and summed as it is read: each piece is summed
    in the consumer's own buffer right after the read fills it, while it is in cache. Pieces
    that arrive out of order (a zip reader starts at the end) are not summed then; a gap of at
    most ``_GAP`` bytes is summed from the file, and :meth:`verify` sums whatever is left from
    the file: what torch.load used is what was checked, and every byte is summed once in order."""

    _PIECE = 1 << 20    # bytes read (and summed) at a time: a piece is still in cache when summed
    _GAP = 1 << 16      # what a zip reader skips (headers, padding) is read again to be summed

    def __init__(self, checks: Checks, name: str, f: BinaryIO, offset: int, length: int, want: str) -> None:
        super().__init__()
        self.checks, self.name, self.fd = checks, name, f.fileno()
        self.offset, self.length, self.want = offset, length, want
        self.pos = 0        # the consumer's position in the item
        self.done = 0       # bytes [0, done) of the item are summed, in order
        self.crc = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, b: WriteableBuffer) -> int:
        view = memoryview(b).cast("B")
        n = min(view.nbytes, self.length - self.pos)
        got = 0
        while got < n:
            at = self.pos + got
            k = os.preadv(self.fd, [view[got:min(n, got + self._PIECE)]], self.offset + at)
            if k <= 0:
                break       # the file is shorter than the record says: verify() names it
            if self.done < at <= self.done + self._GAP:
                self._sum_from_file(at)
            if at == self.done:
                self.crc = extend(self.crc, view[got:got + k], self.checks.algorithm)
                self.done += k
            got += k
        self.pos += got
        return got

    def readall(self) -> bytes:
        buf = bytearray(max(0, self.length - self.pos))
        return bytes(buf[:self.readinto(buf)])

    def _sum_from_file(self, end: int) -> None:
        # pread: at an offset, leaving the file position that DCP's reader uses alone.
        start = self.offset + self.done
        self.crc, n = sum_reads(lambda size, at: os.pread(self.fd, size, start + at), self.crc,
                                self.checks.algorithm, max(0, end - self.done))
        self.done += n

    def verify(self) -> None:
        """Sum what the consumer did not read in order, and compare; the file must still be open."""
        self._sum_from_file(self.length)
        got = hexdigest(self.crc) if self.done == self.length else f"{self.done} of {self.length} bytes"
        if got != self.want:
            self.checks.fail(f"{self.name} (bytes {self.offset}-{self.offset + self.length})", self.want, got)


class Checks:
    """What one reader checks the bytes it reads against: a commit record's checksums. A record
    without them (saved before they existed) checks nothing; sizes were checked already."""

    def __init__(self, path: Path, record: dict[str, Any]) -> None:
        sums = record.get("checksums") or {}
        self.path = Path(path)
        self.algorithm: str = sums.get("algorithm", CRC32C)
        self.files: dict[str, str] = dict(sums.get("files", {}))
        self.items: dict[str, dict[tuple[int, int], str]] = {
            name: {(r[0], r[1]): r[2] for r in rows} for name, rows in sums.get("items", {}).items()}
        self._whole_done: set[str] = set()
        self._reading: list[CheckedItem] = []

    def fail(self, what: str, want: str, got: str) -> None:
        raise CheckpointError(f"{what} fails its {self.algorithm} check (recorded {want}, read {got})")

    def data(self, name: str, data: bytes) -> None:
        """A whole file, read into memory."""
        want = self.files.get(name)
        if want is not None and (got := hexdigest(extend(0, data, self.algorithm))) != want:
            self.fail(name, want, got)

    def item(self, name: str, f: BinaryIO, offset: int, length: int) -> CheckedItem | None:
        """One storage item of a shard file, to be read through the object returned, which sums
        it as it is read; :meth:`settle` then checks it (before ``f`` is closed). None where the
        record has no checksum for that item: the whole file is then checked, once per reader."""
        want = self.items.get(name, {}).get((offset, length))
        if want is None:
            self._whole(name, f)
            return None
        item = CheckedItem(self, name, f, offset, length, want)
        self._reading.append(item)
        return item

    def settle(self) -> None:
        """Check every item handed out by :meth:`item` since the last call."""
        reading, self._reading = self._reading, []
        for item in reading:
            item.verify()

    def _whole(self, name: str, f: BinaryIO) -> None:
        want = self.files.get(name)
        if want is None or name in self._whole_done:
            return
        f.seek(0)
        if (got := hexdigest(sum_reads(lambda size, _: f.read(size), algorithm=self.algorithm)[0])) != want:
            self.fail(name, want, got)
        self._whole_done.add(name)
