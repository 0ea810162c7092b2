"""What fetch reads besides downloads: sdists it unpacks, bases.toml and index pages, and
the real pinned 0.20.1 artifacts, so that a bad archive or file never enters the cache and
the real ones sit there byte for byte as pinned."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
import tomllib
from pathlib import Path

import pytest

from tooling.errors import ArchiveError, IntegrityError
from tooling.fetching.bases import load_bases
from tooling.fetching.fetch import ensure_artifact, extract_sdist, parse_simple_index

from .fetch_helpers import make_sdist, options
from .helpers import PATCHES


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@pytest.mark.slow
def test_corrupted_cached_copy_of_the_real_sdist_is_removed(tmp_path, catalog, fetch_release):
    real = fetch_release(catalog.get("0.20.1"), with_wheel=False).sdist
    opts = options(tmp_path, "http://127.0.0.1:9/simple/", offline=True)
    copy = opts.cache.artifacts / real.name
    copy.parent.mkdir(parents=True)
    shutil.copyfile(real, copy)
    with open(copy, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    artifact = catalog.get("0.20.1").sdist
    corrupted = file_sha256(copy)
    with pytest.raises(IntegrityError) as err:
        ensure_artifact(artifact, opts)
    assert f"sha256 {corrupted} does not match the pinned {artifact.sha256}" in str(err.value)
    assert not copy.exists()
    # Only this test's cache lost its copy: the real cached sdist still matches its pin.
    assert file_sha256(real) == artifact.sha256


@pytest.mark.slow
def test_real_pinned_artifacts_fetch_and_unpack(upstream_0201, cache):
    """Both artifacts sit in the cache under their names, as patches/bases.toml pins them
    (read here as plain TOML), and the sdist is unpacked under its digest, byte for byte."""
    pins = tomllib.loads((PATCHES / "bases.toml").read_text(encoding="utf-8"))["bases"]["0.20.1"]
    for kind, path in (("sdist", upstream_0201.sdist), ("wheel", upstream_0201.wheel)):
        pinned = pins[kind]
        assert path == cache.artifacts / pinned["filename"], kind
        assert path.stat().st_size == pinned["size"], kind
        assert file_sha256(path) == pinned["sha256"], kind
    tree = upstream_0201.source_dir
    assert tree == cache.sources / f"sdist-{pins['sdist']['sha256'][:16]}" / "vllm-0.20.1"
    member = "vllm-0.20.1/vllm/v1/worker/gpu_model_runner.py"
    with tarfile.open(upstream_0201.sdist) as tar:
        packed = tar.extractfile(member).read()
    assert (tree.parent / member).read_bytes() == packed


def test_truncated_sdist_is_an_archive_error(tmp_path):
    real = make_sdist("9.9.9", padding=200_000)
    (tmp_path / "t.tar.gz").write_bytes(real[: len(real) // 2])
    with pytest.raises(ArchiveError, match="truncated or corrupt"):
        extract_sdist(tmp_path / "t.tar.gz", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["t.tar.gz"]


def test_sdist_escaping_its_folder_is_refused(tmp_path):
    (tmp_path / "evil.tar.gz").write_bytes(make_sdist("9.9.9", escape=True))
    with pytest.raises(ArchiveError, match="'../../escaped.txt' would land outside") as err:
        extract_sdist(tmp_path / "evil.tar.gz", tmp_path / "a" / "b" / "out")
    assert not list(tmp_path.rglob("escaped.txt"))
    assert "corrupt" not in str(err.value)


def test_a_bad_sdist_layout_never_enters_the_cache(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("vllm-9.9.9/not_vllm/__init__.py")
        tar.addfile(info, io.BytesIO(b""))
    (tmp_path / "odd.tar.gz").write_bytes(buf.getvalue())
    for _ in range(2):  # the second call must not find a half-accepted tree
        with pytest.raises(
            ArchiveError, match=r"expected one top folder holding vllm/, found \['vllm-9.9.9'\]"
        ):
            extract_sdist(tmp_path / "odd.tar.gz", tmp_path / "out")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["odd.tar.gz"]


def test_bases_file_problems_are_config_errors(tmp_path):
    (tmp_path / "bases.toml").write_text('[bases."1.0"]\nrelease_date = "x"\n')
    with pytest.raises(Exception, match="missing key"):
        load_bases(tmp_path / "bases.toml")
    (tmp_path / "bases.toml").write_text("not = [toml")
    with pytest.raises(Exception, match="not valid TOML"):
        load_bases(tmp_path / "bases.toml")


def test_simple_index_parsing_json_and_html():
    page = "https://example.org/simple/vllm/"
    as_json = parse_simple_index(
        json.dumps(
            {
                "files": [
                    {"filename": "a.whl", "url": "../../p/a.whl", "hashes": {"sha256": "ab" * 32}}
                ]
            }
        ).encode(),
        "application/vnd.pypi.simple.v1+json",
        page,
    )
    assert as_json == {"a.whl": ("https://example.org/p/a.whl", "ab" * 32)}
    html = b'<html><body><a href="../../p/b.tar.gz#sha256=' + b"cd" * 32 + b'">b.tar.gz</a></body>'
    assert parse_simple_index(html, "text/html", page) == {
        "b.tar.gz": ("https://example.org/p/b.tar.gz", "cd" * 32)
    }
