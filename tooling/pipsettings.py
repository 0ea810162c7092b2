"""pip's index settings, read from pip itself and passed on to uv.

The toolchain builds its environments with uv, which resolves and installs far faster than pip.
A user behind a mirror, or with local wheels such as a CPU build of torch, has
told pip, not uv: ``PIP_INDEX_URL``, ``PIP_FIND_LINKS``, ``pip.conf``.
``pip config list`` reports every one of them (the files and the environment),
and :meth:`IndexSettings.uv_args` turns them into uv's flags.

Standard library only: ``python -m tooling.pipsettings ARGS`` is how the Makefile
installs the toolchain itself (``uv pip install ARGS`` for that interpreter) before
anything else is installed.
"""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import procs

logger = logging.getLogger(__name__)

#: Sections that apply to ``pip install``, lowest precedence first (the environment wins).
_SECTIONS = ("global", "install", ":env:")


@dataclass(frozen=True)
class IndexSettings:
    """Where pip would look for packages, and what it would hold them to."""

    index_url: str | None = None
    extra_index_urls: tuple[str, ...] = ()
    find_links: tuple[str, ...] = ()
    constraints: tuple[str, ...] = ()
    trusted_hosts: tuple[str, ...] = ()
    no_index: bool = False
    cert: str | None = None

    def uv_args(self) -> list[str]:
        """The same settings as ``uv pip install`` options."""
        args: list[str] = []
        if self.index_url:
            args += ["--index-url", self.index_url]
        for url in self.extra_index_urls:
            args += ["--extra-index-url", url]
        for place in self.find_links:
            args += ["--find-links", place]
        for path in self.constraints:
            args += ["--constraint", path]
        for host in self.trusted_hosts:
            args += ["--allow-insecure-host", host]
        if self.no_index:
            args.append("--no-index")
        if self.extra_index_urls or self.find_links:
            # pip takes the best version across all its sources; uv's default would stop
            # at the first index that has the package, and miss a local CPU torch.
            args += ["--index-strategy", "unsafe-best-match"]
        return args

    def uv_env(self) -> dict[str, str]:
        """Environment for uv: pip's ``cert`` is the CA bundle uv should trust."""
        return {"SSL_CERT_FILE": self.cert} if self.cert else {}


def parse_pip_config(text: str) -> IndexSettings:
    """Settings from ``pip config list`` output (``section.key='value'`` lines), pure."""
    values: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        name, sep, raw = line.partition("=")
        section, dot, key = name.rpartition(".")
        if not sep or not dot or section not in _SECTIONS:
            continue
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        values.setdefault(key, {})[section] = str(value)

    def setting(key: str) -> str | None:
        found = values.get(key, {})
        return next((found[s] for s in reversed(_SECTIONS) if s in found), None)

    def many(key: str) -> tuple[str, ...]:
        return tuple((setting(key) or "").split())

    return IndexSettings(
        index_url=setting("index-url"),
        extra_index_urls=many("extra-index-url"),
        find_links=many("find-links"),
        constraints=many("constraint"),
        trusted_hosts=many("trusted-host"),
        no_index=(setting("no-index") or "").lower() in ("1", "true", "yes", "on"),
        cert=setting("cert"),
    )


def read_pip_settings() -> IndexSettings:
    """What this interpreter's pip is configured with; none where pip cannot say."""
    try:
        result = procs.run([sys.executable, "-m", "pip", "config", "list"], timeout_s=60)
    except (OSError, subprocess.TimeoutExpired):
        return IndexSettings()
    return parse_pip_config(result.stdout) if result.returncode == 0 else IndexSettings()


def uv_pip_install(python: Path | str, args: list[str], **run: Any) -> int:
    """``uv pip install ARGS`` into ``python``'s environment with pip's index settings;
    uv's exit code. ``run``: more ``subprocess.Popen`` arguments (where output goes)."""
    settings = read_pip_settings()
    logger.debug(
        "pip's index settings for uv: %s", procs.redacted(" ".join(settings.uv_args())) or "none"
    )
    cmd = [sys.executable, "-m", "uv", "pip", "install", "--python", str(python), *args]
    with procs.started(
        [*cmd, *settings.uv_args()],
        stdin=subprocess.DEVNULL,
        env={**os.environ, **settings.uv_env()},
        **run,
    ) as proc:
        return proc.wait()


if __name__ == "__main__":
    sys.exit(uv_pip_install(sys.executable, sys.argv[1:]))
