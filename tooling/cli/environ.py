"""The environment variables the toolchain reads: all of them here, at the command line's
edge, and handed to the library as values."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from ..errors import CacheWriteError
from ..fsutil import check_creatable
from ..paths import CacheLayout, default_cache_dir, default_patches_dir
from ..probing.env import probe_python_from

#: Set (to anything but empty): probe verdicts are neither read from nor written to the cache.
NO_PROBE_CACHE = "TOOLING_NO_PROBE_CACHE"
#: How a refusal names the cache: the option, or the variable that fills it.
CACHE_WHAT = "the cache (--cache-dir, $VLLM_DFLASH_CACHE)"
#: The line text output adds when verdicts came from the cache.
CACHED_NOTE = f"probes: answered from the probe cache ({NO_PROBE_CACHE}=1 runs them again)"


def cache_layout(
    cache_dir: Path | None, environ: Mapping[str, str] = os.environ, *, checked: bool = True
) -> CacheLayout:
    """The cache at ``cache_dir`` (--cache-dir, which Click fills from ``$VLLM_DFLASH_CACHE``),
    else the default one; its probe verdicts unused under ``$TOOLING_NO_PROBE_CACHE``.
    ``checked``: a path that cannot be a folder is a CacheWriteError, one line, now (a
    placeholder made before the options are read is not)."""
    root = cache_dir or default_cache_dir(environ)
    if checked:
        # A read-only cache holding what a command needs is used: only its shape is checked.
        check_creatable(root, CACHE_WHAT, CacheWriteError, writable=False)
    return CacheLayout(root, probe_verdicts=not environ.get(NO_PROBE_CACHE))


def patches_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """``$TOOLING_PATCHES_DIR``, else the ``patches/`` beside the package."""
    return default_patches_dir(environ)


def probe_python(explicit: Path | None, environ: Mapping[str, str] = os.environ) -> Path | None:
    """--probe-python as given, else ``$TOOLING_PROBE_PYTHON``; the library checks either one,
    and falls back on the cached probe environment."""
    return explicit or probe_python_from(environ)


def source_date_epoch(environ: Mapping[str, str] = os.environ) -> str | None:
    """``$SOURCE_DATE_EPOCH`` (reproducible-builds.org): the build checks it and dates the
    wheel by it."""
    return environ.get("SOURCE_DATE_EPOCH")
