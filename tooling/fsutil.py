"""Small file-system helpers: digests and writes that never leave half a file."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from .errors import CacheWriteError, ToolingError

CHUNK = 1 << 20

logger = logging.getLogger(__name__)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_bounded(path: Path, limit: int, what: str, error: type[ToolingError]) -> bytes:
    """``path``'s bytes, at most ``limit`` of them: a file larger than ``what`` can be (or a
    device that never ends, /dev/zero) is refused after ``limit`` + 1 bytes, never read
    whole. Either is ``error``, one line naming the file."""
    try:
        with path.open("rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise error(f"{path}: cannot read {what} ({e.strerror or e})") from None
    if len(data) > limit:
        raise error(f"{path}: over {limit} bytes: not {what}")
    return data


#: The characters of a temp sibling's 8 random ones, as ``tempfile`` draws them.
_NAME_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789_"


def _temp_sibling(target: Path) -> Path:
    """A name for ``target``'s temp sibling, ``.NAME.XXXXXXXX.part``; nothing is made."""
    token = "".join(secrets.choice(_NAME_CHARS) for _ in range(8))
    return target.parent / f".{target.name}.{token}.part"


@contextlib.contextmanager
def atomic_output(target: Path, *, durable: bool = True) -> Iterator[BinaryIO]:
    """Open a binary temp file beside ``target``; rename it over ``target`` only on success.

    The temp file lives in the same folder so the rename is atomic, and its
    name starts with a dot so a crash leaves nothing that looks like a result.
    ``durable`` adds an fsync before the rename, so a power cut cannot leave an
    empty file under the final name; outputs that are rebuilt from the cache in
    a second can skip it.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    # The name is chosen before the file is made, and the file made inside the block that
    # removes it: a signal raised the moment it exists (the CLI raises SIGTERM and SIGHUP
    # where the program stands) still finds its name to remove.
    tmp = _temp_sibling(target)
    try:
        while True:
            try:
                # 0o666 less the umask: a result's permissions, as any other file gets.
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
                break
            except FileExistsError:
                tmp = _temp_sibling(target)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(target: Path, text: str) -> None:
    # UTF-8 whatever the locale: every reader of these files (series.toml, the
    # lock, reports, release notes) reads UTF-8.
    with atomic_output(target) as f:
        f.write(text.encode("utf-8"))


def lock_path(target: Path) -> Path:
    return target.parent / f".{target.name}.lock"


def _leftovers(target: Path) -> list[Path]:
    """``target``'s temp siblings (``atomic_output``'s and ``staging_dir``'s ``.part``, a
    removal's ``.old``): ``.<name>.<mkstemp's 8 characters>.<part|old>``."""
    shape = re.compile(rf"^\.{re.escape(target.name)}\.[a-z0-9_]{{8}}\.(part|old)$")
    try:
        names = os.listdir(target.parent)
    except OSError:
        return []
    return [target.parent / n for n in names if shape.match(n)]


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):  # gone meanwhile, or a read-only cache: it stays
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


@contextlib.contextmanager
def locked(target: Path) -> Iterator[None]:
    """Hold the exclusive lock of ``target`` (a folder or file that processes share).

    Several tooling processes (CI jobs, two terminals, --skip variants) may
    want the same work tree or cache entry at once; each holds this lock while
    it creates, reads or replaces ``target``. The lock is the kernel's
    (``flock``), so it is released when its holder dies, however it dies.
    The holder removes the lock file on the way out; a waiter that then holds
    a removed file's lock starts over on the new one.

    Only a holder writes ``target``'s temp siblings, so those a new holder
    finds are a dead holder's (killed before its clean-up ran): they are
    removed on taking the lock.
    """
    path = lock_path(target)
    waited = False
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            if target.exists():
                # A read-only folder: nobody changes the entry, so reading needs no lock.
                yield
                return
            raise CacheWriteError(
                f"cannot write to {path.parent}: {e.strerror} (needed to create {target.name})"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not waited:
                logger.info("waiting for another tooling process using %s", target)
                waited = True
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    for leftover in _leftovers(target):
        _remove(leftover)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


#: A run folder's name (``run_prefix``): its kind, the pid of the process that made it, and
#: the 8 characters mkdtemp adds.
_RUN_FOLDER = re.compile(r"^dflash-[a-z-]+-(\d+)-[a-z0-9_]{8}$")


def run_prefix(prefix: str) -> str:
    """The mkdtemp prefix of a run's temp folder (``prefix`` is ``dflash-<kind>-``): it names
    this process, so once that is gone without removing it, ``dead_run_folders`` finds it."""
    return f"{prefix}{os.getpid()}-"


def dead_run_folders(parent: Path) -> list[Path]:
    """This user's run folders in ``parent`` whose process no longer runs."""
    found = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return []
    for entry in entries:
        match = _RUN_FOLDER.match(entry.name)
        try:
            if not match or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            found.append(Path(entry.path))
        except (PermissionError, OverflowError):
            pass  # alive (another user's), or no pid at all
    return found


