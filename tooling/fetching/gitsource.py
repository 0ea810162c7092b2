"""Fetch upstream vLLM from git at a pinned commit (GitPython).

The cache keeps one bare clone per remote URL holding its branches and tags.
A ref resolves to a commit here and nowhere else, and a branch name is refused
unless the caller says a moving ref is wanted: a force-pushed branch once
shipped an engine that booted and emitted garbage.
"""

from __future__ import annotations

import hashlib
import logging
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

import git

from ..errors import ArchiveError, CacheMissError, GitSourceError
from ..fsutil import locked, staging_dir
from ..gitutil import git_error_summary
from ..paths import CacheLayout
from ..procs import redacted
from .bases import Base
from .gitinput import ALLOWED_PROTOCOLS, checked

logger = logging.getLogger(__name__)

_REFSPECS = ["+refs/heads/*:refs/heads/*", "+refs/tags/*:refs/tags/*"]
_HEX = re.compile(r"^[0-9a-f]{7,40}$")


@dataclass(frozen=True)
class GitSource:
    base: Base
    url: str
    ref: str
    ref_kind: str
    """"tag", "commit" or "branch"."""
    commit: str
    clone: Path
    source_dir: Path
    """A plain export of ``commit``: the folder that holds ``vllm/``."""


def clone_dir(cache: CacheLayout, url: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", url.rstrip("/").rsplit("/", 1)[-1]).strip("-") or "repo"
    return cache.git / f"{slug}-{hashlib.sha256(url.encode()).hexdigest()[:12]}.git"


def _fetch(repo: git.Repo, url: str, *options: str) -> None:
    # "--": whatever the URL looks like, git takes it as the repository.
    try:
        repo.git.fetch(*options, "--", url, *_REFSPECS, env=ALLOWED_PROTOCOLS)
    except git.GitCommandError as e:
        summary = git_error_summary(e)
        raise GitSourceError(f"git remote {url} cannot be read: {summary}") from None


def update_clone(url: str, cache: CacheLayout, offline: bool) -> git.Repo:
    """Create or refresh the cached bare clone of ``url`` (locked: one writer at a time)."""
    path = clone_dir(cache, url)
    with locked(path):
        if path.is_dir():
            logger.debug("cached clone of %s: %s", redacted(url), path)
            repo = git.Repo(path)
            if not offline:
                _fetch(repo, url, "--prune")
            return repo
        if offline:
            raise CacheMissError(f"--offline: no cached clone of {url} in {cache.git}")
        with staging_dir(path) as tmp:
            _fetch(git.Repo.init(tmp, bare=True), url)
        return git.Repo(path)


def resolve_ref(repo: git.Repo, ref: str) -> tuple[str, str]:
    """(kind, commit SHA) for ``ref``: a tag, a branch, or a commit id."""
    for kind, name in (("tag", f"refs/tags/{ref}"), ("branch", f"refs/heads/{ref}")):
        try:
            return kind, repo.git.rev_parse("--verify", "--quiet", f"{name}^{{commit}}")
        except git.GitCommandError:
            continue
    if _HEX.match(ref):
        try:
            return "commit", repo.git.rev_parse("--verify", "--quiet", f"{ref}^{{commit}}")
        except git.GitCommandError:
            pass
    raise GitSourceError(f"ref {ref!r} does not exist in {repo.git_dir}")


def check_pin(
    repo: git.Repo, base: Base, ref: str, kind: str, commit: str, allow_moving_ref: bool
) -> None:
    """The ref must be the base it will be labelled as: its pinned commit, or (a moving ref
    asked for) a descendant of it. Refuses branches unless allowed, and a pinned tag that moved.
    """
    if kind == "branch" and not allow_moving_ref:
        raise GitSourceError(
            f"ref {ref!r} is a branch (a moving ref); pin a tag or commit, "
            "or pass --allow-moving-ref"
        )
    if commit.startswith(base.git.commit):
        return
    if ref == base.git.tag:
        raise GitSourceError(
            f"tag {ref} resolves to {commit}, but bases.toml pins {base.git.commit} "
            f"for vLLM {base.version}"
        )
    if not allow_moving_ref:
        raise GitSourceError(
            f"ref {ref!r} resolves to {commit[:12]}, which is not vLLM {base.version} "
            f"({base.git.tag} = {base.git.commit[:12]}); pass the --base it belongs to"
        )
    try:
        repo.git.merge_base("--is-ancestor", base.git.commit, commit)
    except git.GitCommandError:
        raise GitSourceError(
            f"ref {ref!r} ({commit[:12]}) does not descend from vLLM {base.version} "
            f"({base.git.tag} = {base.git.commit[:12]}); pass the --base it belongs to"
        ) from None


def export_tree(repo: git.Repo, commit: str, dest: Path) -> Path:
    """Write the files of ``commit`` to ``dest`` (atomically, locked) via ``git archive``."""
    with locked(dest):
        if dest.is_dir():
            return dest
        try:
            with staging_dir(dest) as tmp:
                archive = tmp / ".export.tar"
                with open(archive, "wb") as out:
                    repo.git.archive(commit, format="tar", output_stream=out)
                with tarfile.open(archive) as tar:
                    tar.extractall(tmp, filter="data")
                archive.unlink()
                if not (tmp / "vllm").is_dir():
                    raise GitSourceError(f"commit {commit} has no vllm/ package at its root")
        except (git.GitCommandError, tarfile.TarError) as e:
            raise ArchiveError(f"cannot export commit {commit}: {e}") from None
        return dest


def fetch_git(
    base: Base,
    cache: CacheLayout,
    *,
    url: str,
    ref: str | None = None,
    allow_moving_ref: bool = False,
    offline: bool = False,
) -> GitSource:
    """Clone or update ``url``, resolve ``ref`` (default: the base's tag) and export it."""
    url = checked(url, "git URL", GitSourceError)
    ref = checked(ref or base.git.tag, "ref", GitSourceError)
    repo = update_clone(url, cache, offline)
    kind, commit = resolve_ref(repo, ref)
    logger.debug("%s %s is commit %s", kind, ref, commit)
    check_pin(repo, base, ref, kind, commit, allow_moving_ref)
    source_dir = export_tree(repo, commit, cache.sources / f"git-{commit}")
    return GitSource(
        base=base,
        url=url,
        ref=ref,
        ref_kind=kind,
        commit=commit,
        clone=Path(repo.git_dir),
        source_dir=source_dir,
    )
