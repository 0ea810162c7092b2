"""The raw-copy zip writer on small synthetic zips: what it carries, what it refuses."""

from __future__ import annotations

import hashlib
import io
import struct
import subprocess
import zipfile
from pathlib import Path

import pytest

from tooling.building import wheelfile
from tooling.building.wheelfile import CopiedMember, NewMember, dos_datetime, write_wheel
from tooling.errors import ArchiveError, BuildError

_LOCAL = struct.Struct("<4sHHHHHIIIHH")
STAMP = (2026, 11, 30, 12, 0, 0)


class _Unseekable(io.RawIOBase):
    """A pipe-like target: zipfile then writes data descriptors and local zip64 extras."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.buffer += data
        return len(data)


def _info(name: str, mode: int, system: int = 3, method: int = zipfile.ZIP_DEFLATED):
    info = zipfile.ZipInfo(name, STAMP)
    info.external_attr = mode << 16
    info.create_system = system
    info.compress_type = method
    return info


def _source(path: Path) -> Path:
    """A zip with every member kind the copier meets: see the asserts of the first test."""
    pipe = _Unseekable()
    with zipfile.ZipFile(pipe, "w") as zf:
        zf.writestr(_info("pkg/__init__.py", 0o100644), b"x = 1\n" * 200)
        zf.writestr(_info("pkg/run.sh", 0o100755, method=zipfile.ZIP_STORED), b"#!/bin/sh\n")
        zf.writestr(_info("pkg/link.py", 0o120777, method=zipfile.ZIP_STORED), b"__init__.py")
        zf.writestr(_info("pkg/ünïcødé_名前.py", 0o100644), "s = 'ü'\n".encode() * 50)
        dos = _info("pkg/DOS.TXT", 0, system=0)
        dos.external_attr = 0x20  # MS-DOS "archive" attribute, not a Unix mode
        zf.writestr(dos, b"dos\r\n")
        with zf.open(_info("pkg/big.bin", 0o100644), "w", force_zip64=True) as f:
            f.write(bytes(range(256)) * 64)
    path.write_bytes(bytes(pipe.buffer))
    return path


def _raw(path: Path, info: zipfile.ZipInfo) -> tuple[int, bytes, bytes]:
    """A member's local header flags, extra field and stored (compressed) bytes."""
    data = path.read_bytes()
    fields = _LOCAL.unpack_from(data, info.header_offset)
    start = info.header_offset + _LOCAL.size + fields[9]
    extra = data[start : start + fields[10]]
    start += fields[10]
    return fields[2], extra, data[start : start + info.compress_size]


def _copy_all(source: Path, target: Path, extra: list | None = None) -> str:
    with zipfile.ZipFile(source) as zf, open(target, "wb") as out:
        members = [CopiedMember(i.filename, i) for i in zf.infolist()]
        return write_wheel(out, source, members + (extra or []))


@pytest.mark.parametrize("kernel_copy_min", [1 << 20, 0], ids=["buffered", "copy_file_range"])
def test_copy_keeps_every_member_byte_for_byte(tmp_path, monkeypatch, kernel_copy_min):
    monkeypatch.setattr(wheelfile, "_KERNEL_COPY_MIN", kernel_copy_min)
    source = _source(tmp_path / "in.zip")
    target = tmp_path / "out.zip"
    new = NewMember("pkg/nëw.py", b"y = 2\n", STAMP, 0o100600 << 16)
    digest = _copy_all(source, target, [new])
    assert digest == hashlib.sha256(target.read_bytes()).hexdigest()
    # Info-ZIP's own test of every member (CRCs, local vs central headers).
    unzip = subprocess.run(["unzip", "-t", str(target)], capture_output=True, text=True)
    assert unzip.returncode == 0, unzip.stdout + unzip.stderr

    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target) as out:
        assert out.testzip() is None
        olds = old.infolist()
        assert all(i.flag_bits & 0x08 for i in olds)  # the source has data descriptors
        assert any(_raw(source, i)[1] for i in olds)  # ... and a local zip64 extra
        assert [i.filename for i in out.infolist()] == [i.filename for i in olds] + [new.name]
        for before in olds:
            after = out.getinfo(before.filename)
            flags, extra, stored = _raw(target, after)
            assert stored == _raw(source, before)[2], before.filename
            assert extra == b"" and flags & 0x08 == 0  # sizes are in the header itself
            assert flags & 0x800 == (0 if before.filename.isascii() else 0x800)
            assert out.read(after) == old.read(before)
            same = ("compress_type", "CRC", "file_size", "compress_size", "date_time")
            for field in (*same, "external_attr", "create_system"):
                assert getattr(after, field) == getattr(before, field), (before.filename, field)
        assert out.getinfo("pkg/link.py").external_attr >> 16 == 0o120777
        assert out.getinfo("pkg/DOS.TXT").create_system == 0
        written = out.getinfo(new.name)
        assert out.read(written) == new.data and written.external_attr == new.external_attr
        assert written.create_system == 3


