"""The training corpus: the interpreter's standard-library Python sources, split by file.

Standard library only (no torch), so the split can be checked anywhere. A file's
split depends on its relative path and the seed alone, never on which other files
exist, so the same file lands in the same split on every host.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

TRAIN = "train"
DRAFT = "draft"
HELDOUT = "heldout"
SPLITS = (TRAIN, DRAFT, HELDOUT)

# Third-party packages can live inside the stdlib folder (python.org and docker
# builds put site-packages there): they differ per host and are not the stdlib.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class SourceFile:
    """One source file: its path relative to the stdlib folder, its text and its split."""

    relpath: str
    text: str
    split: str


@dataclass(frozen=True)
class Corpus:
    """The selected files in path order, with a digest of paths, splits and contents."""

    root: str
    files: tuple[SourceFile, ...]
    digest: str
    skipped: int = 0
    split_names: tuple[str, ...] = field(default=SPLITS)

    def of_split(self, split: str) -> list[SourceFile]:
        """The files of one split, in path order."""
        return [f for f in self.files if f.split == split]

    def stats(self) -> dict[str, dict[str, int]]:
        """Per split: number of files and of UTF-8 bytes."""
        out: dict[str, dict[str, int]] = {}
        for name in self.split_names:
            files = self.of_split(name)
            out[name] = {
                "files": len(files),
                "bytes": sum(len(f.text.encode("utf-8")) for f in files),
            }
        return out


def stdlib_root() -> Path:
    """The running interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path) -> list[str]:
    """Relative POSIX paths of the ``*.py`` files under ``root``, sorted, third-party skipped."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                found.append(Path(dirpath, name).relative_to(root).as_posix())
    return sorted(found)


def unit_hash(seed: int, relpath: str) -> float:
    """A uniform number in [0, 1) fixed by the seed and the path."""
    digest = hashlib.sha256(f"{seed}:{relpath}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def assign_split(relpath: str, seed: int, heldout_fraction: float, draft_fraction: float) -> str:
    """The split of one file: held-out, drafter-only (unseen by the target) or train."""
    u = unit_hash(seed, relpath)
    if u < heldout_fraction:
        return HELDOUT
    if u < heldout_fraction + draft_fraction:
        return DRAFT
    return TRAIN


def _read_text(path: Path, max_bytes: int) -> str | None:
    """The file's text, or None if it is empty, too large or not UTF-8."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if not data.strip() or len(data) > max_bytes:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        # A few test fixtures are deliberately in other encodings; they add nothing.
        return None


def load_corpus(
    root: Path | None = None,
    *,
    seed: int,
    heldout_fraction: float,
    draft_fraction: float,
    max_files: int | None = None,
    max_file_bytes: int = 2_000_000,
) -> Corpus:
    """Read and split the corpus.

    ``max_files`` keeps a seeded subset (the files with the smallest hash), for
    quick runs; the split of a kept file is the same as in the full corpus.
    """
    root = stdlib_root() if root is None else root
    paths = list_sources(root)
    logger.debug("corpus: %d Python sources under %s", len(paths), root)
    if max_files is not None and len(paths) > max_files:
        subset = sorted(paths, key=lambda p: unit_hash(seed + 1, p))[:max_files]
        paths = sorted(subset)
    files: list[SourceFile] = []
    skipped = 0
    h = hashlib.sha256()
    for rel in paths:
        text = _read_text(root / rel, max_file_bytes)
        if text is None:
            skipped += 1
            continue
        split = assign_split(rel, seed, heldout_fraction, draft_fraction)
        files.append(SourceFile(rel, text, split))
        for part in (rel, split, text):
            encoded = part.encode("utf-8")
            h.update(len(encoded).to_bytes(8, "big"))
            h.update(encoded)
    return Corpus(root=str(root), files=tuple(files), digest=h.hexdigest(), skipped=skipped)


def iter_texts(files: list[SourceFile]) -> Iterator[str]:
    """The texts of the files, in order."""
    for f in files:
        yield f.text
