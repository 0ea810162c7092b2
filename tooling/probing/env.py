"""The CPU interpreter the probes run in: a cached virtualenv with torch and vLLM's imports.

The environment is keyed by the digest of ``requirements/probe.txt``, built
once per machine under the cache with uv (given pip's index settings), and
marked complete only after uv succeeded, so an interrupted install is rebuilt
rather than trusted.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import venv
from collections.abc import Mapping
from pathlib import Path

from .. import procs
from ..errors import CacheMissError, EnvironmentProblem, ProbeError
from ..fsutil import locked, sha256_file
from ..paths import REPO_DIR, CacheLayout
from ..pipsettings import uv_pip_install

logger = logging.getLogger(__name__)

REQUIREMENTS = REPO_DIR / "requirements" / "probe.txt"
#: The variable naming a probe interpreter to use instead of the cached environment.
PROBE_PYTHON_VAR = "TOOLING_PROBE_PYTHON"
_MARKER = ".complete"


def env_dir(cache: CacheLayout, requirements: Path = REQUIREMENTS) -> Path:
    return cache.envs / f"probe-{sha256_file(requirements)[:12]}"


def python_of(env: Path) -> Path:
    return env / "bin" / "python"


def ensure_probe_env(
    cache: CacheLayout, requirements: Path = REQUIREMENTS, *, offline: bool = False
) -> Path:
    """The probe interpreter, creating its environment on first use (never under
    ``offline``: its packages come from an index)."""
    if not requirements.is_file():
        raise EnvironmentProblem(f"{requirements}: no probe requirements file")
    env = env_dir(cache, requirements)
    if offline and not (env / _MARKER).is_file():
        raise CacheMissError(
            f"--offline: the probe environment {env} is not in the cache (making it installs "
            f"{requirements.name} from an index)"
        )
    # Locked: a second process waits for this environment instead of deleting it half-built.
    with locked(env):
        return _create_probe_env(env, requirements)


def _create_probe_env(env: Path, requirements: Path) -> Path:
    if (env / _MARKER).is_file():
        return python_of(env)
    if env.exists():
        shutil.rmtree(env)
    # Once per machine: say so, and let uv's own progress show (on stderr). uv, given
    # pip's index settings (a CPU torch often comes from the user's find-links or mirror).
    logger.info(
        "probe environment: creating %s from %s (once per machine, with uv and pip's index "
        "settings)",
        env,
        requirements.name,
    )
    venv.EnvBuilder(with_pip=True, clear=True).create(env)
    returncode = _uv_install(python_of(env), ["-r", str(requirements)])
    if returncode != 0:
        shutil.rmtree(env, ignore_errors=True)
        raise EnvironmentProblem(
            f"cannot build the probe environment from {requirements} (uv exit {returncode})"
        )
    (env / _MARKER).write_text(sha256_file(requirements) + "\n")
    return python_of(env)


def _uv_install(python: Path, args: list[str]) -> int:
    # Its output on stderr, as this command's progress; stdout stays the command's answer.
    return uv_pip_install(python, args, stdout=sys.stderr, stderr=sys.stderr)


#: The reference DFlash implementation the smoke suite and the trainer compare against.
REFERENCE_DFLASH = "dflash==0.1.0"


def reference_dflash_dir(cache: CacheLayout) -> Path:
    return cache.root / "dflash-ref"


def ensure_reference_dflash(cache: CacheLayout, python: Path, *, offline: bool = False) -> Path:
    """A folder holding the reference ``dflash`` package (for PYTHONPATH), installed once
    (never under ``offline``: it comes from an index).

    ``--no-deps``: its pins (datasets, a second torch) are not needed to import
    ``dflash.model``, which uses only torch and transformers from the probe env.
    """
    target = reference_dflash_dir(cache)
    if offline and not (target / _MARKER).is_file():
        raise CacheMissError(f"--offline: the reference {REFERENCE_DFLASH} is not in the cache")
    with locked(target):
        return _install_reference_dflash(target, python)


def _install_reference_dflash(target: Path, python: Path) -> Path:
    if (target / _MARKER).is_file():
        return target
    if target.exists():
        shutil.rmtree(target)
    returncode = _uv_install(python, ["--no-deps", "--target", str(target), REFERENCE_DFLASH])
    if returncode != 0:
        shutil.rmtree(target, ignore_errors=True)
        raise EnvironmentProblem(f"cannot install {REFERENCE_DFLASH} (uv exit {returncode})")
    (target / _MARKER).write_text(REFERENCE_DFLASH + "\n")
    return target


def check_probe_python(python: Path) -> Path:
    """``python`` when it starts and is a Python 3; else a ProbeError naming it."""
    try:
        result = procs.run(
            [str(python), "-c", "import sys; print(sys.version_info[0])"], timeout_s=120
        )
    except OSError as e:
        raise ProbeError(f"probe interpreter {python} cannot start: {e.strerror or e}") from None
    except subprocess.TimeoutExpired:
        raise ProbeError(f"probe interpreter {python} did not answer within 120 s") from None
    if result.returncode != 0 or result.stdout.strip() != "3":
        raise ProbeError(
            f"probe interpreter {python} is not a working Python 3 (exit {result.returncode})"
        )
    return python


def probe_python_from(environ: Mapping[str, str]) -> Path | None:
    """``TOOLING_PROBE_PYTHON`` of ``environ`` when set (the Makefile and CI set it)."""
    value = environ.get(PROBE_PYTHON_VAR)
    return Path(value) if value else None


def resolve_probe_python(explicit: Path | None, cache: CacheLayout) -> Path | None:
    """``explicit`` (--probe-python, else ``$TOOLING_PROBE_PYTHON`` as the command line
    read it), else a completed cached probe env.

    One that cannot start is a ProbeError now, not an "unknown" probe later.
    """
    if explicit:
        return check_probe_python(explicit)
    env = env_dir(cache)
    return python_of(env) if (env / ".complete").is_file() else None


def ensure_probe_setup(cache: CacheLayout, *, offline: bool = False) -> tuple[Path, Path]:
    """``tooling probe-env``: the probe interpreter and the reference ``dflash`` folder,
    each made once and cached (under ``offline`` only found in the cache)."""
    python = ensure_probe_env(cache, offline=offline)
    return python, ensure_reference_dflash(cache, python, offline=offline)