def test_written_members_are_stored_as_they_are(tmp_path):
    """What the writer writes itself goes in uncompressed: deflated, its bytes would be those
    of the zlib this Python links (zlib and zlib-ng write different streams), and one build
    would give other wheels on other machines. Copied members keep their official bytes."""
    source = _source(tmp_path / "in.zip")
    target = tmp_path / "out.zip"
    data = b"x = 1\n" * 1000  # deflate would have shrunk it
    new = NewMember("pkg/new.py", data, STAMP)
    _copy_all(source, target, [new])
    with zipfile.ZipFile(target) as out:
        written = out.getinfo(new.name)
        assert written.compress_type == zipfile.ZIP_STORED
        assert written.compress_size == written.file_size == len(data)
        assert _raw(target, written)[2] == data and out.read(written) == data
        copied = out.getinfo("pkg/__init__.py")
        assert copied.compress_type == zipfile.ZIP_DEFLATED and copied.compress_size < 1200


def test_unzip_restores_modes_and_symlinks(tmp_path):
    target = tmp_path / "out.zip"
    _copy_all(_source(tmp_path / "in.zip"), target)
    subprocess.run(["unzip", "-q", str(target), "-d", str(tmp_path / "x")], check=True)
    pkg = tmp_path / "x" / "pkg"
    assert (pkg / "link.py").is_symlink() and (pkg / "link.py").readlink() == Path("__init__.py")
    assert (pkg / "run.sh").stat().st_mode & 0o777 == 0o755
    assert (pkg / "ünïcødé_名前.py").read_text() == "s = 'ü'\n" * 50


@pytest.mark.parametrize(
    ("method", "label"), [(zipfile.ZIP_BZIP2, "bzip2"), (zipfile.ZIP_LZMA, "lzma")]
)
def test_refuses_compression_a_wheel_may_not_use(tmp_path, method, label):
    source = tmp_path / "in.zip"
    with zipfile.ZipFile(source, "w") as zf:
        zf.writestr(_info("pkg/ok.py", 0o100644), b"ok")
        zf.writestr(_info("pkg/odd.py", 0o100644, method=method), b"odd" * 100)
    target = tmp_path / "out.zip"
    with pytest.raises(ArchiveError) as e:
        _copy_all(source, target)
    assert str(e.value) == (
        f"pkg/odd.py: compression method {method}, not stored or deflated as a wheel needs"
    )
    assert target.read_bytes() == b""  # refused before a byte was written


def test_refuses_an_encrypted_member(tmp_path):
    source = tmp_path / "in.zip"
    with zipfile.ZipFile(source, "w") as zf:
        zf.writestr(_info("pkg/secret.py", 0o100644), b"s")
    data = bytearray(source.read_bytes())
    central = data.rindex(b"PK\x01\x02")
    data[central + 8] |= 1  # general purpose flag bit 0: encrypted
    source.write_bytes(bytes(data))
    with pytest.raises(ArchiveError, match=r"^pkg/secret.py: encrypted"):
        _copy_all(source, tmp_path / "out.zip")


def test_refuses_duplicate_names(tmp_path):
    source = tmp_path / "in.zip"
    with pytest.warns(UserWarning, match="Duplicate name"), zipfile.ZipFile(source, "w") as zf:
        zf.writestr(_info("pkg/a.py", 0o100644), b"1")
        zf.writestr(_info("pkg/a.py", 0o100644), b"2")
    with pytest.raises(BuildError) as e:
        _copy_all(source, tmp_path / "out.zip")
    assert str(e.value) == "pkg/a.py: two members of the wheel have this name"
    with (
        pytest.raises(BuildError, match=r"^pkg/b.py: two members"),
        open(tmp_path / "o", "wb") as out,
    ):
        b = NewMember("pkg/b.py", b"", STAMP)
        write_wheel(out, source, [b, b])


