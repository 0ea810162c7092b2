"""Write a wheel by copying most members of another one byte-for-byte.

``zipfile`` can only write what it compresses itself, so re-packing a 244 MB
wheel would inflate and deflate 520 MB of kernels. Here a member that does
not change is copied as its stored (compressed) bytes under a fresh local
header; only new or changed members are deflated. Zip64 is not needed for
vLLM wheels and is refused rather than written wrong.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import mmap
import os
import struct
import zipfile
import zlib
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .errors import ArchiveError, BuildError

_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_END = struct.Struct("<4sHHHHIIH")
_LOCAL_SIG = b"PK\x03\x04"
_CENTRAL_SIG = b"PK\x01\x02"
_END_SIG = b"PK\x05\x06"
_ZIP32_MAX = 0xFFFFFFFF
_UTF8_FLAG = 0x800
#: Members at least this large are copied by the kernel (copy_file_range).
_KERNEL_COPY_MIN = 1 << 20
#: copy_file_range's ways of saying "not here" (old kernels, other filesystems).
_NO_KERNEL_COPY = {errno.ENOSYS, errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}


def record_hash(data: bytes) -> str:
    """A RECORD hash field: ``sha256=`` and the urlsafe base64 digest without padding."""
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def dos_datetime(epoch: int) -> tuple[int, int, int, int, int, int]:
    """A zip date_time for ``epoch`` (UTC), clamped to 1980, the earliest zip can hold."""
    import time

    t = time.gmtime(max(epoch, 315532800))
    return (t.tm_year, t.tm_mon, t.tm_mday, t.tm_hour, t.tm_min, t.tm_sec)


@dataclass(frozen=True)
class NewMember:
    """A member whose bytes we provide (deflated on write)."""

    name: str
    data: bytes
    date_time: tuple[int, int, int, int, int, int]
    external_attr: int = 0o100644 << 16


@dataclass(frozen=True)
class CopiedMember:
    """A member of the source wheel copied as stored, possibly under a new name."""

    name: str
    source: zipfile.ZipInfo


Member = NewMember | CopiedMember


class _HashingWriter:
    """Counts and hashes every byte written, so the output needs no second read.

    Hashing runs on a worker thread (hashlib releases the GIL on large
    buffers), in write order, while the main thread goes on copying.
    """

    _BATCH = 1 << 20

    def __init__(self, out: BinaryIO, pool: ThreadPoolExecutor) -> None:
        self._out = out
        self._pool = pool
        self._last: Future | None = None
        self._pending = bytearray()
        self.offset = 0
        self._sha256 = hashlib.sha256()

    def write(self, data: bytes) -> None:
        self._out.write(data)
        self.offset += len(data)
        # Small writes (headers) are batched: a task per header would cost more
        # than hashing it. Large blocks go to the worker as they are.
        if len(data) >= self._BATCH:
            self._flush()
            self._last = self._pool.submit(self._sha256.update, data)
            return
        self._pending += data
        if len(self._pending) >= self._BATCH:
            self._flush()

    def copy_range(self, src_fd: int, start: int, size: int, view: memoryview) -> None:
        """Append ``size`` bytes of the source at ``start``; ``view`` is those bytes (mmap).

        The kernel copies file to file (``copy_file_range``, as ``cp`` does) and
        the digest reads the mapped source, so the bytes never pass through a
        Python buffer.
        """
        self._flush()
        self._out.flush()
        out_fd = self._out.fileno()
        done = 0
        try:
            while done < size:
                copied = os.copy_file_range(src_fd, out_fd, size - done, start + done)
                if copied == 0:
                    raise ArchiveError("source wheel is truncated")
                done += copied
        except OSError as e:
            if e.errno not in _NO_KERNEL_COPY:
                raise  # a full disk or a size limit is an error, not a reason to retry
            # Filesystems or kernels without copy_file_range: plain writes.
            self._out.write(view[done:size])
        self._last = self._pool.submit(self._sha256.update, view)
        self.offset += size

    def _flush(self) -> None:
        if self._pending:
            self._last = self._pool.submit(self._sha256.update, bytes(self._pending))
            self._pending = bytearray()

    def hexdigest(self) -> str:
        self._flush()
        if self._last is not None:
            self._last.result()
        return self._sha256.hexdigest()


def _dos(date_time: tuple[int, ...]) -> tuple[int, int]:
    year, month, day, hour, minute, second = date_time
    return (hour << 11) | (minute << 5) | (second // 2), ((year - 1980) << 9) | (month << 5) | day


def read_member(wheel: zipfile.ZipFile, name: str) -> bytes:
    try:
        return wheel.read(name)
    except KeyError:
        raise BuildError(f"{wheel.filename}: has no member {name}") from None
    except (zipfile.BadZipFile, zlib.error) as e:
        raise ArchiveError(f"{wheel.filename}: member {name} is corrupt ({e})") from None


def open_wheel(path: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise ArchiveError(f"{path.name}: not a readable wheel ({e})") from None


def _data_offset(src: BinaryIO, info: zipfile.ZipInfo) -> int:
    src.seek(info.header_offset)
    header = src.read(_LOCAL.size)
    if len(header) != _LOCAL.size or header[:4] != _LOCAL_SIG:
        raise ArchiveError(f"{info.filename}: bad local header at offset {info.header_offset}")
    fields = _LOCAL.unpack(header)
    return info.header_offset + _LOCAL.size + fields[9] + fields[10]


def write_wheel(target: BinaryIO, source_path: Path, members: Iterable[Member]) -> str:
    """Write ``members`` in order as a zip to ``target``; return the output's sha256."""
    # One worker: digest updates must stay in write order.
    with ThreadPoolExecutor(max_workers=1) as pool:
        return _write(_HashingWriter(target, pool), source_path, members)