#: What the temp siblings a folder is made and locked as add to its name
#: (``.NAME.XXXXXXXX.part``, ``.NAME.lock``, the recipe's ``.NAME.tmp-PID``), at most.
SIBLING_CHARS = 16


def check_creatable(
    path: Path, what: str, error: type[ToolingError], *, writable: bool = True
) -> None:
    """``path`` can become a folder here, or is one: each name in it fits the file system
    (the last with room for its temp siblings), its nearest existing part is a folder, not
    a file, and (``writable``) a folder can be made in that one. A refusal is ``error``,
    one line naming ``what``, before any work: these were an ENAMETOOLONG, a
    NotADirectoryError or a permission error from deep inside a run."""
    path = Path(os.path.abspath(path))
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise error(f"{what} {path}: {existing} is a file, not a folder")
    try:
        longest = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        longest = 255
    for i, name in enumerate(path.parts[1:], start=1):
        room = SIBLING_CHARS if i == len(path.parts) - 1 else 0
        if len(os.fsencode(name)) + room > longest:
            raise error(
                f"{what} {path}: the name {name[:20]}... is {len(os.fsencode(name))} bytes; "
                f"at most {longest - room} fit here"
            )
    # Where it is made (beside it, as its temp sibling, when it is there already).
    made_in = path.parent if existing == path else existing
    if writable:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".dflash-check-", dir=made_in))
        except OSError as e:
            raise error(
                f"{what} {path}: cannot make folders in {made_in} ({e.strerror or e})"
            ) from None


def discard(folder: Path) -> None:
    """Remove a folder of ours. Renamed first, so an interrupted removal never leaves half a
    folder under the real name (the ``.old`` sibling goes with the next lock's holder)."""
    trash = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".old", dir=folder.parent))
    os.rename(folder, trash / folder.name)
    shutil.rmtree(trash)


@contextlib.contextmanager
def run_scratch(kind: str, given: Path | None = None) -> Iterator[Path]:
    """The run's scratch folder: ``given`` (a caller's, which it removes), else a new one
    in the temp folder named for this process (``dflash-KIND-<pid>-...``), removed on any
    exit. Children get it as their TMPDIR, so what they leave (pip's build tracker and
    unpacked wheels, torch's compile caches) goes with it; one a killed run left is removed
    by the next run that makes one."""
    if given is not None:
        yield given
        return
    for dead in dead_run_folders(Path(tempfile.gettempdir())):
        shutil.rmtree(dead, ignore_errors=True)
    folder = Path(tempfile.mkdtemp(prefix=run_prefix(f"dflash-{kind}-")))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def staging_dir(target: Path) -> Iterator[Path]:
    """A temp folder beside ``target`` that becomes ``target`` only on success.

    ``target`` must not exist when the folder is committed: a tree is never
    deleted here, since another process may be reading it (callers hold
    ``locked(target)`` and clear the way themselves).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    # As ``atomic_output``'s file: named first, made inside the block that removes it.
    tmp = _temp_sibling(target)
    try:
        while True:
            try:
                os.mkdir(tmp, 0o700)
                break
            except FileExistsError:
                tmp = _temp_sibling(target)
        yield tmp
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
