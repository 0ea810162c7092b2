"""fetch through a real (local) package index and its cache: only bytes that match their pin
enter the cache, a cache hit asks nothing, and a bad index, a cut download or a full disk
is a named error that leaves nothing half-written."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import resource
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner

from tooling.cli import main
from tooling.errors import (
    CacheMissError,
    CacheWriteError,
    IntegrityError,
    NetworkError,
    UnknownBaseError,
)
from tooling.fetching.bases import Artifact
from tooling.fetching.fetch import ensure_artifact

from .fetch_helpers import make_sdist, options
from .helpers import wait_until


class Index:
    """A real HTTP simple index on 127.0.0.1 that counts the requests it serves."""

    def __init__(
        self,
        files: dict[str, bytes],
        stated: dict[str, str] | None = None,
        cut: int = 0,
        hold: threading.Event | None = None,
    ):
        self.files = files
        self.cut = cut
        """Bytes of each file body left unsent (the Content-Length still promises them)."""
        self.hold = hold
        """Set: each file body is sent only once it is set (a download in progress till then)."""
        self.stated = (
            stated
            if stated is not None
            else {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}
        )
        self.requests: list[str] = []
        index = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                index.requests.append(self.path)
                if self.path == "/simple/vllm/":
                    body = json.dumps(
                        {
                            "files": [
                                {
                                    "filename": n,
                                    "url": f"../../files/{n}",
                                    "hashes": {"sha256": index.stated[n]}
                                    if index.stated.get(n)
                                    else {},
                                }
                                for n in index.files
                            ]
                        }
                    ).encode()
                    ctype = "application/vnd.pypi.simple.v1+json"
                elif self.path.startswith("/files/") and self.path[7:] in index.files:
                    body, ctype = index.files[self.path[7:]], "application/octet-stream"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if ctype[-6:] == "stream" and index.hold is not None:
                    self.wfile.flush()
                    index.hold.wait()
                with contextlib.suppress(OSError):  # a client killed meanwhile
                    self.wfile.write(
                        body[: len(body) - index.cut] if ctype[-6:] == "stream" else body
                    )

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/simple/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def sdist_bytes() -> bytes:
    return make_sdist("9.9.9")


@pytest.fixture
def index(sdist_bytes: bytes):
    idx = Index({"vllm-9.9.9.tar.gz": sdist_bytes})
    yield idx
    idx.close()


def pin(name: str, data: bytes) -> Artifact:
    return Artifact(filename=name, sha256=hashlib.sha256(data).hexdigest(), size=len(data))


def test_download_is_verified_and_second_call_is_a_cache_hit(tmp_path, index, sdist_bytes):
    opts = options(tmp_path, index.url)
    path = ensure_artifact(pin("vllm-9.9.9.tar.gz", sdist_bytes), opts)
    assert path.read_bytes() == sdist_bytes
    assert index.requests == ["/simple/vllm/", "/files/vllm-9.9.9.tar.gz"]
    index.requests.clear()
    assert ensure_artifact(pin("vllm-9.9.9.tar.gz", sdist_bytes), opts) == path
    assert index.requests == []


def test_index_stating_another_digest_is_refused(tmp_path, sdist_bytes):
    idx = Index({"vllm-9.9.9.tar.gz": sdist_bytes}, stated={"vllm-9.9.9.tar.gz": "0" * 64})
    try:
        with pytest.raises(IntegrityError, match="index states sha256 0000"):
            ensure_artifact(pin("vllm-9.9.9.tar.gz", sdist_bytes), options(tmp_path, idx.url))
    finally:
        idx.close()
    assert not (tmp_path / "cache" / "pypi" / "vllm-9.9.9.tar.gz").exists()


def test_downloaded_bytes_not_matching_the_pin_leave_nothing(tmp_path, sdist_bytes):
    tampered = sdist_bytes[:-1] + bytes([sdist_bytes[-1] ^ 1])
    idx = Index({"vllm-9.9.9.tar.gz": tampered}, stated={})
    try:
        with pytest.raises(IntegrityError) as err:
            ensure_artifact(pin("vllm-9.9.9.tar.gz", sdist_bytes), options(tmp_path, idx.url))
    finally:
        idx.close()
    assert hashlib.sha256(tampered).hexdigest() in str(err.value)
    assert err.value.exit_code == 6
    assert list((tmp_path / "cache" / "pypi").iterdir()) == []


def test_unverified_lookup_still_refuses_a_cached_file_of_another_size(tmp_path, sdist_bytes):
    """``verify=False`` leaves the digest to the caller (the build hashes the wheel while it
    copies), but a file whose size is not the pin's is named and removed at once."""
    artifact = pin("vllm-9.9.9.tar.gz", sdist_bytes)
    opts = options(tmp_path, "http://127.0.0.1:9/simple/", offline=True)
    cached = opts.cache.artifacts / artifact.filename
    cached.parent.mkdir(parents=True)
    cached.write_bytes(bytes(len(sdist_bytes)))  # the pinned size, other bytes
    assert ensure_artifact(artifact, opts, verify=False) == cached
    cached.write_bytes(sdist_bytes[:-1])  # a download cut short
    with pytest.raises(IntegrityError, match="does not match the pinned .* moved aside to"):
        ensure_artifact(artifact, opts, verify=False)
    assert not cached.exists()


