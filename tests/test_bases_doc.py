"""docs/guide/bases.md's table says, for each fix, what the ledger says it is on 0.34.0: a
state changed in series.toml and not on the page (or the other way) fails here."""

from __future__ import annotations

import re

from tooling.patching.series import load_ledger

from .helpers import PATCHES, REPO_DIR

PAGE = REPO_DIR / "docs" / "guide" / "bases.md"
WORDS = {"superseded": "superseded", "not-needed": "not needed", "port": "port"}


def test_the_bases_page_has_the_ledgers_state_of_every_fix_on_0340():
    rows = re.findall(r"^\| (\d+) \| `([^`]+)` \| [^|]+ \| ([^|]+) \|", PAGE.read_text(), re.M)
    series = load_ledger(PATCHES).for_base("0.34.0", strict=False)
    expected = [
        (str(p.index), p.id, WORDS[p.expect.value] if p.expect else "undecided")
        for p in series.patches
    ]
    assert [(n, pid, state.strip()) for n, pid, state in rows] == expected
