"""Tables for the end-of-command summaries (plain text) and for generated Markdown, and how
a generator program writes its page."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .fsutil import atomic_write_text

#: What a cell of the status matrix means, for every page that shows the matrix.
STATUS_LEGEND = (
    "superseded: the release behaves as fixed (probe); already-applied: the "
    "patch text is in it; not-needed: on a ported base, the defect's code path is "
    "gone (series.toml says why); conflict: needs porting, or a port that no longer "
    "applies; (!): applied but its probe did not read present."
)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A fixed-width table; cells are str()-ed and never wrapped."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def human_size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.1f} GiB"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """A Markdown table's lines; cells are str()-ed as they are."""
    return [
        "| " + " | ".join(headers) + " |",
        "|" + "---|" * len(headers),
        *("| " + " | ".join(str(c) for c in row) + " |" for row in rows),
    ]


def write_page(parser: argparse.ArgumentParser, output: Path, page: str) -> int:
    """A generated page written whole at ``output`` (0), or the program's usage error naming
    the page it cannot write (a folder that is not there, a read-only one)."""
    try:
        atomic_write_text(output, page)
    except OSError as e:
        parser.error(f"{output}: cannot write ({e.strerror or e})")
    return 0


def status_cells(entry: Mapping[str, Any], patch_ids: Sequence[str]) -> list[str]:
    """One release's cells of ``patch status --json``: each patch's status, ``(!)`` where it
    went in but its probe did not read present; ``error`` throughout where the release has no
    report."""
    report = entry.get("report")
    if not report:
        return ["error"] * len(patch_ids)
    return [
        o["status"] + (" (!)" if o.get("problem") else "")
        for o in report["outcomes"]
        if o["patch_id"] in patch_ids
    ]