def test_a_cached_file_a_wrong_pin_refuses_is_moved_aside_not_deleted(tmp_path, sdist_bytes):
    """One hex digit off in bases.toml: the cached file is the right one and stays whole,
    out of the cache's way, named in the error."""
    right = pin("vllm-9.9.9.tar.gz", sdist_bytes)
    digit = "0" if right.sha256[0] != "0" else "1"
    wrong = dataclasses.replace(right, sha256=digit + right.sha256[1:])
    opts = options(tmp_path, "http://127.0.0.1:9/simple/", offline=True)
    cached = opts.cache.artifacts / right.filename
    cached.parent.mkdir(parents=True)
    cached.write_bytes(sdist_bytes)
    aside = opts.cache.artifacts / "rejected" / f"{right.filename}.sha256-{right.sha256[:16]}"
    with pytest.raises(IntegrityError) as e:
        ensure_artifact(wrong, opts)
    assert str(e.value) == (
        f"{right.filename}: sha256 {right.sha256} does not match the pinned {wrong.sha256}; "
        f"the file was moved aside to {aside} (check the pin in bases.toml)"
    )
    assert not cached.exists() and aside.read_bytes() == sdist_bytes


def test_unreachable_index_is_a_network_error(tmp_path, sdist_bytes):
    with pytest.raises(NetworkError, match="cannot reach http://127.0.0.1:9/simple/vllm/"):
        ensure_artifact(
            pin("vllm-9.9.9.tar.gz", sdist_bytes), options(tmp_path, "http://127.0.0.1:9/simple/")
        )


def test_offline_names_the_missing_file(tmp_path, sdist_bytes):
    with pytest.raises(CacheMissError, match="vllm-9.9.9.tar.gz is not in the cache"):
        ensure_artifact(
            pin("vllm-9.9.9.tar.gz", sdist_bytes),
            options(tmp_path, "http://127.0.0.1:9/simple/", offline=True),
        )


def test_a_body_shorter_than_its_content_length_is_a_network_error(tmp_path, sdist_bytes):
    idx = Index({"vllm-9.9.9.tar.gz": sdist_bytes}, cut=100)
    try:
        with pytest.raises(NetworkError, match=f"ended after {len(sdist_bytes) - 100} of"):
            ensure_artifact(pin("vllm-9.9.9.tar.gz", sdist_bytes), options(tmp_path, idx.url))
    finally:
        idx.close()
    assert list((tmp_path / "cache" / "pypi").iterdir()) == []


def test_a_full_disk_during_a_download_names_the_cache_folder(tmp_path):
    """The file size limit stands in for a full disk (the kernel's EFBIG)."""
    data = make_sdist("9.9.9", padding=3_000_000)
    idx = Index({"vllm-9.9.9.tar.gz": data})
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, hard))
    try:
        with pytest.raises(CacheWriteError, match="cannot write to the cache") as err:
            ensure_artifact(pin("vllm-9.9.9.tar.gz", data), options(tmp_path, idx.url))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
        idx.close()
    assert str(tmp_path / "cache" / "pypi") in str(err.value)
    assert list((tmp_path / "cache" / "pypi").iterdir()) == []


