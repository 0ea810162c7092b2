"""Probe verdicts kept by what the probes loaded: a tree already probed is not probed again.

A probe run imports torch and vLLM in a fresh interpreter, which is slow, and the
toolchain probes byte-identical trees again and again (the stock and the patched
0.20.1 in ``patch``, ``build``, ``verify``, the canary and the tests). A run's
verdicts are kept under the cache (``<cache>/probes``), keyed in two levels as
ccache's manifest mode keys a compile:

- known before the run (the folder): the probes' sources (what is copied into
  the child), the interpreter's path, the probe names, and the child's
  environment variables that can change what vLLM, torch or transformers do;
- what the run loaded, as the child reported it (``child.imports``): the content
  of every imported file and every mapped shared library, of the bytecode read for
  them unless it lies under the prefix the toolchain gave (a ``.pth`` that moves
  ``sys.pycache_prefix`` elsewhere moves what runs), the names in every
  package folder a module came from (a module added there can change what an
  import finds), and in every search-path folder the entries an imported
  top-level name could resolve to, with the ``.pth`` files' content. Every such
  list a run reported is kept; a lookup hashes what each lists as it is now and
  looks for verdicts under that digest.

Paths under the probed tree (``ProbeTarget.root`` and ``extra_path``) are
recorded relative to it, so copies of one tree (the sdist and a work tree's
baseline) share verdicts; everything else by absolute path.

Compiled files are hashed by content like any file: a cache that missed a
rebuilt library would be worse than reading it. Reading torch's 560 MB of
libraries and 4500 modules on every lookup would cost seconds, so the digest of
a file outside the probed tree, or of 1 MiB or more anywhere, is remembered by
its (device, inode, size, mtime, ctime) in ``stat-memo.json``; the probed tree's
own modules (small, and copied to new temp folders all the time) are read every
time. ctime cannot be set from user space, so a write to a file shows, as does
a file renamed over it (another inode); a digest is remembered only once the
file has been still for two seconds, so a write within the same clock tick as
the hash cannot hide behind an equal stat.

Never cached: a run with an unknown verdict, one that failed or timed out, one
whose child did not report its imports, and one during which a listed file or
folder changed (a mtime or ctime not older than the run's start). Files read
without an import (a distribution's METADATA) are not listed: they change with
an install, which changes the installed modules too. Entries are written to a
temp file and renamed, so processes at once (xdist workers, two builds) are
safe; an entry that does not read back is ignored and the next run replaces it.
A run whose target names no cache folder neither reads nor writes one
(``TOOLING_NO_PROBE_CACHE=1`` at the command line).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..fsutil import atomic_output, sha256_bytes, sha256_file
from ..probes.result import ProbeResult, ProbeStatus

logger = logging.getLogger(__name__)

SCHEMA = 1
#: Files of the probed tree at least this large have their digest remembered by stat.
MEMO_MIN_SIZE = 1 << 20
#: A file must have been still this long before its digest is remembered by stat.
_SETTLED_NS = 2_000_000_000
#: Import lists kept (and tried) per folder, newest first: one per distinct set of
#: loaded files, e.g. one per release the canary probes.
_MAX_LISTS = 64
#: The child's environment variables that can change what the probed code does.
_ENV_PREFIXES = (
    "VLLM_",
    "TORCH",
    "PYTORCH_",
    "HF_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "CUDA_",
    "OMP_",
    "MKL_",
    "TRITON_",
    "PYTHON",
    "LD_",
)
#: Where bytecode is written, not what runs.
_ENV_IGNORED = frozenset({"PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE"})
_MISSING = "missing"


def relevant_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of a probe run's environment that can change what the probed code
    (vLLM, torch, transformers and their kin) does."""
    return {k: v for k, v in env.items() if k.startswith(_ENV_PREFIXES) and k not in _ENV_IGNORED}


@dataclass(frozen=True)
class Hit:
    """Verdicts an earlier run gave a tree that loads the same bytes."""

    results: dict[str, ProbeResult]
    vllm_version: str | None
    entry: Path