def test_refuses_more_members_than_zip_without_zip64_holds(tmp_path, monkeypatch):
    monkeypatch.setattr(wheelfile, "_MAX_MEMBERS", 3)  # 0xFFFF: the count is in zip64
    source = _source(tmp_path / "in.zip")
    target = tmp_path / "out.zip"
    with pytest.raises(BuildError) as e:
        _copy_all(source, target)
    assert str(e.value) == "6 members: a zip without zip64 holds at most 2"
    assert target.read_bytes() == b""


def test_refuses_offsets_past_the_zip32_limit(tmp_path, monkeypatch):
    """The exact boundary: the central directory must start below the 32-bit limit."""
    source = tmp_path / "in.zip"
    with zipfile.ZipFile(source, "w") as zf:  # stored: no member is larger than its offset
        for n in range(3):
            zf.writestr(_info(f"m{n}", 0o100644, method=zipfile.ZIP_STORED), b"m" * 50)
    target = tmp_path / "out.zip"
    _copy_all(source, target)
    with zipfile.ZipFile(target) as zf:
        directory = zf.start_dir
    monkeypatch.setattr(wheelfile, "_ZIP32_MAX", directory + 1)
    _copy_all(source, target)  # fits: written as before
    assert zipfile.ZipFile(target).testzip() is None
    monkeypatch.setattr(wheelfile, "_ZIP32_MAX", directory)
    with pytest.raises(BuildError) as e:
        _copy_all(source, target)
    assert str(e.value) == (
        f"the central directory would start at byte {directory}, "
        f"past the zip limit of {directory} bytes (zip64 is not written)"
    )
    assert target.read_bytes() == b""


def test_refuses_a_member_past_the_zip32_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(wheelfile, "_ZIP32_MAX", 1000)
    with pytest.raises(BuildError) as e, open(tmp_path / "out.zip", "wb") as out:
        write_wheel(out, _source(tmp_path / "in.zip"), [NewMember("big", bytes(1000), STAMP)])
    assert (
        str(e.value) == "big: 1000 bytes, past the zip limit of 1000 bytes (zip64 is not written)"
    )


@pytest.mark.parametrize(
    ("date_time", "stored"),
    [
        ((1970, 1, 1, 0, 0, 0), (1980, 1, 1, 0, 0, 0)),
        ((2026, 11, 30, 12, 0, 1), (2026, 11, 30, 12, 0, 0)),
        ((2200, 6, 1, 0, 0, 0), (2107, 12, 31, 23, 59, 58)),
    ],
)
def test_dates_are_clamped_to_what_zip_can_hold(tmp_path, date_time, stored):
    target = tmp_path / "out.zip"
    with open(target, "wb") as out:
        write_wheel(out, _source(tmp_path / "in.zip"), [NewMember("a", b"a", date_time)])
    with zipfile.ZipFile(target) as zf:
        assert zf.getinfo("a").date_time == stored


def test_dos_datetime_clamps_the_epoch():
    assert dos_datetime(0) == (1980, 1, 1, 0, 0, 0)
    assert dos_datetime(1795910400) == (2026, 11, 29, 0, 0, 0)
    assert dos_datetime(2**40) == (2107, 12, 31, 23, 59, 58)


def test_refuses_a_truncated_source_before_writing(tmp_path):
    source = tmp_path / "in.zip"
    with zipfile.ZipFile(source, "w") as zf:
        zf.writestr(_info("pkg/a.bin", 0o100644, method=zipfile.ZIP_STORED), bytes(100))
    with zipfile.ZipFile(source) as zf:
        info = zf.getinfo("pkg/a.bin")
    with open(source, "r+b") as f:
        f.truncate(info.header_offset + _LOCAL.size + len("pkg/a.bin") + 50)
    target = tmp_path / "out.zip"
    with (
        pytest.raises(ArchiveError, match=r"^pkg/a.bin: source wheel is truncated$"),
        open(target, "wb") as out,
    ):
        write_wheel(out, source, [CopiedMember(info.filename, info)])
    assert target.read_bytes() == b""
