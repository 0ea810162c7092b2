"""An interpreter that counts its starts: "no interpreter started" asserted by count, not
by time."""

from __future__ import annotations

from pathlib import Path


def counting_python(folder: Path, python: Path) -> tuple[Path, Path]:
    """An interpreter that notes each start in a file, then is ``python``."""
    starts = folder / "starts"
    wrapper = folder / "python"
    wrapper.write_text(f'#!/bin/sh\necho started >> "{starts}"\nexec "{python}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, starts


def started(starts: Path) -> int:
    return len(starts.read_text().splitlines()) if starts.exists() else 0