@dataclass
class _Hasher:
    """Digests of listed things for one lookup or store, big files remembered by stat."""

    memo_path: Path
    roots: tuple[str, ...]
    top_level: frozenset[str] = frozenset()
    memo: dict[str, list[Any]] = field(default_factory=dict)
    seen: dict[tuple[str, str, frozenset[str]], str] = field(default_factory=dict)
    dirty: bool = False

    @classmethod
    def load(cls, memo_path: Path, roots: tuple[str, ...]) -> _Hasher:
        try:
            memo = json.loads(memo_path.read_text())
            if not isinstance(memo, dict):
                memo = {}
        except (OSError, ValueError):
            memo = {}  # none yet, or unreadable: rebuilt as files are hashed
        return cls(memo_path, roots, memo=memo)

    def digest(self, kind: str, path: str) -> str:
        # A search-path entry's digest depends on the top-level names of the list at hand.
        key = (kind, path, self.top_level if kind == "path" else frozenset())
        if key not in self.seen:
            self.seen[key] = {"file": self._file, "dir": self._dir, "path": self._search}[kind](
                path
            )
        return self.seen[key]

    def _file(self, path: str) -> str:
        try:
            st = os.stat(path)
        except OSError:
            return _MISSING
        stamp = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        try:
            if st.st_size < MEMO_MIN_SIZE and any(_under(path, r) for r in self.roots):
                return _sha256(path)
            known = self.memo.get(path)
            if isinstance(known, list) and known[:5] == stamp and isinstance(known[5], str):
                return known[5]
            digest = _sha256(path)
        except OSError:  # a folder, or not readable: the probes could not have read it either
            return f"unreadable {stamp}"
        if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > _SETTLED_NS:
            self.memo[path] = [*stamp, digest]
            self.dirty = True
        return digest

    def _dir(self, path: str) -> str:
        try:
            names = sorted(n for n in os.listdir(path) if n != "__pycache__")
        except OSError:
            return _MISSING
        return sha256_bytes("\n".join(names).encode("utf-8", "surrogateescape"))

    def _search(self, path: str) -> str:
        """A search-path entry: the names in it an imported top-level name could be, and
        its ``.pth`` files (each can add folders or run code at start-up)."""
        if os.path.isfile(path):  # a zip archive
            return self._file(path)
        try:
            names = sorted(os.listdir(path))
        except OSError:
            return _MISSING
        parts = []
        for name in names:
            if name.endswith(".pth"):
                parts.append(f"{name} {self._file(os.path.join(path, name))}")
            elif name.partition(".")[0] in self.top_level:
                parts.append(name)
        return sha256_bytes("\n".join(parts).encode("utf-8", "surrogateescape"))

    def save(self) -> None:
        if not self.dirty:
            return
        memo = {p: v for p, v in self.memo.items() if os.path.exists(p)}
        _write_json(self.memo_path, memo)


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_json(path: Path, data: Any) -> None:
    # Not fsync'd: an entry lost to a power cut reads back broken and is ignored.
    with atomic_output(path, durable=False) as f:
        f.write(json.dumps(data, sort_keys=True).encode("utf-8"))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def sources_digest(package_dir: Path) -> str:
    """The probes as the child gets them: every file copied, by relative path and content."""
    files = sorted(
        p
        for p in package_dir.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.name != "__init__.py"
    )
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.relative_to(package_dir)}\0{sha256_file(p)}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class ProbeCache:
    """The verdicts of one (probe sources, interpreter, probe names, environment)."""

    folder: Path
    memo_path: Path
    roots: tuple[str, ...]
    """The probed tree's folders, resolved as the child's search path has them."""
    names: tuple[str, ...]
    own_bytecode: str | None = None
    """The pycache prefix the child was given: bytecode there is compiled by the toolchain's
    probe runs from the files it keys, so it is left out; bytecode read from anywhere else
    (a prefix the environment's own start-up sets, a ``__pycache__``) is keyed by content."""

    @classmethod
    def open(
        cls,
        cache: Path,
        *,
        sources: str,
        python: Path,
        names: Sequence[str],
        env: Mapping[str, str],
        roots: Sequence[Path],
        scratch: Path,
    ) -> ProbeCache:
        """``env``: the child's environment, in which ``scratch`` (the run's own folder)
        and ``roots`` stand for themselves wherever they are."""
        resolved = tuple(str(Path(r).resolve()) for r in roots)
        cache_env = {k: _tokens(v, resolved, str(scratch)) for k, v in relevant_env(env).items()}
        key = {
            "schema": SCHEMA,
            "sources": sources,
            # Not resolved: a virtualenv's python is a link to the base interpreter.
            "python": str(Path(python).absolute()),
            "names": list(names),
            "env": cache_env,
            "roots": len(resolved),
        }
        digest = sha256_bytes(json.dumps(key, sort_keys=True).encode())
        return cls(
            cache / digest[:32],
            cache / "stat-memo.json",
            resolved,
            tuple(names),
            env.get("PYTHONPYCACHEPREFIX"),
        )

    def lookup(self) -> Hit | None:
        """The verdicts of an earlier run whose loaded files all read the same now."""
        lists = _newest_first(self.folder / "lists")[:_MAX_LISTS]
        hasher = _Hasher.load(self.memo_path, self.roots)
        try:
            for listed in lists:
                data = _read_json(listed)
                if not _valid_list(data):
                    continue  # broken: the next run that reports it writes it again
                hasher.top_level = frozenset(data["top_level"])
                entry = self.folder / "verdicts" / f"{self._digest(data, hasher)}.json"
                hit = _read_entry(entry)
                if hit is not None and set(hit.results) == set(self.names):
                    _touch(listed)
                    logger.debug("probe cache hit: %s", entry)
                    return hit
        finally:
            hasher.save()
        logger.debug("probe cache miss in %s", self.folder)
        return None

    def store(
        self,
        imports: Any,
        scratch: Path,
        started_ns: int,
        results: Mapping[str, ProbeResult],
        vllm_version: str | None,
    ) -> bool:
        """Keep a finished run's verdicts; False when they must not be kept."""
        if not results or any(r.status == ProbeStatus.UNKNOWN for r in results.values()):
            return False
        listed = self._list(imports, str(scratch))
        if listed is None:
            return False
        hasher = _Hasher.load(self.memo_path, self.roots)
        hasher.top_level = frozenset(listed["top_level"])
        try:
            if _changed_since(listed, self.roots, started_ns):
                return False
            digest = self._digest(listed, hasher)
        finally:
            hasher.save()
        name = sha256_bytes(json.dumps(listed, sort_keys=True).encode())
        _write_json(self.folder / "lists" / f"{name}.json", listed)
        _write_json(
            self.folder / "verdicts" / f"{digest}.json",
            {
                "schema": SCHEMA,
                "vllm_version": vllm_version,
                "results": [{**r.to_json(), "cached": False} for r in results.values()],
            },
        )
        self._prune()
        logger.debug("probe verdicts kept in the cache: %s", digest)
        return True

    def _list(self, imports: Any, scratch: str) -> dict[str, Any] | None:
        """What the child reported, as items of (kind, path or root token); None if unusable."""
        if not isinstance(imports, dict):
            return None
        try:
            bytecode = [
                p
                for p in imports["bytecode"]
                if self.own_bytecode is None or not _under(str(p), self.own_bytecode)
            ]
            kinds = {
                "file": [*imports["files"], *bytecode],
                "dir": imports["packages"],
                "path": imports["sys_path"],
            }
            top_level = sorted(str(n) for n in imports["top_level"])
            items = sorted(
                {
                    (kind, _token(str(p), self.roots))
                    for kind, paths in kinds.items()
                    for p in paths
                    if os.path.isabs(str(p)) and not _under(str(p), scratch)
                }
            )
        except (KeyError, TypeError):
            return None
        return {"schema": SCHEMA, "items": [list(i) for i in items], "top_level": top_level}

    def _digest(self, listed: dict[str, Any], hasher: _Hasher) -> str:
        h = hashlib.sha256()
        for kind, token in listed["items"]:
            h.update(f"{kind} {token} {hasher.digest(kind, _path(token, self.roots))}\n".encode())
        return h.hexdigest()

    def _prune(self) -> None:
        for old in _newest_first(self.folder / "lists")[_MAX_LISTS:]:
            old.unlink(missing_ok=True)


