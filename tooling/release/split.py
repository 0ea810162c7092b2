"""A bundle folder cut into parts no larger than a transfer limit: one reproducible tar
stream, numbered parts, their ``SHA256SUMS`` and ``join.py`` to check and unpack them."""

from __future__ import annotations

import argparse
import hashlib
import sys
import tarfile
from pathlib import Path
from typing import BinaryIO

from ..errors import BundleError, ToolingError
from ..fsutil import sha256_file, staging_dir
from ..progress import progress_bar
from .files import BundleFile, bundle_file, sums_text


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


def split_bundle(
    bundle_dir: Path, parts_dir: Path, limit: int, show_progress: bool = True
) -> tuple[Path, list[BundleFile]]:
    """Tar ``bundle_dir`` into parts of at most ``limit`` bytes, with SHA256SUMS and join.py."""
    if limit < 1:
        raise BundleError(f"split size {limit} is not positive")
    stem = f"{bundle_dir.name}.tar"
    total = sum(p.stat().st_size for p in bundle_dir.rglob("*") if p.is_file())
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
    try:
        parts_dir, _ = split_bundle(
            args.folder, args.parts_dir, args.part_bytes, show_progress=False
        )
    except ToolingError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(parts_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
