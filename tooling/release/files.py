"""The files a bundle and its parts list: their digests in ``SHA256SUMS``, and the scripts
they carry."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..fsutil import sha256_file


@dataclass(frozen=True)
class BundleFile:
    path: str
    """Relative to the bundle (or parts) folder."""
    size: int
    sha256: str


def bundle_file(name: str) -> str:
    """A script the bundle carries, from ``tooling/release/bundle_files`` (package data: the
    files are linted and tested as themselves, shellcheck included)."""
    return (
        resources.files("tooling.release")
        .joinpath("bundle_files", name)
        .read_text(encoding="utf-8")
    )


def sums_text(files: Iterable[BundleFile]) -> str:
    # The format of sha256sum(1): `sha256sum -c SHA256SUMS` checks it too.
    return "".join(f"{f.sha256}  {f.path}\n" for f in files)


def describe(root: Path) -> list[BundleFile]:
    files = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        files.append(BundleFile(rel, path.stat().st_size, sha256_file(path)))
    return files