def _valid_list(data: Any) -> bool:
    return (
        isinstance(data, dict)
        and data.get("schema") == SCHEMA
        and isinstance(data.get("top_level"), list)
        and isinstance(data.get("items"), list)
        and all(
            isinstance(i, list)
            and len(i) == 2
            and i[0] in ("file", "dir", "path")
            and isinstance(i[1], str)
            for i in data["items"]
        )
    )


def _read_entry(entry: Path) -> Hit | None:
    data = _read_json(entry)
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        return None
    try:
        results = {
            r["probe"]: ProbeResult.from_json({**r, "cached": True}) for r in data["results"]
        }
    except (KeyError, TypeError, ValueError):
        return None
    if any(r.status == ProbeStatus.UNKNOWN for r in results.values()):
        return None
    return Hit(results, data.get("vllm_version"), entry)


def _changed_since(listed: dict[str, Any], roots: Sequence[str], started_ns: int) -> bool:
    """Whether a listed file or folder was written (or is gone) since the run started."""
    for _kind, token in listed["items"]:
        path = _path(token, roots)
        try:
            st = os.stat(path)
        except OSError:
            if _kind == "file":
                return True  # loaded by the run, gone now
            continue  # a search-path entry that does not exist, as it did not then
        if max(st.st_mtime_ns, st.st_ctime_ns) >= started_ns:
            return True
    return False


def _newest_first(folder: Path) -> list[Path]:
    def mtime(path: Path) -> int:
        try:
            return path.stat().st_mtime_ns
        except OSError:  # pruned by another process meanwhile
            return 0

    return sorted(folder.glob("*.json"), key=mtime, reverse=True)


def _touch(path: Path) -> None:
    with contextlib.suppress(OSError):  # pruned meanwhile: it only orders the next lookup
        os.utime(path)


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _token(path: str, roots: Sequence[str]) -> str:
    for i, root in enumerate(roots):
        if _under(path, root):
            return f"@{i}{path[len(root) :]}"
    return path


def _path(token: str, roots: Sequence[str]) -> str:
    if token.startswith("@"):
        index, _, rest = token[1:].partition("/")
        return roots[int(index)] + ("/" + rest if rest else "")
    return token


def _tokens(value: str, roots: Sequence[str], scratch: str) -> str:
    """An environment value with the run's folder and the probed roots as tokens."""
    parts = value.split(os.pathsep)
    named = {scratch: "<run>", **{r: f"@{i}" for i, r in enumerate(roots)}}
    return os.pathsep.join(named.get(p, p) for p in parts)
