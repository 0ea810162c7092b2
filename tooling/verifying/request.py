"""What ``tooling verify`` was asked to check, resolved to an install and the interpreters that
question it, then verified: the stage's one entry for the command.

Three ways to name the install: an interpreter (``python``, default this one), a
site-packages folder (``site``), or a wheel pip-installed into a scratch virtualenv
(``wheel``). The probe interpreter is resolved only where the probes need one of their own.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BuildError
from ..paths import CacheLayout
from ..probing import ProbeTarget, scratch_folder
from ..probing.env import resolve_probe_python
from .verify import (
    VerifyReport,
    install_into_fresh_env,
    locate_in_site,
    locate_with_python,
    verify,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyRequest:
    cache: CacheLayout
    """Where the probes' bytecode goes, and the cached probe environment."""
    required: list[int] = field(default_factory=list)
    """Fix numbers that must be present."""
    python: Path | None = None
    """The interpreter of the environment to verify (default: this one)."""
    site: Path | None = None
    """A site-packages folder to verify instead."""
    wheel: Path | None = None
    """A wheel to pip-install into a scratch virtualenv and verify."""
    probe_python: Path | None = None
    """--probe-python as given: the probes' interpreter, and with ``python`` the one that
    questions that install."""
    default_probe_python: Path | None = None
    """``$TOOLING_PROBE_PYTHON`` as the command line read it: the probes' interpreter where
    they need one of their own and --probe-python is not given (else the cached probe env).
    It names a default, not a request: ``python``'s install is still questioned by ``python``.
    """

    def probes_python(self) -> Path | None:
        """The interpreter the probes get where they need one of their own (checked)."""
        return resolve_probe_python(self.probe_python or self.default_probe_python, self.cache)


def verify_requested(request: VerifyRequest) -> VerifyReport:
    """Find the install ``request`` names, choose who probes it, and verify it."""
    pycache = request.cache.root / "pycache"
    with scratch_folder("dflash-verify-", pycache) as scratch:
        python = request.python
        if request.wheel is not None:
            interpreter = request.probes_python()
            if interpreter is None:
                raise BuildError("--wheel needs the probe environment: run `tooling probe-env`")
            # A scratch install's bytecode would be pip's, just written: nothing to check.
            python = install_into_fresh_env(
                request.wheel.resolve(), interpreter, scratch / "venv", compile_bytecode=False
            )
        if request.site is not None:
            site = request.site.resolve()
            dist = locate_in_site(site)
            probes = request.probes_python()
            target = ProbeTarget(
                python=probes or Path(sys.executable),
                root=site,
                pycache=pycache,
                cache=request.cache.probes,
            )
            # Which interpreter runs that folder is not known: the probes' one checks.
            runtime = None
        else:
            interpreter = python or Path(sys.executable)
            dist = locate_with_python(interpreter)
            target = ProbeTarget(python=interpreter, pycache=pycache, cache=request.cache.probes)
            runtime = interpreter
            if (
                request.python is not None
                and request.wheel is None
                and request.probe_python is not None
            ):
                # --python names the vLLM, --probe-python what questions it: a --no-deps
                # install has no torch of its own, so every probe would read unknown.
                questioner = request.probes_python()
                assert questioner is not None  # given explicitly: checked, or an error
                target = ProbeTarget(
                    python=questioner, root=dist.site, pycache=pycache, cache=request.cache.probes
                )
        logger.debug("verify vLLM %s in %s, probed by %s", dist.version, dist.site, target.python)
        return verify(
            dist,
            target,
            request.required,
            runtime_python=runtime,
            bytecode_cache=request.cache.bytecode,
        )
