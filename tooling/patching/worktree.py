"""The patch lifecycle as plain git operations on a work tree.

A work tree is a git repository whose first commit (tag ``baseline``) is the
upstream tree and whose later commits are the patches, one each, carrying
trailers that name the patch file and its digest. Identities and dates are
fixed so the same inputs give the same commit ids on every machine.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import git
from gitdb import IStream

from ..errors import WorkTreeError
from ..fetching import unpacked
from ..fsutil import check_creatable, discard, locked, staging_dir
from ..gitutil import git_error_lines

logger = logging.getLogger(__name__)

BASELINE_TAG = "baseline"
BRANCH = "dflash"
IDENTITY = ("vLLM DFlash distribution", "dflash@vllm-dflash.invalid")
#: 1980-01-01, the earliest date a zip (and so a wheel) can hold.
FIXED_DATE = "315532800 +0000"
TRAILER_FILE = "Patch-File"
TRAILER_SHA = "Patch-Sha256"
_TRAILERS = re.compile(rf"\n\n{TRAILER_FILE}: [^\n]+\n{TRAILER_SHA}: [0-9a-f]{{64}}\n$")

#: format-patch flags that make the output depend on the commit alone.
FORMAT_PATCH_FLAGS = (
    "--stdout",
    "--keep-subject",  # no "[PATCH]" prefix: the subject round-trips through am -k
    "--no-stat",  # a diffstat repeats the diff and churns on unrelated edits
    "--no-signature",  # no git version at the end of the file
    "--zero-commit",  # the From line would otherwise carry a machine-dependent commit id
    "--full-index",  # full blob ids, so --3way can find the preimage
    "--no-numbered",
    "--no-renames",
    "--abbrev=40",
    "--no-color",
)


def _text(value: str | bytes) -> str:
    """A commit's message or summary as text.

    GitPython types them ``str | bytes``: bytes where the commit's encoding fails.
    """
    return value if isinstance(value, str) else value.decode("utf-8", errors="replace")


def default_work_dir(
    version: str, git_commit: str | None = None, skipped: Sequence[str] = ()
) -> Path:
    """``build/work/vllm-<base>[-git-<commit>][-skip-<ids>]``, relative to the working folder:
    one tree per distinct series, so an ablation never reuses the full series' tree."""
    suffix = f"-git-{git_commit[:12]}" if git_commit else ""
    suffix += "".join(f"-skip-{s}" for s in skipped)
    return Path("build") / "work" / f"vllm-{version}{suffix}"


def git_env(author_date: str | None = None) -> dict[str, str]:
    name, email = IDENTITY
    env = {
        "GIT_AUTHOR_NAME": name,
        "GIT_AUTHOR_EMAIL": email,
        "GIT_COMMITTER_NAME": name,
        "GIT_COMMITTER_EMAIL": email,
        "GIT_COMMITTER_DATE": author_date or FIXED_DATE,
        "GIT_AUTHOR_DATE": author_date or FIXED_DATE,
        "GIT_CONFIG_NOSYSTEM": "1",
        "HOME": os.environ.get("HOME", "/"),
    }
    return env


@dataclass(frozen=True)
class SeriesCommit:
    sha: str
    subject: str
    patch_file: str | None
    patch_sha256: str | None


def _configure(repo: git.Repo) -> None:
    with repo.config_writer() as cw:
        cw.set_value("core", "autocrlf", "false")
        cw.set_value("core", "filemode", "true")
        cw.set_value("commit", "gpgsign", "false")
        cw.set_value("am", "threeWay", "false")
    # Probes import the tree, which writes bytecode; it is not part of any patch.
    exclude = Path(repo.git_dir) / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    exclude.write_text("__pycache__/\n*.pyc\n")


def check_work_dir(work_dir: Path | None) -> None:
    """A --work-dir given is one a tree can be made at (or is one), checked before anything
    is fetched: a name too long for its temp sibling, a file in its way or a folder nothing
    can be made in is one line (exit 13), not an OSError from deep inside the run."""
    if work_dir is not None:
        check_creatable(work_dir, "--work-dir", WorkTreeError)


def made_tree(work_dir: Path) -> git.Repo | None:
    """The work tree at ``work_dir`` when it is one ``tooling patch`` made (a repository
    with the baseline tag), else None."""
    try:
        repo = git.Repo(work_dir)
        repo.rev_parse(BASELINE_TAG)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError, git.BadName, ValueError):
        return None
    return repo