def write_bases(folder: Path, sdist: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bases.toml").write_text(f"""
default = "9.9.9"
[bases."9.9.9"]
release_date = "2026-01-01"
[bases."9.9.9".sdist]
filename = "vllm-9.9.9.tar.gz"
sha256 = "{hashlib.sha256(sdist).hexdigest()}"
[bases."9.9.9".git]
tag = "v9.9.9"
commit = "abcdef1"
""")
    return folder


def test_cli_fetch_json_and_exit_codes(tmp_path, index, sdist_bytes):
    patches = write_bases(tmp_path / "patches", sdist_bytes)
    common = [
        "--cache-dir",
        str(tmp_path / "cache"),
        "--patches-dir",
        str(patches),
        "--index-url",
        index.url,
        "--no-progress",
    ]
    runner = CliRunner()
    ok = runner.invoke(main, [*common, "fetch", "--json"])
    assert ok.exit_code == 0, ok.output
    data = json.loads(ok.stdout)
    assert data["base"] == "9.9.9" and data["wheel"] is None
    assert Path(data["source_dir"], "vllm", "__init__.py").is_file()
    unknown = runner.invoke(main, [*common, "fetch", "--base", "1.2.3"])
    assert unknown.exit_code == UnknownBaseError.exit_code
    assert "unknown base vLLM '1.2.3'" in unknown.stderr
    assert len(unknown.stderr.strip().splitlines()) == 1


def test_a_download_killed_midway_leaves_a_part_the_next_fetch_removes(tmp_path, sdist_bytes):
    """SIGKILL runs no clean-up: the next fetch, holding the artifact's lock, knows the temp
    file is a dead holder's and removes it (not by its age)."""
    hold = threading.Event()
    idx = Index({"vllm-9.9.9.tar.gz": sdist_bytes}, hold=hold)
    patches = write_bases(tmp_path / "patches", sdist_bytes)
    pypi = tmp_path / "cache" / "pypi"
    common = ["--cache-dir", str(tmp_path / "cache"), "--patches-dir", str(patches)]
    common += ["--index-url", idx.url, "--no-progress", "fetch"]
    try:
        proc = subprocess.Popen([sys.executable, "-m", "tooling", *common])
        wait_until(lambda: list(pypi.glob(".vllm-9.9.9.tar.gz.*.part")), "a part file", alive=proc)
        proc.kill()
        proc.wait()
        hold.set()
        assert list(pypi.glob(".*.part"))  # what the kill left
        again = CliRunner().invoke(main, common)
    finally:
        hold.set()
        idx.close()
    assert again.exit_code == 0, again.output
    assert sorted(p.name for p in pypi.iterdir()) == ["vllm-9.9.9.tar.gz"]


class RawIndex:
    """An index that answers the project page with the given raw bytes and headers."""

    def __init__(
        self, body: bytes, *, length: int | None = None, chunked: bool = False, stall: float = 0
    ):
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/vnd.pypi.simple.v1+json")
                if chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                else:
                    self.send_header(
                        "Content-Length", str(length if length is not None else len(body))
                    )
                self.send_header("Connection", "close")
                self.end_headers()
                if stall:
                    time.sleep(stall)
                if chunked:
                    # One chunk announced larger than what is sent, then the connection ends.
                    self.wfile.write(b"%x\r\n" % (len(body) + 50) + body)
                else:
                    self.wfile.write(body)
                self.wfile.flush()
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/simple/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize(
    ("body", "kw", "message"),
    [
        (b"{not json", {}, "is not a simple index"),
        (b'{"meta": {}}', {}, "is not a simple index"),
        (b'{"files": []}', {"chunked": True}, "broke off"),
        (b'{"files": []}', {"length": 500}, "ended after 13 of 500 bytes"),
        (b'{"files": []}', {"stall": 3}, "timed out"),
    ],
    ids=["bad-json", "no-files", "cut-chunked", "cut-length", "stall"],
)
def test_a_broken_index_page_is_a_network_error(
    tmp_path, monkeypatch, sdist_bytes, body, kw, message
):
    monkeypatch.setattr("tooling.fetching.fetch._TIMEOUT_S", 1)
    idx = RawIndex(body, **kw)
    try:
        with pytest.raises(NetworkError, match=message):
            ensure_artifact(pin("vllm-9.9.9.tar.gz", sdist_bytes), options(tmp_path, idx.url))
    finally:
        idx.close()


def test_an_index_url_without_a_scheme_is_named(tmp_path, sdist_bytes):
    with pytest.raises(NetworkError, match="index URL 'pypi.org/simple/' has no http"):
        ensure_artifact(
            pin("vllm-9.9.9.tar.gz", sdist_bytes), options(tmp_path, "pypi.org/simple/")
        )
