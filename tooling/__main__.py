"""The program's entry: ``tooling`` (the console script) and ``python -m tooling``."""

from __future__ import annotations

import os


def run() -> None:
    # GitPython refuses to import without a git executable; most commands need none
    # (verify, release, --help), and those that do say so in one line (cli/group.py). Set
    # before the commands, and GitPython with them, are imported.
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
    from .cli import main

    main()


if __name__ == "__main__":
    run()
