"""The wheel under test, installed where the smoke's interpreters import it from."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from ..errors import SmokeError
from ..verifying.install import pip_install

logger = logging.getLogger(__name__)


def install_for_smoke(wheel: Path, folder: Path) -> Path:
    """pip-install ``wheel`` into ``folder`` (--target, no deps) for the smoke to import."""
    logger.debug("install %s into %s", wheel.name, folder)
    failure = pip_install(wheel, target=folder)
    if failure is not None:
        raise SmokeError(f"pip could not install {wheel.name} for the smoke: {failure}")
    return folder


def put_first(site: Path) -> None:
    """``site`` first on this process's path and on every child's (PYTHONPATH): the servers,
    the in-process engine and this process's own ``import vllm`` all see the wheel under test."""
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    sys.path.insert(0, str(site))


def parse_engines(specs: tuple[str, ...]) -> dict[str, Path]:
    """``--engine NAME=DIR`` options as names to vLLM install folders."""
    engines: dict[str, Path] = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not Path(folder, "vllm", "__init__.py").is_file():
            raise SmokeError(f"--engine {spec!r}: expected NAME=DIR with DIR a folder holding vllm")
        if name in engines:
            raise SmokeError(f"--engine {name}: named twice ({engines[name]} and {folder})")
        engines[name] = Path(folder).resolve()
    return engines
