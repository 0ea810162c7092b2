"""The bytecode an interpreter would run from an install, checked against its sources.

RECORD hashes the ``.py`` files, but Python imports a ``.pyc`` when its header
matches: a timestamp pyc by the source's mtime and size, an unchecked hash-based
pyc always. A pyc compiled from other code with a header that still matches runs
that code while every hashed file is clean. So, in the interpreter that runs the
install (its cache tag, its compiler, and where its site set-up says bytecode lives:
``__pycache__`` beside the source, or under ``sys.pycache_prefix`` wherever that
points), every pyc it would load is compared with its source compiled afresh: code
objects are equal when the code, constants, names and line tables are (not the file
name). A pyc of another interpreter's tag is counted, not checked: this interpreter's
compiler cannot tell, and the report says so.

Compiling vLLM's thousands of modules takes seconds on every verify of every install
of the same wheel, so the pairs found equal are kept in the cache
(``<cache>/bytecode/verified``), keyed by the digest of the magic number, the
optimization level, the source and the pyc's code (not its header, which holds
the install's mtimes): a pair with those bytes is equal again and is not
compiled. A pyc that differs is never kept, so it is compiled, and named, every
time.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from .. import procs
from ..errors import EnvironmentProblem
from ..fsutil import atomic_write_text, locked

logger = logging.getLogger(__name__)

#: Runs in the install's interpreter, passed as ``-c`` (so sys.path[0] is the working folder, as
#: for any ``-c``): argv = site, the file of known keys, then the top folders to walk.
_CHECK = (Path(__file__).parent / "inside" / "bytecode_check.py").read_text()
#: Keys kept at the most: about the pycs of 40 vLLM installs; the newest stay.
_MAX_KEPT = 100_000


@dataclass
class BytecodeCheck:
    """What ``python`` would import from the install's ``__pycache__`` folders."""

    interpreter: str
    """The checking interpreter's cache tag, e.g. ``cpython-312``."""
    prefix: str | None
    """Its ``sys.pycache_prefix`` once site has run: where it reads bytecode (None: beside
    each source, in ``__pycache__``)."""
    checked: int
    """The pycs it would load, each compared with its source."""
    known: int
    """Of those, the ones whose (source, code) pair an earlier check found equal."""
    stale: int
    """Pycs it would not load (other magic, header not matching the source, or an in-tree
    ``__pycache__`` while it reads from a prefix)."""
    sourceless: int
    other_tags: dict[str, int] = field(default_factory=dict)
    """Pycs of other interpreters, by tag: not checked."""
    differ: list[tuple[str, str, str]] = field(default_factory=list)
    """(pyc, its source, header kind) where the pyc's code is not its source's; each path
    relative to site-packages, or absolute outside it (under a prefix)."""

    def describe(self) -> str:
        tag = self.interpreter
        if self.prefix is not None:
            tag += f" (pycache prefix {self.prefix})"
        text = f"bytecode: the {self.checked} .pyc that {tag} would load match their sources"
        if self.known:
            text += f" ({self.known} known from earlier checks)"
        if self.differ:
            text = f"bytecode: {len(self.differ)} of {self.checked} .pyc {tag} would load differ"
        if self.other_tags:
            others = ", ".join(f"{n} {t}" for t, n in sorted(self.other_tags.items()))
            text += f"; not checked: {others} (another interpreter's)"
        return text


def check_bytecode(
    python: Path, site: Path, tops: list[str], kept: Path | None = None
) -> BytecodeCheck:
    """Compare every pyc ``python`` would load from ``site``/``tops`` with its source; with
    ``kept`` (a cache folder), pairs found equal before are not compiled again."""
    known = kept / "verified" if kept is not None else None
    out = procs.output(
        [str(python), "-c", _CHECK, str(site), str(known or "-"), *tops],
        what=f"{python} could not check bytecode",
        error=EnvironmentProblem,
        timeout_s=900,
    )
    data = json.loads(out.strip().splitlines()[-1])
    logger.debug(
        "bytecode of %s: %d checked (%d known equal), %d differ",
        python,
        data["checked"],
        data["known"],
        len(data["differ"]),
    )
    if known is not None and data["verified"]:
        _keep(known, data["verified"])
    return BytecodeCheck(
        interpreter=data["tag"],
        prefix=data["prefix"],
        checked=data["checked"],
        known=data["known"],
        stale=data["stale"],
        sourceless=data["sourceless"],
        other_tags=data["other_tags"],
        differ=[(pyc, source, kind) for pyc, source, kind in data["differ"]],
    )


def _keep(known: Path, keys: list[str]) -> None:
    """Add ``keys`` to the file of known pairs (locked, written whole and renamed). A cache
    that cannot be written costs only time: the check's verdict stands."""
    try:
        known.parent.mkdir(parents=True, exist_ok=True)
        with locked(known):
            lines = known.read_text(encoding="ascii").split() if known.is_file() else []
            kept = list(dict.fromkeys([*lines, *keys]))[-_MAX_KEPT:]
            atomic_write_text(known, "\n".join(kept) + "\n")
    except (OSError, UnicodeDecodeError):
        pass
