"""The bytecode an interpreter would run from an install, checked against its sources.

RECORD hashes the ``.py`` files, but Python imports ``__pycache__/*.pyc`` when
its header matches: a timestamp pyc by the source's mtime and size, an
unchecked hash-based pyc always. A pyc compiled from other code with a header
that still matches runs that code while every hashed file is clean. So, in the
interpreter that runs the install (its cache tag and its compiler), every pyc
it would load is compared with its source compiled afresh: code objects are
equal when the code, constants, names and line tables are (not the file name).
A pyc of another interpreter's tag is counted, not checked: this interpreter's
compiler cannot tell, and the report says so.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import EnvironmentProblem

#: Runs in the install's interpreter, passed as ``-c`` (so sys.path[0] is the working folder, as
#: for any ``-c``): argv = site, then the top folders to walk.
_CHECK = (Path(__file__).parent / "inside" / "bytecode_check.py").read_text()


@dataclass
class BytecodeCheck:
    """What ``python`` would import from the install's ``__pycache__`` folders."""

    interpreter: str
    """The checking interpreter's cache tag, e.g. ``cpython-312``."""
    checked: int
    """The pycs it would load, each compared with its source."""
    stale: int
    """Pycs it would not load (other magic, header not matching the source)."""
    sourceless: int
    other_tags: dict[str, int] = field(default_factory=dict)
    """Pycs of other interpreters, by tag: not checked."""
    differ: list[tuple[str, str]] = field(default_factory=list)
    """(pyc path relative to site-packages, header kind) whose code is not its source's."""

    def describe(self) -> str:
        tag = self.interpreter
        text = f"bytecode: the {self.checked} .pyc that {tag} would load match their sources"
        if self.differ:
            text = f"bytecode: {len(self.differ)} of {self.checked} .pyc {tag} would load differ"
        if self.other_tags:
            others = ", ".join(f"{n} {t}" for t, n in sorted(self.other_tags.items()))
            text += f"; not checked: {others} (another interpreter's)"
        return text


def check_bytecode(python: Path, site: Path, tops: list[str]) -> BytecodeCheck:
    """Compare every pyc ``python`` would load from ``site``/``tops`` with its source."""
    try:
        done = subprocess.run(
            [str(python), "-c", _CHECK, str(site), *tops],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=900,
        )
    except OSError as e:
        why = e.strerror or e
        raise EnvironmentProblem(f"cannot run {python} to check bytecode: {why}") from None
    except subprocess.TimeoutExpired:
        raise EnvironmentProblem(f"{python} did not finish checking bytecode in 900 s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise EnvironmentProblem(
            f"{python} could not check bytecode (exit {done.returncode}): {last}"
        )
    data = json.loads(done.stdout.strip().splitlines()[-1])
    return BytecodeCheck(
        interpreter=data["tag"],
        checked=data["checked"],
        stale=data["stale"],
        sourceless=data["sourceless"],
        other_tags=data["other_tags"],
        differ=[(path, kind) for path, kind in data["differ"]],
    )
