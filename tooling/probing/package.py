"""The probes package (``tooling/probes``) as the probed interpreter gets it: which probes
exist, the copy it imports, and the command that runs one of the copy's entry points."""

from __future__ import annotations

import logging
import pkgutil
import shutil
from pathlib import Path

from .. import probes

logger = logging.getLogger(__name__)

#: The folder copied into the probed interpreter's search path.
PACKAGE_DIR = Path(probes.__file__).resolve().parent
#: The package's modules that run the probes rather than being one.
_MACHINERY = frozenset({"child", "forkserver", "result"})
#: The copy's name: the probed interpreter sees neither the toolchain nor its dependencies.
_CHILD_PACKAGE = "dflash_probes"


def probe_modules() -> tuple[str, ...]:
    """The probes that exist: every public module of the package but the machinery, sorted.

    Found by listing, not importing: a probe is for the probed interpreter to import.
    """
    names = (m.name for m in pkgutil.iter_modules([str(PACKAGE_DIR)]))
    return tuple(sorted(n for n in names if not n.startswith("_") and n not in _MACHINERY))


def copy_probe_package(folder: Path) -> Path:
    """Copy the probes into ``folder`` under a neutral package name, so the probed
    interpreter sees neither the toolchain nor its dependencies; returns the package's
    marker file."""
    shutil.copytree(
        PACKAGE_DIR,
        folder / _CHILD_PACKAGE,
        ignore=shutil.ignore_patterns("__pycache__", "__init__.py"),
    )
    marker = folder / _CHILD_PACKAGE / "__init__.py"
    marker.write_text("")
    logger.debug("probes copied into %s", folder / _CHILD_PACKAGE)
    return marker


def probe_command(python: Path, module: str, args: list[str]) -> list[str]:
    """The command line that runs one of the copied package's entry points."""
    return [str(python), "-m", f"{_CHILD_PACKAGE}.{module}", *args]
