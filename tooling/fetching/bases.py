"""The pinned upstream bases (``patches/bases.toml``) as typed data."""

from __future__ import annotations

import datetime as dt
import logging
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, UnknownBaseError
from ..schema import Doc
from .gitinput import checked

logger = logging.getLogger(__name__)

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
    bundle_excludes: tuple[str, ...] = ()
    """Packages ``tooling bundle`` leaves out of the resolution itself: its wheel pins a
    version the index no longer serves, of a package the bundle does not carry anyway."""


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


#: The keys each table may hold; any other is a typo that would be ignored.
_TOP_KEYS = frozenset({"default", "git_url", "bases"})
_BASE_KEYS = frozenset({"release_date", "probe_env", "sdist", "wheel", "git", "bundle_excludes"})
_ARTIFACT_KEYS = frozenset({"filename", "size", "sha256", "wheel_commit"})
_GIT_KEYS = frozenset({"tag", "commit", "commit_verified"})


def _artifact(table: Any, doc: Doc) -> Artifact:
    doc.only_keys(table, _ARTIFACT_KEYS)
    # The cache keeps the file under this name: a path would write outside it.
    filename = doc.file_name(table, "filename")
    sha256 = doc.sha256(table, "sha256")
    size = doc.whole(table, "size", None, least=1)
    return Artifact(filename=filename, sha256=sha256, size=size)


def _base(version: str, table: Any, path: Path) -> Base:
    doc = Doc(f"{path}: [bases.{version!r}]", ConfigError)
    doc.only_keys(table, _BASE_KEYS)
    git = doc.table(table, "git")
    git_doc = doc.inner(".git")
    git_doc.only_keys(git, _GIT_KEYS)
    pin = GitPin(
        tag=checked(git_doc.text(git, "tag"), f"{git_doc.where}: tag", ConfigError),
        commit=git_doc.text(git, "commit").lower(),
        commit_verified=git_doc.flag(git, "commit_verified", False),
    )
    if not _HEX_PREFIX.match(pin.commit):
        git_doc.fail(f"commit {pin.commit!r} is not a hex SHA or prefix")
    released = doc.text(table, "release_date")
    try:
        dt.date.fromisoformat(released)
    except ValueError:
        doc.fail(f"release_date {released!r} is not a date (YYYY-MM-DD)")
    wheel = doc.table(table, "wheel", None)
    wheel_doc = doc.inner(".wheel")
    return Base(
        version=version,
        release_date=released,
        probe_env=doc.text(table, "probe_env", "latest"),
        sdist=_artifact(doc.table(table, "sdist"), doc.inner(".sdist")),
        git=pin,
        wheel=_artifact(wheel, wheel_doc) if wheel is not None else None,
        wheel_commit=wheel_doc.text(wheel, "wheel_commit", None) if wheel is not None else None,
        bundle_excludes=doc.texts(table, "bundle_excludes", ()),
    )


def load_bases(path: Path) -> BaseCatalog:
    """Parse and validate ``bases.toml``."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such bases file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the bases file ({e.strerror or e})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    doc = Doc(str(path), ConfigError)
    doc.only_keys(data, _TOP_KEYS)
    tables = doc.table(data, "bases", {})
    bases = {version: _base(version, t, path) for version, t in tables.items()}
    if not bases:
        raise ConfigError(f"{path}: pins no bases")
    default = doc.text(data, "default", next(iter(bases)))
    if default not in bases:
        raise ConfigError(f"{path}: default base {default!r} is not pinned")
    logger.debug("%s: %d pinned bases, default %s", path, len(bases), default)
    return BaseCatalog(
        path=path,
        default=default,
        git_url=checked(
            doc.text(data, "git_url", "https://github.com/vllm-project/vllm.git"),
            f"{path}: git_url",
            ConfigError,
        ),
        bases=bases,
    )
