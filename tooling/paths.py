"""Where things live: the patch data, the per-user cache, the work trees."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent


def default_patches_dir(environ: Mapping[str, str]) -> Path:
    """``environ``'s ``TOOLING_PATCHES_DIR``, else the ``patches/`` beside this package."""
    env = environ.get("TOOLING_PATCHES_DIR")
    path = Path(env) if env else REPO_DIR / "patches"
    if not path.is_dir():
        raise ConfigError(f"{path}: no patches folder (set TOOLING_PATCHES_DIR)")
    return path


def default_cache_dir(environ: Mapping[str, str]) -> Path:
    """``environ``'s ``VLLM_DFLASH_CACHE``, else ``$XDG_CACHE_HOME/vllm-dflash`` (XDG base
    dirs)."""
    env = environ.get("VLLM_DFLASH_CACHE")
    if env:
        return Path(env)
    xdg = environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "vllm-dflash"


@dataclass(frozen=True)
class CacheLayout:
    """The folders inside the cache. Everything here can be deleted and refetched."""

    root: Path
    probe_verdicts: bool = True
    """False: probe runs neither read nor keep verdicts (``probes`` is None)."""

    @property
    def artifacts(self) -> Path:
        return self.root / "pypi"

    @property
    def git(self) -> Path:
        return self.root / "git"

    @property
    def sources(self) -> Path:
        return self.root / "sources"

    @property
    def envs(self) -> Path:
        return self.root / "envs"

    @property
    def trained(self) -> Path:
        """The training recipe's run folders, one per recipe digest."""
        return self.root / "trained"

    @property
    def baselines(self) -> Path:
        """Each unpacked source's baseline commit, made once (``worktree.baseline_repo``)."""
        return self.root / "baselines"

    @property
    def bytecode(self) -> Path:
        """(source, pyc) pairs verify found equal (``verifying.bytecode``)."""
        return self.root / "bytecode"

    @property
    def probes(self) -> Path | None:
        """Probe verdicts by what the probes imported (``tooling.probing.cache``); None when
        they are not used."""
        return self.root / "probes" if self.probe_verdicts else None
