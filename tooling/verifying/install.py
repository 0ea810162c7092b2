"""A real ``pip install`` of one wheel, offline and without dependencies."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .. import procs
from ..fsutil import run_prefix

logger = logging.getLogger(__name__)

#: Seconds one ``pip install`` of a wheel may take, bytecode compiling included.
INSTALL_TIMEOUT_S = 1800


def pip_install(
    wheel: Path,
    *,
    python: Path | None = None,
    target: Path | None = None,
    compile_bytecode: bool = True,
) -> str | None:
    """Install ``wheel`` into ``python``'s environment (pip --python) or into ``target``.

    --no-deps --no-index: the wheel is what is under test; what it needs comes
    from elsewhere (a .pth to the probe environment, an offline bundle).
    Returns None on success, else why not (the last line pip printed).
    """
    cmd = [sys.executable, "-m", "pip"]
    if python is not None:
        cmd += ["--python", str(python)]
    cmd += ["install", "--quiet", "--no-deps", "--no-index", "--disable-pip-version-check"]
    if not compile_bytecode:
        cmd.append("--no-compile")
    if target is not None:
        cmd += ["--upgrade", "--target", str(target)]
    # pip --python runs pip again under that interpreter: a grandchild, stopped with the
    # group. pip's own temp folders go in one of ours, which goes however pip ends.
    with tempfile.TemporaryDirectory(prefix=run_prefix("dflash-pip-")) as tmp:
        try:
            result = procs.run(
                [*cmd, str(wheel)], timeout_s=INSTALL_TIMEOUT_S, env={**os.environ, "TMPDIR": tmp}
            )
        except subprocess.TimeoutExpired:
            return f"pip did not finish within {INSTALL_TIMEOUT_S}s"
    if result.returncode == 0:
        logger.debug("pip installed %s", wheel.name)
        return None
    return (result.stderr.strip().splitlines() or ["pip failed"])[-1]
