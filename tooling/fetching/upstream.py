"""One view of a fetched upstream base, whichever way it was fetched."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..procs import redacted
from .bases import Base, BaseCatalog
from .fetch import FetchOptions, ensure_artifact, fetch_pypi
from .gitsource import GitSource, fetch_git

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Upstream:
    base: Base
    source: str
    """"pypi" or "git"."""
    source_dir: Path
    """The pristine tree that holds ``vllm/``."""
    wheel: Path | None
    sdist: Path | None = None
    git: GitSource | None = None

    @property
    def identity(self) -> str:
        """What distinguishes this tree from any other: the sdist digest or the commit."""
        if self.git is not None:
            return f"git:{self.git.commit}"
        return f"sdist:{self.base.sdist.sha256}"

    def artifacts(self) -> list[dict[str, Any]]:
        """The upstream inputs, with digests, for manifests and reports."""
        out: list[dict[str, Any]] = []
        if self.sdist is not None:
            out.append(
                {
                    "kind": "sdist",
                    "file": self.base.sdist.filename,
                    "sha256": self.base.sdist.sha256,
                }
            )
        if self.git is not None:
            out.append(
                {
                    "kind": "git",
                    "url": self.git.url,
                    "ref": self.git.ref,
                    "ref_kind": self.git.ref_kind,
                    "commit": self.git.commit,
                }
            )
        if self.wheel is not None and self.base.wheel is not None:
            out.append(
                {
                    "kind": "wheel",
                    "file": self.base.wheel.filename,
                    "sha256": self.base.wheel.sha256,
                }
            )
        return out


@dataclass(frozen=True)
class GitRequest:
    url: str
    ref: str | None = None
    allow_moving_ref: bool = False


@dataclass(frozen=True)
class SourceRequest:
    """Which upstream a command asks for (``--base``, ``--source``, ``--git-url``, ``--ref``,
    ``--allow-moving-ref``); unset fields mean bases.toml's defaults."""

    base_version: str | None = None
    source: str = "pypi"
    git_url: str | None = None
    ref: str | None = None
    allow_moving_ref: bool = False


def fetch_requested(
    catalog: BaseCatalog,
    request: SourceRequest,
    options: FetchOptions,
    *,
    with_wheel: bool = True,
    verify_wheel: bool = True,
) -> Upstream:
    """``request`` resolved against ``catalog`` (the pinned base, the git remote) and fetched."""
    git_request = None
    if request.source == "git":
        git_request = GitRequest(
            url=request.git_url or catalog.git_url,
            ref=request.ref,
            allow_moving_ref=request.allow_moving_ref,
        )
    return fetch_upstream(
        catalog.get(request.base_version),
        options,
        git=git_request,
        with_wheel=with_wheel,
        verify_wheel=verify_wheel,
    )


def fetch_upstream(
    base: Base,
    options: FetchOptions,
    *,
    git: GitRequest | None = None,
    with_wheel: bool = True,
    verify_wheel: bool = True,
) -> Upstream:
    """Fetch ``base`` from PyPI (default) or from git; the official wheel always comes from PyPI.

    ``verify_wheel=False``: the caller verifies the cached wheel itself (see ensure_artifact).
    """
    logger.debug(
        "fetch vLLM %s from %s", base.version, "PyPI" if git is None else redacted(git.url)
    )
    if git is None:
        src = fetch_pypi(base, options, with_wheel=with_wheel, verify_wheel=verify_wheel)
        return Upstream(base, "pypi", src.source_dir, src.wheel, sdist=src.sdist)
    fetched = fetch_git(
        base,
        options.cache,
        url=git.url,
        ref=git.ref,
        allow_moving_ref=git.allow_moving_ref,
        offline=options.offline,
    )
    wheel = (
        ensure_artifact(base.wheel, options, verify=verify_wheel)
        if with_wheel and base.wheel
        else None
    )
    return Upstream(base, "git", fetched.source_dir, wheel, git=fetched)
