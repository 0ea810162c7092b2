"""The lock: ``uv pip compile``'s output read back as requirements, each with its hashes and
why it is there (pure)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name, parse_wheel_filename

from ..errors import BundleError

ROOT = "-r"
"""The ``via`` marker of a requirement the input asked for directly."""


@dataclass(frozen=True)
class Requirement:
    """One line of the resolution: a pinned distribution and why it is there."""

    name: str
    """Canonical (PEP 503) name."""
    version: str
    hashes: tuple[str, ...] = ()
    """sha256 digests the index lists for this version (any file of it)."""
    via: tuple[str, ...] = ()
    """Canonical names of the requirements that pulled it in; ``-r`` for a direct one."""
    path: str | None = None
    """A local wheel the input named by path (the patched vLLM)."""


@dataclass(frozen=True)
class Resolution:
    """The output of ``uv pip compile``, parsed, and the command that made it."""

    requirements: tuple[Requirement, ...]
    lock_text: str
    command: tuple[str, ...]


_REQ_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")


def parse_lock(text: str) -> list[Requirement]:
    """The requirements of a ``uv pip compile`` output (with or without hashes).

    Reads ``name==version`` lines, their ``--hash`` continuations, their
    ``# via`` blocks, and a direct wheel named by path or ``name @ file://``.
    """
    entries: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    in_via = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if raw[0] not in " \t#":
            in_via = False
            current = _requirement_start(line)
            entries.append(current)
        elif current is None:
            continue
        elif line.startswith("--hash=sha256:"):
            current["hashes"].append(line.removeprefix("--hash=sha256:").rstrip(" \\"))
        elif line.startswith("# via"):
            rest = line.removeprefix("# via").strip()
            in_via = not rest
            if rest:
                current["via"].append(rest)
        elif in_via and line.startswith("#"):
            current["via"].append(line.lstrip("#").strip())
    return [
        Requirement(
            name=e["name"],
            version=e["version"],
            hashes=tuple(e["hashes"]),
            via=tuple(_via_name(v) for v in e["via"]),
            path=e["path"],
        )
        for e in entries
    ]


def _requirement_start(line: str) -> dict[str, Any]:
    line = line.rstrip(" \\")
    entry: dict[str, Any] = {"hashes": [], "via": [], "path": None}
    for token in line.split()[1:]:
        if token.startswith("--hash=sha256:"):
            entry["hashes"].append(token.removeprefix("--hash=sha256:"))
    head = line.split()[0]
    match = _REQ_LINE.match(line)
    if match:
        entry.update(name=canonicalize_name(match.group(1)), version=match.group(2))
        return entry
    location = line.split(" @ ", 1)[1].split()[0] if " @ " in line else head
    location = location.removeprefix("file://")
    if not location.endswith(".whl"):
        raise BundleError(f"resolution: cannot read the requirement {line!r}")
    name, version, _, _ = parse_wheel_filename(Path(location).name)
    entry.update(name=canonicalize_name(name), version=str(version), path=location)
    return entry


def _via_name(text: str) -> str:
    # "-r requirements.in" (a direct requirement) or a package name.
    return ROOT if text.startswith("-r") else canonicalize_name(text.split()[0])
