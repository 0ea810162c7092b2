"""Write a wheel by copying most members of another one byte-for-byte.

``zipfile`` can only write what it compresses itself, so re-packing a vLLM
wheel would inflate and deflate every one of its kernels. Here a member that does
not change is copied as its stored (compressed) bytes under a fresh local
header; new or changed members are written uncompressed (method "stored").
Deflating them would make their bytes those of the zlib the running Python
links: zlib and zlib-ng, for one, write different streams for the same input,
so one build would give two wheels on two machines. Stored, a member's bytes
are its content, and the few that a build writes are small beside the
kernels. Zip64 is not needed for vLLM wheels (a few hundred MB, some
thousands of members) and is refused, before anything is written, rather
than written wrong.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import logging
import mmap
import os
import struct
import time
import zipfile
import zlib
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..errors import ArchiveError, BuildError

logger = logging.getLogger(__name__)

_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_END = struct.Struct("<4sHHHHIIH")
_LOCAL_SIG = b"PK\x03\x04"
_CENTRAL_SIG = b"PK\x01\x02"
_END_SIG = b"PK\x05\x06"
#: Without zip64, offsets and sizes are 32-bit and 0xFFFFFFFF itself means "see zip64".
_ZIP32_MAX = 0xFFFFFFFF
#: ... and the member count is 16-bit, 0xFFFF meaning the same.
_MAX_MEMBERS = 0xFFFF
_UTF8_FLAG = 0x800
#: The first and last moments a zip's MS-DOS date and time can hold.
_DOS_MIN = (1980, 1, 1, 0, 0, 0)
_DOS_MAX = (2107, 12, 31, 23, 59, 58)
#: Members at least this large are copied by the kernel (copy_file_range).
_KERNEL_COPY_MIN = 1 << 20
#: copy_file_range's ways of saying "not here" (old kernels, other filesystems).
_NO_KERNEL_COPY = {errno.ENOSYS, errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}


def record_hash(data: bytes) -> str:
    """A RECORD hash field: ``sha256=`` and the urlsafe base64 digest without padding."""
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def dos_datetime(epoch: int) -> tuple[int, int, int, int, int, int]:
    """A zip date_time for ``epoch`` (UTC), clamped to the range zip can hold."""
    return _clamped(time.gmtime(epoch)[:6])


def _clamped(date_time: tuple[int, ...]) -> tuple[int, int, int, int, int, int]:
    # A 7-bit year since 1980: earlier or later dates would spill into other fields.
    year, month, day, hour, minute, second = min(max(tuple(date_time), _DOS_MIN), _DOS_MAX)
    return (year, month, day, hour, minute, second)


@dataclass(frozen=True)
class NewMember:
    """A member whose bytes we provide (stored uncompressed: see the module's docstring)."""

    name: str
    data: bytes
    date_time: tuple[int, int, int, int, int, int]
    external_attr: int = 0o100644 << 16
    create_system: int = 3
    """The system ``external_attr`` is meant for: 3 is Unix (a file mode), 0 MS-DOS."""


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

    def write(self, data: bytes | memoryview) -> None:
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
    # 2-second resolution; zipfile would refuse (or garble) a date out of range.
    year, month, day, hour, minute, second = _clamped(date_time)
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


def check_members(path: Path) -> None:
    """Every member of the wheel at ``path`` reads back whole (its deflate stream and CRC-32
    hold), as pip and uv require when they install or resolve it."""
    with open_wheel(path) as wheel:
        for name in wheel.namelist():
            read_member(wheel, name)


def _data_offset(src: BinaryIO, info: zipfile.ZipInfo) -> int:
    src.seek(info.header_offset)
    header = src.read(_LOCAL.size)
    if len(header) != _LOCAL.size or header[:4] != _LOCAL_SIG:
        raise ArchiveError(f"{info.filename}: bad local header at offset {info.header_offset}")
    fields = _LOCAL.unpack(header)
    return info.header_offset + _LOCAL.size + fields[9] + fields[10]


def write_wheel(target: BinaryIO, source_path: Path, members: Iterable[Member]) -> str:
    """Write ``members`` in order as a zip to ``target``; return the output's sha256.

    Every refusal (a name twice, a method or size a wheel cannot hold) comes
    before the first byte is written.
    """
    with open(source_path, "rb") as src:
        entries = _plan(src, list(members))
        logger.debug("write %d members, their bytes from %s", len(entries), source_path)
        mm = mmap.mmap(src.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            # One worker: digest updates must stay in write order.
            with ThreadPoolExecutor(max_workers=1) as pool:
                out = _HashingWriter(target, pool)
                _write_entries(out, src.fileno(), memoryview(mm), entries)
                return out.hexdigest()
        finally:
            # On a failure its traceback still holds slices of the map, which is
            # then unmapped when they go; the failure itself must surface.
            with contextlib.suppress(BufferError):
                mm.close()


@dataclass(frozen=True)
class _Entry:
    """One output member with every header field known before a byte is written."""

    name: bytes
    flags: int
    method: int
    crc: int
    csize: int
    usize: int
    date_time: tuple[int, ...]
    external_attr: int
    create_system: int
    source_start: int | None
    """Copied members: where the stored bytes start in the source."""
    payload: bytes
    """New members: their content, stored as it is (empty for copied ones)."""

    def shared(self) -> tuple[int, ...]:
        """The fields local and central headers share, in their common order."""
        dos_time, dos_date = _dos(self.date_time)
        return (
            self.flags,
            self.method,
            dos_time,
            dos_date,
            self.crc,
            self.csize,
            self.usize,
            len(self.name),
        )


def _plan(src: BinaryIO, members: list[Member]) -> list[_Entry]:
    if len(members) >= _MAX_MEMBERS:
        raise BuildError(
            f"{len(members)} members: a zip without zip64 holds at most {_MAX_MEMBERS - 1}"
        )
    seen: set[str] = set()
    for member in members:
        if member.name in seen:
            raise BuildError(f"{member.name}: two members of the wheel have this name")
        seen.add(member.name)
    entries = [_entry(src, member) for member in members]
    directory = sum(_LOCAL.size + len(e.name) + e.csize for e in entries)
    if directory >= _ZIP32_MAX:
        raise BuildError(
            f"the central directory would start at byte {directory}, past the zip limit "
            f"of {_ZIP32_MAX} bytes (zip64 is not written)"
        )
    directory_size = sum(_CENTRAL.size + len(e.name) for e in entries)
    if directory_size >= _ZIP32_MAX:
        raise BuildError(
            f"the central directory would take {directory_size} bytes, past the zip limit "
            f"of {_ZIP32_MAX} bytes (zip64 is not written)"
        )
    return entries


def _entry(src: BinaryIO, member: Member) -> _Entry:
    # Readers take a name without the UTF-8 flag as cp437.
    flags = _UTF8_FLAG if not member.name.isascii() else 0
    if isinstance(member, CopiedMember):
        info = member.source
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise ArchiveError(
                f"{info.filename}: compression method {info.compress_type}, "
                "not stored or deflated as a wheel needs"
            )
        if info.flag_bits & 0x1:
            raise ArchiveError(f"{info.filename}: encrypted, which a wheel cannot be")
        start = _data_offset(src, info)
        if start + info.compress_size > os.fstat(src.fileno()).st_size:
            raise ArchiveError(f"{info.filename}: source wheel is truncated")
        entry = _Entry(
            member.name.encode("utf-8"),
            flags,
            info.compress_type,
            info.CRC,
            info.compress_size,
            info.file_size,
            info.date_time,
            info.external_attr,
            info.create_system,
            start,
            b"",
        )
    else:
        # Stored, not deflated: the bytes must not depend on the zlib this Python links.
        entry = _Entry(
            member.name.encode("utf-8"),
            flags,
            zipfile.ZIP_STORED,
            zlib.crc32(member.data),
            len(member.data),
            len(member.data),
            member.date_time,
            member.external_attr,
            member.create_system,
            None,
            member.data,
        )
    size = max(entry.csize, entry.usize)
    if size >= _ZIP32_MAX:
        raise BuildError(
            f"{member.name}: {size} bytes, past the zip limit of {_ZIP32_MAX} bytes "
            "(zip64 is not written)"
        )
    return entry


def _write_entries(
    out: _HashingWriter, src_fd: int, source: memoryview, entries: list[_Entry]
) -> None:
    central: list[bytes] = []
    for entry in entries:
        offset = out.offset
        shared = entry.shared()
        out.write(_LOCAL.pack(_LOCAL_SIG, 20, *shared, 0) + entry.name)
        if entry.source_start is None:
            out.write(entry.payload)
        else:
            start, csize = entry.source_start, entry.csize
            data_view = source[start : start + csize]
            if csize >= _KERNEL_COPY_MIN:
                out.copy_range(src_fd, start, csize, data_view)
            else:
                # Small members: one buffered write beats a system call pair.
                out.write(data_view)
        # "Version made by": the system that gives external_attr its meaning
        # (3: a Unix mode, which is how pip restores exec bits and symlinks).
        made_by = (entry.create_system << 8) | 20
        central.append(
            _CENTRAL.pack(
                _CENTRAL_SIG, made_by, 20, *shared, 0, 0, 0, 0, entry.external_attr, offset
            )
            + entry.name
        )
    directory_offset = out.offset
    for record in central:
        out.write(record)
    size = out.offset - directory_offset
    out.write(_END.pack(_END_SIG, 0, 0, len(central), len(central), size, directory_offset, 0))
