"""Before install.sh installs anything: every package the bundle left out as the host's
(``present.txt``, ``name==version`` as the closure was resolved) must be installed here at
that version. Otherwise one line naming it, and exit 3: vLLM would import against another
torch than its wheel was built for, and fail later, or run wrong.

    python3 check_present.py PRESENT_TXT [TARGET]

A package TARGET holds counts too (``--target`` puts it first on the path). Stdlib only: it
runs under the host's interpreter, before anything is installed.
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

#: The exit code of a host that lacks what the bundle left out.
MISSING = 3


def public(version: str) -> str:
    """The version without its local label: the host's ``2.11.0+cu130`` is ``2.11.0``."""
    return version.split("+", 1)[0]


def installed(name: str, target: str | None) -> str | None:
    """The version of ``name`` this interpreter imports (from ``target`` first), or None."""
    if target:
        from importlib.metadata import distributions

        for dist in distributions(path=[target]):
            if (dist.metadata["Name"] or "").lower().replace("_", "-") == name:
                return dist.version
    try:
        return distribution(name).version
    except PackageNotFoundError:
        return None


def _refuse(line: str) -> None:
    """The script's one line on stderr (it answers through this function alone)."""
    print(line, file=sys.stderr)


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        _refuse("usage: check_present.py PRESENT_TXT [TARGET]")
        return 2
    target = argv[2] if len(argv) == 3 else None
    for line in Path(argv[1]).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        name, _, wanted = line.strip().partition("==")
        have = installed(name.lower().replace("_", "-"), target)
        if have is None or public(have) != public(wanted):
            found = f"has {name} {have}" if have else f"has no {name}"
            _refuse(
                f"install.sh: this host {found}, but the bundle was resolved with "
                f"{name}=={wanted} and left it out as the host's (--exclude-present): make the "
                "bundle again from the host's `pip freeze`, or without that name; nothing "
                "was installed"
            )
            return MISSING
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
