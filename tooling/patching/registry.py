"""The one patch registry: the ledger's ``[[patch]]`` entries as the numbered fixes.

Fix N is the ledger's N-th patch, decided by the probe its entry names. The
probes ``tooling probe`` and ``tooling verify`` run, verify's fix table,
``--require`` and the help texts that list fixes all come from here, so adding
a patch touches the ledger and its probe module, nothing else.

The package carries the ledger as ``tooling/series.toml``: in a checkout a
link to ``patches/series.toml`` (the same file, not a copy), in an installed
toolchain the file its wheel packed through that link. So ``tooling verify``
needs no checkout, and there is no second list to keep in step.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError, SeriesError
from ..paths import PACKAGE_DIR
from ..probing import probe_modules
from .series import BaseCode, load_series

#: The ledger this toolchain ships (a link to patches/series.toml in a checkout).
LEDGER = PACKAGE_DIR / "series.toml"


@dataclass(frozen=True)
class Fix:
    number: int
    """The patch's 1-based position in the ledger."""
    patch_id: str
    probe: str
    title: str
    on: Mapping[str, BaseCode] = field(default_factory=dict, compare=False, hash=False)
    """What the ledger says the fix is on each ported base that names it."""


@dataclass(frozen=True)
class Registry:
    ledger: Path
    fixes: tuple[Fix, ...]

    @property
    def probes(self) -> tuple[str, ...]:
        """Every probe, in fix order."""
        return tuple(f.probe for f in self.fixes)

    @property
    def numbers(self) -> str:
        """The fix numbers for help texts and messages: ``1, 2, 3``."""
        return ", ".join(str(f.number) for f in self.fixes)

    def select(self, spec: str) -> list[int]:
        """``all`` or a comma list of fix numbers / patch ids / probe names -> fix numbers."""
        if spec.strip() == "all":
            return [f.number for f in self.fixes]
        wanted = []
        for token in (t.strip() for t in spec.split(",") if t.strip()):
            match = [f.number for f in self.fixes if token in (str(f.number), f.patch_id, f.probe)]
            if not match:
                raise ConfigError(
                    f"--require {token!r}: not a fix ({self.numbers}, a patch id or a probe)"
                )
            wanted += match
        return sorted(set(wanted))


def load_registry(ledger: Path) -> Registry:
    """The fixes of ``ledger``; every probe module must prove exactly one of them.

    Only the ledger's text is read (no patch file): an installed toolchain has none.
    """
    series = load_series(ledger.resolve(), check_digests=False)
    by_probe: dict[str, str] = {}
    for patch in series.patches:
        if patch.probe in by_probe:
            raise SeriesError(
                f"{series.path}: patches {by_probe[patch.probe]} and {patch.id} both name probe "
                f"{patch.probe!r}: a probe decides one fix"
            )
        by_probe[patch.probe] = patch.id
    unnamed = [m for m in probe_modules() if m not in by_probe]
    if unnamed:
        raise SeriesError(
            f"probe module {unnamed[0]} is named by no patch in {series.path}: "
            "give its patch an entry, or remove the module"
        )
    fixes = tuple(Fix(p.index, p.id, p.probe, p.title, p.on) for p in series.patches)
    return Registry(series.path, fixes)


@functools.cache
def registry() -> Registry:
    """The shipped ledger's registry, read once per process (when first needed, so a
    broken ledger is the one-line error of the command that needed it)."""
    return load_registry(LEDGER)
