"""What the fetch test modules share: a small sdist made in memory and fetch options over a
cache of the test's own."""

from __future__ import annotations

import io
import random
import tarfile
from pathlib import Path

from tooling.fetching.fetch import FetchOptions
from tooling.paths import CacheLayout


def make_sdist(version: str, *, escape: bool = False, padding: int = 0) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        files = {f"vllm-{version}/vllm/__init__.py": b"__version__ = '%s'\n" % version.encode()}
        if padding:
            files[f"vllm-{version}/vllm/data.bin"] = random.Random(0).randbytes(padding)
        if escape:
            files["../../escaped.txt"] = b"outside"
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def options(tmp_path: Path, index_url: str, offline: bool = False) -> FetchOptions:
    return FetchOptions(
        cache=CacheLayout(tmp_path / "cache"), index_url=index_url, offline=offline, progress=False
    )
