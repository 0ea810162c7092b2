"""``python -m tooling.smoke_summary FILE``: the check table of one ``tooling smoke
--json`` output, for a GPU host's log (``ci/gpu/production-smoke.sh``).

A smoke that could not write its document (an interpreter that never started the toolchain,
a kill past the backstop) leaves the file empty or cut short: that is one line saying so and
exit 1, so the script shows the smoke's own last lines instead, never a traceback of this
reader. Standard library only (the host's python3 runs it without the site the smoke used),
so it sits outside ``tooling.smoke``, whose package imports the serving dependencies.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from .entry import answer, entry_logging
from .errors import SmokeError
from .fsutil import read_bounded
from .schema import Doc

logger = logging.getLogger(__name__)

#: The largest document read: a smoke's is tens of kB.
LIMIT = 16 << 20
#: How much of a check's evidence a line shows.
EVIDENCE = 200


def summary_lines(path: Path) -> list[str]:
    """One line per check, then the smoke's summary (or its error); SmokeError naming the
    file when it holds no smoke document."""
    raw = read_bounded(path, LIMIT, "a smoke's output", SmokeError)
    if not raw.strip():
        raise SmokeError(f"{path}: the smoke wrote no JSON (its last lines follow)")
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise SmokeError(f"{path}: not the smoke's JSON ({e}; its last lines follow)") from None
    doc = Doc(str(path), SmokeError)
    lines = []
    for i, check in enumerate(doc.tables(data, "checks", [])):
        row = doc.inner(f": checks[{i}]")
        number, name = row.whole(check, "number"), row.text(check, "id")
        status, evidence = row.text(check, "status"), row.text(check, "evidence")
        lines.append(f"{number:>2} {name:<16} {status:<5} {evidence[:EVIDENCE]}")
    last = doc.text(data, "summary", None) or doc.text(data, "error", None)
    lines.append(str(last))
    return lines


def main(argv: list[str]) -> int:
    with entry_logging():
        if len(argv) != 1:
            logger.error("usage: python -m tooling.smoke_summary FILE")
            return 2
        try:
            lines = summary_lines(Path(argv[0]))
        except SmokeError as e:
            logger.error("error: %s", e)
            return 1
    answer("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
