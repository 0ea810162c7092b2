"""Fetch pinned upstream artifacts from the package index into the per-user cache.

A file enters the cache only through a temp file that is renamed once its
sha256 matches the pin, and it is hashed again on every later use: the cache
is trusted no more than the network.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import json
import logging
import os
import re
import tarfile
import urllib.error
import urllib.parse
import urllib.request
import urllib.response
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from ..errors import ArchiveError, CacheMissError, CacheWriteError, IntegrityError, NetworkError
from ..fsutil import CHUNK, atomic_output, locked, sha256_file, staging_dir
from ..paths import CacheLayout
from ..procs import redacted
from ..progress import progress_bar
from . import unpacked
from .bases import Artifact, Base

logger = logging.getLogger(__name__)

#: The one default for every index client: fetch joins project pages onto it,
#: bundle hands it to uv and pip as --index-url (both take it with or without the slash).
DEFAULT_INDEX_URL = "https://pypi.org/simple/"
PROJECT = "vllm"
_TIMEOUT_S = 60
#: What urlopen returns for an http(s):// URL and for a file:// one.
_Response = http.client.HTTPResponse | urllib.response.addinfourl


@dataclass(frozen=True)
class FetchOptions:
    cache: CacheLayout
    index_url: str = DEFAULT_INDEX_URL
    offline: bool = False
    progress: bool = True


@dataclass(frozen=True)
class PypiSource:
    """What ``fetch`` hands to the next stage for a PyPI base."""

    base: Base
    sdist: Path
    wheel: Path | None
    source_dir: Path
    """The unpacked sdist: the folder that holds ``vllm/``."""


def verify_artifact(path: Path, artifact: Artifact) -> None:
    """Raise IntegrityError when ``path`` is not the pinned file, after moving it out of the
    cache's way (``rejected/`` beside it): the pin may be what is wrong (a mistyped digest in
    bases.toml), and then the file is the right one, and hundreds of MB to fetch again."""
    actual = sha256_file(path)
    if actual != artifact.sha256:
        aside = path.parent / "rejected" / f"{path.name}.sha256-{actual[:16]}"
        try:
            aside.parent.mkdir(exist_ok=True)
            os.replace(path, aside)
            where = f"the file was moved aside to {aside}"
        except OSError as e:
            where = f"it stays in the cache: cannot move it to {aside} ({e.strerror or e})"
        raise IntegrityError(
            f"{path.name}: sha256 {actual} does not match the pinned {artifact.sha256}; "
            f"{where} (check the pin in bases.toml)"
        )


class _Anchors(HTMLParser):
    """Collects ``<a href>`` targets of a PEP 503 HTML simple page."""

    def __init__(self) -> None:
        super().__init__()
        self.links: dict[str, str] = {}
        self._href: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self.links[data.strip()] = self._href
            self._href = None


def parse_simple_index(
    body: bytes, content_type: str, page_url: str
) -> dict[str, tuple[str, str | None]]:
    """Map file name -> (absolute URL, sha256 the index states or None).

    Accepts PEP 691 JSON and PEP 503 HTML; relative links resolve against ``page_url``.
    """
    files: dict[str, tuple[str, str | None]] = {}
    if "json" in content_type:
        for entry in json.loads(body)["files"]:
            url = urllib.parse.urljoin(page_url, entry["url"])
            files[entry["filename"]] = (url, entry.get("hashes", {}).get("sha256"))
        return files
    parser = _Anchors()
    parser.feed(body.decode("utf-8", "replace"))
    for name, href in parser.links.items():
        url, _, fragment = urllib.parse.urljoin(page_url, href).partition("#")
        match = re.match(r"sha256=([0-9a-f]{64})", fragment)
        files[name] = (url, match.group(1) if match else None)
    return files


def _open(url: str, accept: str | None = None) -> _Response:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    try:
        return urllib.request.urlopen(request, timeout=_TIMEOUT_S)
    except urllib.error.HTTPError as e:
        raise NetworkError(f"{url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise NetworkError(f"cannot reach {url}: {reason}") from None


def resolve_url(artifact: Artifact, index_url: str) -> str:
    """Find ``artifact`` on the index and check the index agrees with our pin."""
    if urllib.parse.urlsplit(index_url).scheme not in ("http", "https", "file"):
        raise NetworkError(f"index URL {index_url!r} has no http(s):// or file:// scheme")
    page = urllib.parse.urljoin(index_url.rstrip("/") + "/", f"{PROJECT}/")
    accept = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"
    with _open(page, accept) as response:
        body = b"".join(_blocks(response, page))
        content_type = response.headers.get("Content-Type", "")
    try:
        files = parse_simple_index(body, content_type, page)
    except (ValueError, KeyError, TypeError) as e:
        raise NetworkError(f"{page} is not a simple index ({type(e).__name__}: {e})") from None
    if artifact.filename not in files:
        raise NetworkError(f"{page} does not list {artifact.filename}")
    url, stated = files[artifact.filename]
    if stated and stated != artifact.sha256:
        raise IntegrityError(
            f"{artifact.filename}: the index states sha256 {stated}, "
            f"but bases.toml pins {artifact.sha256}"
        )
    return url


def download(url: str, target: Path, artifact: Artifact, show_progress: bool) -> None:
    """Stream ``url`` to ``target``, hashing as it goes; rename only if the hash matches."""
    digest = hashlib.sha256()
    logger.debug("download %s to %s", redacted(url), target)
    try:
        with _open(url) as response, atomic_output(target) as out:
            total = artifact.size or int(response.headers.get("Content-Length") or 0) or None
            with progress_bar(total, f"fetch {artifact.filename}", show_progress) as bar:
                for block in _blocks(response, url):
                    digest.update(block)
                    out.write(block)
                    bar.update(len(block))
            actual = digest.hexdigest()
            if actual != artifact.sha256:
                raise IntegrityError(
                    f"{artifact.filename}: downloaded sha256 {actual} does not match "
                    f"the pinned {artifact.sha256}; nothing was kept"
                )
    except OSError as e:
        # Reads are wrapped by _blocks, so an OSError here is the cache's own.
        raise CacheWriteError(
            f"cannot write to the cache {target.parent}: {e.strerror or e}"
        ) from None


def _blocks(response: _Response, url: str) -> Iterator[bytes]:
    """The body in blocks; a connection that breaks off (or a body shorter than its
    Content-Length, which http.client lets through) is the network's fault."""
    promised = int(response.headers.get("Content-Length") or 0) or None
    received = 0
    while True:
        try:
            block = response.read(CHUNK)
        except TimeoutError:
            raise NetworkError(f"{url}: timed out after {_TIMEOUT_S} s without data") from None
        except (OSError, http.client.HTTPException) as e:
            raise NetworkError(f"{url}: download broke off ({e!r})") from None
        if not block:
            if promised is not None and received < promised:
                raise NetworkError(f"{url}: the body ended after {received} of {promised} bytes")
            return
        received += len(block)
        yield block


