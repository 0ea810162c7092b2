"""Package indexes the tests run here, on this machine's loopback: one that serves real
wheels built in the test (PEP 691 JSON with upload times, as uv and pip read PyPI), and one
that takes every connection and closes it at once, counting them (``--offline`` must make
none, through a proxy or to the index)."""

from __future__ import annotations

import hashlib
import http.server
import json
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .helpers import HANG_GUARD_S


@dataclass
class Refusing:
    """A port that takes connections and closes them at once: nothing answers, and each
    attempt is counted."""

    port: int
    connections: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/simple/"

    def environ(self) -> dict[str, str]:
        """The index and every proxy setting pointed here: any request, to any host, by any
        client that honours them (pip, uv, urllib, huggingface_hub) lands here."""
        proxy = f"http://127.0.0.1:{self.port}"
        names = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
        return {
            "TOOLING_INDEX_URL": self.url,
            "PIP_INDEX_URL": self.url,
            "UV_INDEX_URL": self.url,
            "NO_PROXY": "",
            "no_proxy": "",
            **{n: proxy for n in names},
            **{n.lower(): proxy for n in names},
        }


@contextmanager
def refusing_index() -> Iterator[Refusing]:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.01)
    refusing = Refusing(server.getsockname()[1])
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            refusing.connections += 1
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield refusing
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()


@dataclass
class Index:
    """A simple index over ``folder``'s wheels; a download by pip of a wheel whose project is
    in ``stall`` sends its first bytes, then nothing (uv's reads of it answer whole)."""

    folder: Path
    port: int = 0
    stall: set[str] = field(default_factory=set)
    requests: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/simple/"

    def page(self, project: str) -> bytes | None:
        files = [
            {
                "filename": w.name,
                "url": f"/files/{w.name}",
                "hashes": {"sha256": hashlib.sha256(w.read_bytes()).hexdigest()},
                "upload-time": "2026-01-01T00:00:00Z",
            }
            for w in sorted(self.folder.glob("*.whl"))
            if w.name.split("-")[0].lower().replace("_", "-") == project
        ]
        if not files:
            return None
        meta = {"meta": {"api-version": "1.1"}, "name": project, "files": files}
        return json.dumps(meta).encode()


def _handler(index: Index) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *_: object) -> None:
            index.requests.append(f"{self.command} {self.path}")

        def _send(self, body: bytes, kind: str, *, head: bool = False) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _answer(self, head: bool) -> None:
            parts = self.path.strip("/").split("/")
            if parts[0] == "simple" and len(parts) == 2:
                page = index.page(parts[1])
                if page is not None:
                    return self._send(page, "application/vnd.pypi.simple.v1+json", head=head)
            wheel = index.folder / parts[-1]
            if parts[0] == "files" and wheel.is_file():
                data = wheel.read_bytes()
                by_pip = self.headers.get("User-Agent", "").startswith("pip")
                if by_pip and not head and parts[-1].split("-")[0] in index.stall:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data[:1000])
                    self.wfile.flush()
                    time.sleep(HANG_GUARD_S)
                    return None
                return self._send(data, "application/octet-stream", head=head)
            self.send_response(404)
            self.end_headers()
            return None

        def do_GET(self) -> None:
            self._answer(head=False)

        def do_HEAD(self) -> None:
            self._answer(head=True)

    return Handler


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


@contextmanager
def serving(index: Index) -> Iterator[Index]:
    server = _Server(("127.0.0.1", 0), _handler(index))
    index.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield index
    finally:
        server.shutdown()
        server.server_close()