def person_work(work_dir: Path) -> list[str]:
    """What in an existing work tree this toolchain did not make (empty: safe to replace).

    Our commits carry our committer identity; a person's commit, amend or
    rebase carries theirs. Edited or new files count too, those vLLM's
    ``.gitignore`` hides among them (a log, a virtualenv, a build folder);
    bytecode does not: probes write it.
    """
    repo = made_tree(work_dir)
    if repo is None:
        return [f"{work_dir} is not a work tree made by `tooling patch`"]
    found = [
        f"commit {c.hexsha[:12]} {_text(c.summary)}"
        for c in repo.iter_commits(f"{BASELINE_TAG}..HEAD")
        if (c.committer.name, c.committer.email) != IDENTITY
    ]
    # An ignored folder is one line, however much it holds.
    status = repo.git.status("--porcelain", "--untracked-files=all", "--ignored=matching")
    for line in status.splitlines():
        state, path = line[:2], line[3:]
        if state != "!!":
            found.append(f"uncommitted {path}")
        elif not _is_bytecode(path):
            found.append(f"ignored {path}")
    return found


def _is_bytecode(path: str) -> bool:
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return name == "__pycache__" or name.endswith(".pyc")


def clear_way(work_dir: Path) -> Path | None:
    """Make room for a new tree at ``work_dir``: a person's work is moved aside, ours removed.

    Returns where a person's tree went (``<name>.saved-<time>``), or None.
    The caller holds ``locked(work_dir)``, so no other tooling process reads
    the old tree while it goes.
    """
    if not work_dir.exists():
        return None
    if person_work(work_dir):
        saved = work_dir.with_name(f"{work_dir.name}.saved-{time.strftime('%Y%m%d-%H%M%S')}")
        os.rename(work_dir, saved)
        logger.debug("moved %s aside to %s: it holds a person's work", work_dir, saved)
        return saved
    logger.debug("remove the old work tree %s", work_dir)
    discard(work_dir)
    return None


def create_from_tree(
    source_dir: Path, work_dir: Path, message: str, baselines: Path | None = None
) -> git.Repo:
    """A new work tree whose baseline commit holds exactly ``source_dir``'s files.

    With ``baselines`` (a cache folder) the baseline commit is made once per source
    folder and message (:func:`baseline_repo`) and each tree is a clone of it, rather
    than hashing, committing and copying vLLM's thousands of files again for every
    ``patch``, ``build`` and canary release. The commit is the same either way (fixed
    identity and date), so its id is too.
    """
    if baselines is not None:
        bare = baseline_repo(source_dir, message, baselines)
        # Not shared: the tree keeps its own objects (hard links to one pack where it can),
        # so it outlives a cleared cache.
        return create_from_clone(bare, BRANCH, work_dir, shared=False)
    logger.debug("work tree %s from a copy of %s", work_dir, source_dir)
    with staging_dir(work_dir) as tmp:
        shutil.copytree(source_dir, tmp, symlinks=True, dirs_exist_ok=True)
        repo = git.Repo.init(tmp, initial_branch=BRANCH)
        _configure(repo)
        _commit_baseline(repo, message)
        repo.git.tag(BASELINE_TAG)
    return git.Repo(work_dir)


def _commit_baseline(repo: git.Repo, message: str, **env: str) -> None:
    # --force: the sdist ships files its own .gitignore names (e.g. _version.py).
    repo.git.add("--all", "--force", env=env or None)
    repo.git.commit("--quiet", "--no-verify", "-m", message, env={**git_env(), **env})