def _write(out: _HashingWriter, source_path: Path, members: Iterable[Member]) -> str:
    central: list[bytes] = []
    with open(source_path, "rb") as src:
        mm = mmap.mmap(src.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            return _write_members(out, src, memoryview(mm), members, central)
        finally:
            # On a failure its traceback still holds slices of the map, which is
            # then unmapped when they go; the failure itself must surface.
            with contextlib.suppress(BufferError):
                mm.close()


def _write_members(
    out: _HashingWriter,
    src: BinaryIO,
    source: memoryview,
    members: Iterable[Member],
    central: list[bytes],
) -> str:
    for member in members:
        name = member.name.encode("utf-8")
        if isinstance(member, CopiedMember):
            info = member.source
            method, crc = info.compress_type, info.CRC
            csize, usize = info.compress_size, info.file_size
            date_time, attr = info.date_time, info.external_attr
            start = _data_offset(src, info)
        else:
            data = member.data
            compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
            payload = compressor.compress(data) + compressor.flush()
            method, crc = zipfile.ZIP_DEFLATED, zlib.crc32(data)
            csize, usize = len(payload), len(data)
            date_time, attr = member.date_time, member.external_attr
        if max(csize, usize, out.offset) >= _ZIP32_MAX:
            raise BuildError(f"{member.name}: needs zip64, which this writer does not do")
        flags = _UTF8_FLAG if not member.name.isascii() else 0
        dos_time, dos_date = _dos(date_time)
        offset = out.offset
        # The fields local and central headers share, in their common order.
        shared = (flags, method, dos_time, dos_date, crc, csize, usize, len(name))
        out.write(_LOCAL.pack(_LOCAL_SIG, 20, *shared, 0) + name)
        if isinstance(member, CopiedMember):
            if start + csize > len(source):
                raise ArchiveError(f"{member.name}: source wheel is truncated")
            data_view = source[start : start + csize]
            if csize >= _KERNEL_COPY_MIN:
                out.copy_range(src.fileno(), start, csize, data_view)
            else:
                # Small members: one buffered write beats a system call pair.
                out.write(data_view)
        else:
            out.write(payload)
        central.append(
            _CENTRAL.pack(_CENTRAL_SIG, (3 << 8) | 20, 20, *shared, 0, 0, 0, 0, attr, offset) + name
        )
    directory_offset = out.offset
    for entry in central:
        out.write(entry)
    size = out.offset - directory_offset
    if len(central) >= 0xFFFF:
        raise BuildError("too many members for a zip without zip64")
    out.write(_END.pack(_END_SIG, 0, 0, len(central), len(central), size, directory_offset, 0))
    return out.hexdigest()
