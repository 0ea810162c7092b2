"""The pinned upstream bases (``patches/bases.toml``) as typed data."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, UnknownBaseError
from .gitinput import checked

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEX_PREFIX = re.compile(r"^[0-9a-f]{7,40}$")


@dataclass(frozen=True)
class Artifact:
    """One file on the package index, pinned by name, size and sha256."""

    filename: str
    sha256: str
    size: int | None = None


@dataclass(frozen=True)
class GitPin:
    tag: str
    commit: str
    """Full SHA, or an abbreviated prefix when ``commit_verified`` is false."""
    commit_verified: bool


@dataclass(frozen=True)
class Base:
    version: str
    release_date: str
    probe_env: str
    sdist: Artifact
    git: GitPin
    wheel: Artifact | None = None
    wheel_commit: str | None = None


@dataclass(frozen=True)
class BaseCatalog:
    path: Path
    default: str
    git_url: str
    bases: dict[str, Base]

    def get(self, version: str | None) -> Base:
        """The pinned base ``version`` (the default base when None)."""
        key = version or self.default
        try:
            return self.bases[key]
        except KeyError:
            known = ", ".join(self.bases)
            raise UnknownBaseError(
                f"unknown base vLLM {key!r}: {self.path} pins only {known}"
            ) from None

    def select(self, versions: list[str]) -> list[Base]:
        return [self.get(v) for v in versions]

    def selection(self, spec: str) -> list[Base]:
        """``all`` (every pinned release, in bases.toml's order) or comma-separated versions."""
        if spec == "all":
            return list(self.bases.values())
        versions = [v.strip() for v in spec.split(",") if v.strip()]
        if not versions:
            # A canary over no release checks nothing: that is no pass.
            raise UnknownBaseError(f"releases {spec!r} name none: give versions, or all")
        return self.select(versions)


def _artifact(table: dict, where: str) -> Artifact:
    try:
        filename = str(table["filename"])
        sha256 = str(table["sha256"]).lower()
    except KeyError as missing:
        raise ConfigError(f"{where}: missing key {missing}") from None
    if not _HEX64.match(sha256):
        raise ConfigError(f"{where}: sha256 {sha256!r} is not 64 hex digits")
    size = table.get("size")
    return Artifact(filename=filename, sha256=sha256, size=int(size) if size is not None else None)


def _base(version: str, table: dict, path: Path) -> Base:
    where = f"{path}: [bases.{version!r}]"
    try:
        git = table["git"]
        pin = GitPin(
            tag=checked(str(git["tag"]), f"{where}.git: tag", ConfigError),
            commit=str(git["commit"]).lower(),
            commit_verified=bool(git.get("commit_verified", False)),
        )
        if not _HEX_PREFIX.match(pin.commit):
            raise ConfigError(f"{where}.git: commit {pin.commit!r} is not a hex SHA or prefix")
        return Base(
            version=version,
            release_date=str(table["release_date"]),
            probe_env=str(table.get("probe_env", "latest")),
            sdist=_artifact(table["sdist"], f"{where}.sdist"),
            git=pin,
            wheel=_artifact(table["wheel"], f"{where}.wheel") if "wheel" in table else None,
            wheel_commit=table.get("wheel", {}).get("wheel_commit"),
        )
    except KeyError as missing:
        raise ConfigError(f"{where}: missing key {missing}") from None


def load_bases(path: Path) -> BaseCatalog:
    """Parse and validate ``bases.toml``."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such bases file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    bases = {str(v): _base(str(v), t, path) for v, t in data.get("bases", {}).items()}
    if not bases:
        raise ConfigError(f"{path}: pins no bases")
    default = str(data.get("default", next(iter(bases))))
    if default not in bases:
        raise ConfigError(f"{path}: default base {default!r} is not pinned")
    return BaseCatalog(
        path=path,
        default=default,
        git_url=checked(
            str(data.get("git_url", "https://github.com/vllm-project/vllm.git")),
            f"{path}: git_url",
            ConfigError,
        ),
        bases=bases,
    )
