"""Parse unified diffs into hunks and say where each hunk's old side stands in a file.

Pure functions: no git, no I/O. ``git apply`` answers "does it apply"; this
module answers the question a person asks next: which hunk, and did its lines
move, change, or vanish.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@(.*)$")


@dataclass(frozen=True)
class Hunk:
    path: str
    index: int
    """1-based position of the hunk within its file."""
    old_start: int
    header: str
    old_lines: tuple[str, ...]
    new_lines: tuple[str, ...]


@dataclass(frozen=True)
class FileDiff:
    old_path: str | None
    new_path: str | None
    hunks: tuple[Hunk, ...]

    @property
    def path(self) -> str:
        return self.new_path or self.old_path or "?"


@dataclass(frozen=True)
class HunkPlacement:
    """Where a hunk's old side is in the current file."""

    hunk: Hunk
    found_at: int | None
    """1-based line where the old side starts, None when it is not there verbatim."""
    first_mismatch: int | None = None
    """Offset into the hunk's old side of the first line that differs at the expected place."""
    expected_line: str | None = None
    actual_line: str | None = None

    @property
    def moved_by(self) -> int | None:
        return None if self.found_at is None else self.found_at - self.hunk.old_start

    def describe(self) -> str:
        h = self.hunk
        where = f"{h.path} hunk #{h.index} ({h.header.strip()})"
        if self.found_at is not None:
            if self.moved_by:
                return (
                    f"{where}: context found at line {self.found_at}, moved by {self.moved_by:+d}"
                )
            return f"{where}: context found at line {self.found_at}"
        if self.first_mismatch is None:
            return f"{where}: file too short for the hunk at line {h.old_start}"
        line_no = h.old_start + self.first_mismatch
        return (
            f"{where}: line {line_no} expected {self.expected_line!r}, found {self.actual_line!r}"
        )


def _strip_prefix(path: str) -> str | None:
    if path == "/dev/null":
        return None
    return path[2:] if path[:2] in ("a/", "b/") else path


def parse_diff(text: str) -> list[FileDiff]:
    """The file diffs of a git-style unified diff (the part after the mail header)."""
    files: list[FileDiff] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if (
            not lines[i].startswith("--- ")
            or i + 1 >= len(lines)
            or not lines[i + 1].startswith("+++ ")
        ):
            i += 1
            continue
        old_path = _strip_prefix(lines[i][4:].split("\t")[0])
        new_path = _strip_prefix(lines[i + 1][4:].split("\t")[0])
        i += 2
        hunks: list[Hunk] = []
        while i < len(lines) and (m := _HUNK.match(lines[i])):
            old_count = int(m.group(2) if m.group(2) is not None else 1)
            new_count = int(m.group(4) if m.group(4) is not None else 1)
            old: list[str] = []
            new: list[str] = []
            i += 1
            while i < len(lines) and (len(old) < old_count or len(new) < new_count):
                line = lines[i]
                tag, body = (line[:1], line[1:]) if line else (" ", "")
                if tag == "\\":  # "\ No newline at end of file"
                    i += 1
                    continue
                if tag in (" ", "-"):
                    old.append(body)
                if tag in (" ", "+"):
                    new.append(body)
                i += 1
            hunks.append(
                Hunk(
                    path=new_path or old_path or "?",
                    index=len(hunks) + 1,
                    old_start=int(m.group(1)),
                    header=m.group(5),
                    old_lines=tuple(old),
                    new_lines=tuple(new),
                )
            )
        files.append(FileDiff(old_path, new_path, tuple(hunks)))
    return files


def place_hunk(file_lines: list[str], hunk: Hunk) -> HunkPlacement:
    """Find ``hunk``'s old side in ``file_lines``: nearest exact match to where it was expected."""
    old = list(hunk.old_lines)
    n = len(old)
    starts = [s for s in range(len(file_lines) - n + 1) if file_lines[s : s + n] == old]
    if starts:
        best = min(starts, key=lambda s: abs(s + 1 - hunk.old_start))
        return HunkPlacement(hunk, found_at=best + 1)
    base = hunk.old_start - 1
    for offset, expected in enumerate(old):
        index = base + offset
        if index >= len(file_lines):
            return HunkPlacement(hunk, None)
        if file_lines[index] != expected:
            return HunkPlacement(
                hunk,
                None,
                first_mismatch=offset,
                expected_line=expected,
                actual_line=file_lines[index],
            )
    return HunkPlacement(hunk, None)
