"""What the verify tests share: the fix numbers, and reading verdicts and the CLI."""

from __future__ import annotations

import subprocess
import sys

from tooling.patching.registry import registry

ALL = [fix.number for fix in registry().fixes]


def states(report) -> list[str]:
    return [f.state for f in report.fixes]


def by_number(states: list[str]) -> dict[int, str]:
    return dict(zip(ALL, states, strict=True))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tooling", "--no-progress", *args], capture_output=True, text=True
    )
