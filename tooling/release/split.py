"""A bundle folder cut into parts no larger than a transfer limit: one reproducible tar
stream, numbered parts, their ``SHA256SUMS`` and ``join.py`` to check and unpack them."""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
import tarfile
from pathlib import Path
from typing import BinaryIO

from ..entry import answer, entry_logging
from ..errors import BundleError, ToolingError
from ..fsutil import sha256_file, staging_dir
from ..progress import progress_bar
from .files import BundleFile, bundle_file, sums_text

logger = logging.getLogger(__name__)


class _PartWriter:
    """A write-only stream that fills numbered files of at most ``limit`` bytes."""

    def __init__(self, folder: Path, stem: str, limit: int) -> None:
        self.folder, self.stem, self.limit = folder, stem, limit
        self.parts: list[Path] = []
        self.whole = hashlib.sha256()
        self._file: BinaryIO | None = None
        self._used = 0

    def _next(self) -> BinaryIO:
        if self._file is not None:
            self._file.close()
        if len(self.parts) >= MAX_PARTS:  # the count was checked before: a stream past it
            raise BundleError(f"{self.folder}: the split passed {MAX_PARTS} parts")
        path = self.folder / f"{self.stem}.part-{len(self.parts):03d}"
        self.parts.append(path)
        self._file = open(path, "wb")  # noqa: SIM115 (closed by _next/close)
        self._used = 0
        return self._file

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        self.whole.update(view)
        while view:
            out = self._file
            if out is None or self._used >= self.limit:
                out = self._next()
            room = self.limit - self._used
            out.write(view[:room])
            self._used += min(room, len(view))
            view = view[room:]
        return len(data)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _tar_filter(info: tarfile.TarInfo) -> tarfile.TarInfo:
    # Same bytes for the same bundle: no owners, no times.
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    return info


#: The most parts a split makes: a part size that would make more (``--split 1``: a part a
#: byte) is refused before any is written, rather than filling a disk with tiny files.
MAX_PARTS = 10_000
#: A tar member's header, and the padding of its data to whole blocks, at most.
_TAR_BLOCK = 512


def tar_bytes_at_most(sizes: list[int], members: int) -> int:
    """The most bytes a tar stream of ``members`` entries, files of ``sizes`` among them,
    takes: headers (a PAX one too) per member, each file's data in whole blocks, and the
    end of the archive (pure)."""
    data = sum(-(-size // _TAR_BLOCK) * _TAR_BLOCK for size in sizes)
    return data + 4 * _TAR_BLOCK * members + 20 * _TAR_BLOCK


def check_part_count(total: int, limit: int, what: str) -> None:
    """Refuse a part size that would cut ``total`` bytes into more than MAX_PARTS parts."""
    if limit < 1:
        raise BundleError(f"{what}: a part size of {limit} bytes is not positive")
    parts = -(-total // limit)
    if parts > MAX_PARTS:
        least = -(-total // MAX_PARTS)
        raise BundleError(
            f"{what}: {total} bytes in parts of {limit} would be {parts} parts, more than "
            f"{MAX_PARTS}: give a part size of at least {least} bytes"
        )


def split_bundle(
    bundle_dir: Path, parts_dir: Path, limit: int, show_progress: bool = True
) -> tuple[Path, list[BundleFile]]:
    """Tar ``bundle_dir`` into parts of at most ``limit`` bytes, with SHA256SUMS and join.py.

    The parts go into a new folder: an existing one that holds anything is refused (the
    parts are never mixed with other files, nor replace them)."""
    if not bundle_dir.is_dir():
        raise BundleError(f"{bundle_dir}: no such folder to split")
    if parts_dir.exists() and (not parts_dir.is_dir() or any(parts_dir.iterdir())):
        raise BundleError(f"{parts_dir} exists and is not an empty folder: give a new one")
    stem = f"{bundle_dir.name}.tar"
    entries = list(bundle_dir.rglob("*"))
    sizes = [p.stat().st_size for p in entries if p.is_file()]
    total = sum(sizes)
    check_part_count(tar_bytes_at_most(sizes, len(entries) + 1), limit, f"splitting {bundle_dir}")
    logger.debug(
        "split %s (%d bytes) into parts of %d bytes in %s", bundle_dir, total, limit, parts_dir
    )
    with staging_dir(parts_dir) as tmp:
        writer = _PartWriter(tmp, stem, limit)
        try:
            with (
                progress_bar(total, "split", show_progress) as bar,
                tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar,  # type: ignore[call-overload]
            ):
                for path in [bundle_dir, *sorted(bundle_dir.rglob("*"))]:
                    arcname = Path(bundle_dir.name) / path.relative_to(bundle_dir)
                    info = _tar_filter(tar.gettarinfo(path, arcname.as_posix()))
                    if path.is_file():
                        with open(path, "rb") as f:
                            tar.addfile(info, f)
                        bar.update(info.size)
                    else:
                        tar.addfile(info)
        finally:
            writer.close()
        parts = [BundleFile(p.name, p.stat().st_size, sha256_file(p)) for p in writer.parts]
        whole = BundleFile(stem, sum(p.size for p in parts), writer.whole.hexdigest())
        (tmp / "SHA256SUMS").write_text(sums_text([whole, *parts]))
        (tmp / "join.py").write_text(bundle_file("join.py"))
        (tmp / "join.py").chmod(0o755)
    return parts_dir, parts


def main(argv: list[str]) -> int:
    """``python -m tooling.release.split FOLDER PARTS_DIR PART_BYTES``: ``split_bundle`` for
    the GPU host scripts (``ci/gpu``: the payload, the trained pair); prints the parts
    folder."""
    parser = argparse.ArgumentParser(prog="python -m tooling.release.split")
    parser.add_argument("folder", type=Path)
    parser.add_argument("parts_dir", type=Path)
    parser.add_argument("part_bytes", type=int)
    args = parser.parse_args(argv)
    with entry_logging():
        return _split(args)


def _split(args: argparse.Namespace) -> int:
    try:
        parts_dir, _ = split_bundle(
            args.folder, args.parts_dir, args.part_bytes, show_progress=False
        )
    except ToolingError as e:
        logger.error("error: %s", e)
        return e.exit_code
    answer(str(parts_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