def ensure_artifact(artifact: Artifact, options: FetchOptions, *, verify: bool = True) -> Path:
    """The cached, verified path of ``artifact``; downloads it on a cache miss.

    ``verify=False`` hands the digest check of a cached file of the pinned size to
    the caller, which must call ``verify_artifact`` before trusting what it made
    from it (the build does, on another core, while it copies).
    """
    path = options.cache.artifacts / artifact.filename
    # Locked: one download at a time (a second process waits and finds the file), and the
    # temp file of one killed mid-download is removed by the next.
    with locked(path):
        if path.exists():
            # A cached file of another size than the pin (a download cut short) cannot match:
            # it is named and moved aside now, before a work tree is made for a build it
            # would fail.
            if verify or (artifact.size is not None and path.stat().st_size != artifact.size):
                verify_artifact(path, artifact)
            logger.debug("cached: %s", path)
            return path
        if options.offline:
            raise CacheMissError(
                f"--offline: {artifact.filename} is not in the cache {options.cache.artifacts}"
            )
        download(resolve_url(artifact, options.index_url), path, artifact, options.progress)
    return path


def extract_sdist(sdist: Path, dest: Path) -> Path:
    """Unpack ``sdist`` into ``dest`` (atomically) and return the folder holding ``vllm/``.

    tarfile's ``data`` filter refuses absolute paths, ``..`` and links that
    leave the target, so a hostile archive cannot write outside ``dest``. The
    layout is checked before the tree enters the cache, and the cache entry
    is locked, so a second process waits for the first one's tree instead of
    unpacking its own over it.
    """
    with locked(dest):
        if dest.is_dir():
            if unpacked.unchanged(dest):
                logger.debug("unpacked already: %s", dest)
                return _tree_root(dest, sdist)
            unpacked.reject(dest)
        logger.debug("unpack %s into %s", sdist.name, dest)
        try:
            with staging_dir(dest) as tmp:
                with tarfile.open(sdist, "r:*") as tar:
                    tar.extractall(tmp, filter="data")
                name = _tree_root(tmp, sdist).name
        except tarfile.FilterError as e:
            raise ArchiveError(
                f"{sdist.name}: refused, member {e.tarinfo.name!r} would land outside {dest} ({e})"
            ) from None
        except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise ArchiveError(f"{sdist.name}: truncated or corrupt archive ({e})") from None
        except OSError as e:
            raise ArchiveError(f"{sdist.name}: cannot unpack into {dest.parent} ({e})") from None
        unpacked.record(dest)
        return dest / name


def _tree_root(dest: Path, sdist: Path) -> Path:
    tops = [p for p in dest.iterdir() if p.is_dir()]
    if len(tops) != 1 or not (tops[0] / "vllm").is_dir():
        names = sorted(p.name for p in tops)
        raise ArchiveError(f"{sdist.name}: expected one top folder holding vllm/, found {names}")
    return tops[0]


def fetch_pypi(
    base: Base, options: FetchOptions, *, with_wheel: bool = True, verify_wheel: bool = True
) -> PypiSource:
    """Fetch the pinned sdist (and wheel, when pinned) and unpack the sdist."""
    sdist = ensure_artifact(base.sdist, options)
    wheel = (
        ensure_artifact(base.wheel, options, verify=verify_wheel)
        if with_wheel and base.wheel
        else None
    )
    source_dir = extract_sdist(sdist, options.cache.sources / f"sdist-{base.sdist.sha256[:16]}")
    return PypiSource(base=base, sdist=sdist, wheel=wheel, source_dir=source_dir)
