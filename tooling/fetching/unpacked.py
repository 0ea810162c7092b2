"""The unpacked sdist in the cache kept as it was unpacked: every build, work tree and probe
reads it, and the sdist's digest, checked on every use, says nothing of it once unpacked.

A tree changed after it was unpacked (an edit, a tool writing into it) made every later
build fail, blaming the official wheel's copy of a file, until the work folder was deleted
by hand. Now the tree's listing (each file's name, size and modification time) is recorded
beside it when it is unpacked (or, for a tree unpacked before, when it is first used) and
compared on every use: a tree that differs is moved aside, named in one log line, and
unpacked again from the verified sdist. A change the listing cannot see (an edit that keeps
a file's size and time) is caught where it matters, by the build's comparison with the
official wheel: that file is read back from the sdist itself (``differs_from_sdist``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import tarfile
import time
from pathlib import Path

from ..errors import IntegrityError
from ..fsutil import atomic_write_text

logger = logging.getLogger(__name__)


def listing_path(dest: Path) -> Path:
    """Where ``dest``'s listing is kept: beside it, in the cache's own folder (``dest``
    itself may be a link to another cache's)."""
    return dest.parent / f".{dest.name}.listing"


def listing(dest: Path) -> str:
    """sha256 over every entry under ``dest``: its path, kind, size and modification time."""
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(dest):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(folder, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, dest)
            digest.update(f"{rel}\0{st.st_mode >> 12}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def record(dest: Path) -> None:
    """Record ``dest``'s listing, and a token of this unpacking (a read-only cache keeps
    none: it is only read)."""
    with contextlib.suppress(OSError):
        atomic_write_text(listing_path(dest), f"{listing(dest)} {secrets.token_hex(8)}\n")


def unchanged(dest: Path) -> bool:
    """Whether ``dest`` is as it was unpacked; a tree with no listing yet gets one now."""
    try:
        recorded = listing_path(dest).read_text(encoding="utf-8").split()
    except OSError:
        record(dest)
        return True
    return recorded[:1] == [listing(dest)]


def stamp(dest: Path) -> str:
    """What tells this unpacking of ``dest`` from another of the same sdist (its record; ""
    for a folder that has none): what is made from the tree once and kept (the work trees'
    baseline commits) is kept by it, so a tree unpacked again after a change its listing
    did not see never meets what was made from the changed one."""
    try:
        return listing_path(dest).read_text(encoding="utf-8").strip()
    except OSError:
        return ""


def reject(dest: Path) -> Path:
    """Move ``dest`` (and its listing) out of the cache's way, never deleting it: a person
    may want to see what changed. Returns where it went."""
    aside = dest.parent / "rejected" / f"{dest.name}.changed-{time.strftime('%Y%m%d-%H%M%S')}"
    aside.parent.mkdir(exist_ok=True)
    os.rename(dest, aside)
    listing_path(dest).unlink(missing_ok=True)
    logger.warning(
        "%s: changed since it was unpacked from the pinned sdist; moved aside to %s, "
        "unpacking it again",
        dest,
        aside,
    )
    return aside


def differs_from_sdist(sdist: Path, tree: Path, relpath: str, content: bytes | None) -> bool:
    """Whether ``content`` (the unpacked ``tree``'s ``relpath``, None: absent) is not what the
    pinned ``sdist`` holds there."""
    member = f"{tree.name}/{relpath}"
    with tarfile.open(sdist, "r:*") as tar:
        for info in tar:
            if info.name == member:
                extracted = tar.extractfile(info)
                return extracted is None or extracted.read() != content
    return content is not None


def blame_changed(sdist: Path, tree: Path, relpath: str, content: bytes | None) -> None:
    """When ``tree`` (the unpacked sdist a build was patched from) is not the pinned
    ``sdist``'s at ``relpath`` (a change its listing did not see), the cache is at fault, not
    the file the build compared it with: the tree is moved aside, so the next run unpacks it
    anew, and an IntegrityError says so."""
    # Only a tree this module unpacked and recorded: another (a copy a caller made and
    # changed on purpose, a folder of someone's) is never blamed, nor moved.
    if not listing_path(tree.parent).is_file():
        return
    if differs_from_sdist(sdist, tree, relpath, content):
        aside = reject(tree.parent)
        raise IntegrityError(
            f"{tree / relpath}: not the pinned sdist's copy: the unpacked source in the cache "
            f"was changed; it was moved aside to {aside} (run again: it is unpacked anew)"
        )