def baseline_repo(source_dir: Path, message: str, baselines: Path) -> Path:
    """A bare repository under ``baselines`` whose branch holds ``source_dir``'s files as
    one commit; made once (under a lock), keyed by the folder, the message and the
    listing (names, sizes, mtimes) of what is in it, so a changed folder gets another."""
    source = source_dir.resolve()
    listing = hashlib.sha256(f"{source}\0{message}\0{unpacked.stamp(source.parent)}\0".encode())
    for path in sorted(source.rglob("*")):
        st = path.lstat()
        listing.update(f"{path.relative_to(source)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    bare = baselines / f"{listing.hexdigest()[:32]}.git"
    with locked(bare):
        if bare.is_dir():
            logger.debug("baseline of %s: %s", source, bare)
            return bare
        logger.debug("commit %s as a baseline in %s", source, bare)
        with staging_dir(bare) as tmp:
            repo = git.Repo.init(tmp, bare=True, initial_branch=BRANCH)
            _configure(repo)
            # Hashed straight from the source folder: nothing is copied, nothing written there.
            _commit_baseline(
                repo, message, GIT_WORK_TREE=str(source), GIT_INDEX_FILE=str(Path(tmp) / "index")
            )
            repo.git.repack("-a", "-d", "-q", "--window=0")
    return bare


def create_from_clone(clone: Path, commit: str, work_dir: Path, *, shared: bool = True) -> git.Repo:
    """A new work tree from a cached clone; the baseline is the upstream commit itself."""
    logger.debug("work tree %s from %s at %s", work_dir, clone, commit)
    with staging_dir(work_dir) as tmp:
        repo = git.Repo.clone_from(str(clone), tmp, shared=shared, no_checkout=True)
        _configure(repo)
        repo.git.checkout("--quiet", "-B", BRANCH, commit)
        repo.git.tag(BASELINE_TAG, commit)
    return git.Repo(work_dir)


def apply_check(repo: git.Repo, patch: Path, *, reverse: bool = False) -> tuple[bool, str]:
    """Would ``patch`` apply (or, reversed, un-apply) exactly? (ok, git's complaint)."""
    args = ["--check", "--verbose"]
    if reverse:
        args.append("--reverse")
    try:
        repo.git.apply(*args, str(patch))
        return True, ""
    except git.GitCommandError as e:
        return False, "\n".join(git_error_lines(e))


def seed_preimages(repo: git.Repo, contents: list[bytes]) -> None:
    """Store the blobs a patch was made against, so ``am --3way`` can build its ancestor."""
    for data in contents:
        repo.odb.store(IStream(b"blob", len(data), io.BytesIO(data)))


def am(repo: git.Repo, patch: Path, trailers: dict[str, str], *, three_way: bool = False) -> str:
    """Commit ``patch`` with ``git am`` (strict unless ``three_way``) and add our trailers.

    Raises git.GitCommandError after restoring the tree when the patch fails.
    """
    args = ["--quiet", "--keep", "--keep-cr", "--committer-date-is-author-date"]
    args.append("--3way" if three_way else "--no-3way")
    try:
        repo.git.am(*args, str(patch), env=git_env())
    except git.GitCommandError:
        repo.git.am("--abort")
        raise
    message = _text(repo.head.commit.message).rstrip("\n")
    lines = "".join(f"{k}: {v}\n" for k, v in trailers.items())
    date = repo.head.commit.authored_datetime
    stamp = f"{int(date.timestamp())} {date.strftime('%z')}"
    repo.git.commit(
        "--amend",
        "--quiet",
        "--no-verify",
        "-m",
        f"{message}\n\n{lines}",
        env={
            **git_env(stamp),
            "GIT_AUTHOR_NAME": repo.head.commit.author.name,
            "GIT_AUTHOR_EMAIL": repo.head.commit.author.email,
        },
    )
    return repo.head.commit.hexsha


def reset_to(repo: git.Repo, rev: str) -> None:
    repo.git.reset("--quiet", "--hard", rev)


def series_commits(repo: git.Repo) -> list[SeriesCommit]:
    """The commits after the baseline, oldest first, with their patch trailers."""
    out = []
    for commit in reversed(list(repo.iter_commits(f"{BASELINE_TAG}..HEAD"))):
        message = _text(commit.message)
        file_m = re.search(rf"^{TRAILER_FILE}: (.+)$", message, re.M)
        sha_m = re.search(rf"^{TRAILER_SHA}: ([0-9a-f]{{64}})$", message, re.M)
        out.append(
            SeriesCommit(
                sha=commit.hexsha,
                subject=message.splitlines()[0] if message else "",
                patch_file=file_m.group(1).strip() if file_m else None,
                patch_sha256=sha_m.group(1) if sha_m else None,
            )
        )
    return out


def format_patch(repo: git.Repo, commit: str) -> bytes:
    """The patch file for ``commit``, byte-stable, without our bookkeeping trailers."""
    raw = repo.git.format_patch(
        *FORMAT_PATCH_FLAGS, "-1", commit, stdout_as_string=False, strip_newline_in_stdout=False
    )
    # With --no-stat there is no "---" line: the message ends where the diff starts.
    head, sep, diff = raw.partition(b"\ndiff --git ")
    head = _TRAILERS.sub("\n", head.decode("utf-8")).encode("utf-8")
    return head + sep + diff


def changed_files(repo: git.Repo, rev_from: str = BASELINE_TAG, rev_to: str = "HEAD") -> list[str]:
    out = repo.git.diff("--name-only", "--no-renames", rev_from, rev_to)
    return [line for line in out.splitlines() if line]


def read_blob(repo: git.Repo, rev: str, path: str) -> bytes:
    return repo.git.show(f"{rev}:{path}", stdout_as_string=False, strip_newline_in_stdout=False)
