"""One probe interpreter start for the probe runs of one release.

A probe run spends most of its time importing vLLM's dependencies (torch, transformers,
openai), which are the same for the base tree, the patched tree and a 3-way check of one
release. A ``ProbeHost`` starts the probed interpreter once, on the first run that needs
one (a run the probe cache answers needs none), as a fork server
(``probes/forkserver.py``) that imports those and forks each run from there.

A forked run is the run a fresh interpreter would make: the same environment,
search path, working folder and bytecode prefix (so its verdicts and the
imports the probe cache keys them by are the same). The host serves only runs
of its interpreter and bytecode prefix, whose environment is the one it started
with in every variable that can change what the probed code does (the probe
cache's test, ``cache.relevant_env``; the per-run search path and temp
folder aside; a forked run gets its whole environment) and whose trees do not
hold a preloaded package; any other run starts an interpreter of its own, as
does every run after the server failed or was stopped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from ..probes.forkserver import REFUSED
from ..procs import start_server, stop_group
from .cache import relevant_env
from .launch import ProbeTarget, child_env, launch_child, new_run_folder, remove_run_folder
from .package import copy_probe_package, probe_command

logger = logging.getLogger(__name__)

#: Imported once by the server: what every probe run imports anyway, and no vLLM.
PRELOAD = ("torch", "transformers", "openai", "aiohttp", "networkx", "numpy", "pydantic")
#: Read by the interpreter as it starts (the user's site folder), so the server's value is
#: the run's search path; not among the probe cache's variables, which see the path itself.
_AT_START = ("HOME",)


class ProbeHost:
    """A fork server for the probe runs of one interpreter; ``with`` stops it."""

    def __init__(self, python: Path, pycache: Path | None) -> None:
        self.python = python
        self.pycache = pycache
        self.starts = 0
        """Interpreters this host started (0 or 1)."""
        self.forks = 0
        """Runs it forked."""
        self._server: subprocess.Popen[bytes] | None = None
        self._folder: Path | None = None
        self._server_env: dict[str, str] = {}
        self._buffer = b""
        self._stopped = False

    @property
    def pid(self) -> int | None:
        """The server's process id, which is its process group's, while it runs."""
        return self._server.pid if self._server else None

    def __enter__(self) -> ProbeHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def serves(self, target: ProbeTarget) -> bool:
        """Whether a run on ``target`` can be forked here (before any environment check)."""
        if self._stopped or target.python != self.python or target.pycache != self.pycache:
            return False
        names = {n.partition(".")[0] for n in PRELOAD}
        return not any(
            (Path(root) / n).exists() or (Path(root) / f"{n}.py").exists()
            for root in target.roots
            for n in names
        )

    def start(
        self, target: ProbeTarget, env: dict[str, str], workdir: Path, argv: list[str], log: Path
    ) -> ForkedRun | None:
        """Fork the run ``probe_command`` would start, or None where this host cannot."""
        if not self.serves(target):
            return None
        if self._server is None:
            try:
                self._start_server()
            except OSError:  # the run's own start says why, in its own words
                self.close()
                return None
        if not self._same_environment(env, workdir):
            return None
        request = {"cwd": str(workdir), "env": env, "log": str(log), "argv": argv}
        try:
            assert self._server is not None and self._server.stdin is not None
            self._server.stdin.write((json.dumps(request) + "\n").encode())
            self._server.stdin.flush()
        except OSError:  # the server is gone: a fresh interpreter does this run
            self.close()
            return None
        self.forks += 1
        logger.debug("probe run forked from the host %s in %s", self.pid, workdir)
        return ForkedRun(self, target, env, workdir, argv, log)

    def _start_server(self) -> None:
        folder = new_run_folder("dflash-probe-host-", self.pycache)
        self._folder = folder
        copy_probe_package(folder)
        self._server_env = child_env(ProbeTarget(python=self.python, pycache=self.pycache), folder)
        # Its stderr is the preloads' warnings only: each run writes to its own log. Its own
        # process group: stopping it stops the run it forked too.
        self._server = start_server(
            probe_command(self.python, "forkserver", list(PRELOAD)),
            env=self._server_env,
            cwd=folder,
        )
        self.starts += 1

    def _same_environment(self, env: dict[str, str], workdir: Path) -> bool:
        def fixed(e: dict[str, str]) -> dict[str, str]:
            # What the preloads may have read at import (the run's other variables, its temp
            # folder among them, are its own in the forked process); the search path is
            # compared below, but for the run's own folders.
            kept = relevant_env(e) | {k: e[k] for k in _AT_START if k in e}
            return {k: v for k, v in kept.items() if k != "PYTHONPATH"}

        def after(e: dict[str, str], folder: Path) -> list[str]:
            """PYTHONPATH after the probes' own folder: what the caller's environment had."""
            parts = e.get("PYTHONPATH", "").split(os.pathsep)
            return parts[parts.index(str(folder)) + 1 :] if str(folder) in parts else parts

        assert self._folder is not None
        return fixed(env) == fixed(self._server_env) and after(env, workdir) == after(
            self._server_env, self._folder
        )

    def reply(self, timeout_s: float | None) -> dict[str, Any] | None:
        """The next reply; None when the server ended. TimeoutExpired when none came in time."""
        assert self._server is not None and self._server.stdout is not None
        fd = self._server.stdout.fileno()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                raise subprocess.TimeoutExpired("probe fork server", timeout_s or 0)
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def close(self) -> None:
        """Stop the server (and a run it is serving) and remove its folder; safe to call
        again. Runs afterwards start interpreters of their own."""
        self._stopped = True
        server, self._server = self._server, None
        if server is not None:
            # The whole group, always: a run it forked dies with it, even one left behind
            # by a server that was killed from outside.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()
            for stream in (server.stdin, server.stdout):
                # A request still buffered for a dead server cannot be flushed: dropped.
                with contextlib.suppress(OSError):
                    if stream is not None:
                        stream.close()
        folder, self._folder = self._folder, None
        if folder is not None:
            remove_run_folder(folder, self.pycache)


class ForkedRun:
    """A run the host forked, with the part of ``subprocess.Popen`` a ``ProbeRun`` uses.

    When the server refuses to fork (its preloads started a thread), the run starts an
    interpreter of its own and stands for that one.
    """

    def __init__(
        self,
        host: ProbeHost,
        target: ProbeTarget,
        env: dict[str, str],
        workdir: Path,
        argv: list[str],
        log: Path,
    ) -> None:
        self._host = host
        self._fresh = (target, env, workdir, argv, log)
        self._own: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._own is None:
            try:
                self._take(self._host.reply(0))
            except subprocess.TimeoutExpired:
                return None
        if self._own is not None:
            self.returncode = self._own.poll()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and self._own is None:
            self._take(self._host.reply(timeout))
        if self._own is not None:
            self.returncode = self._own.wait(timeout)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self._own is not None:
            stop_group(self._own, grace_s=0)
            return
        self._host.close()
        self.returncode = -signal.SIGKILL

    def _take(self, reply: dict[str, Any] | None) -> None:
        # The server ended (killed from outside, a preload that crashed it) or would not
        # fork: the run gets the fresh interpreter it would have had without a host.
        if reply is None or (reply["rc"] == REFUSED and "why" in reply):
            self._host.close()
            self._own = launch_child(*self._fresh)
        else:
            self.returncode = int(reply["rc"])
