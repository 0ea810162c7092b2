"""Inside the probed interpreter: import the heavy dependencies once, then fork a probe run
per request, so the runs of one release (the base tree, the patched tree, a 3-way check)
share one interpreter start.

Usage: python -m <pkg>.forkserver MODULE [MODULE ...]

Requests come on stdin, one JSON object a line: ``cwd`` (the run's folder, holding its
own copy of this package), ``env``, ``log`` and ``argv`` (``child``'s arguments). Each is
answered on stdout, in order, with ``{"rc": N}`` once its run has ended: the exit code, or
minus the signal that ended it. EOF on stdin ends the server.

A forked run must be the run a fresh interpreter would have made: its environment,
working folder, search path (``[cwd, *PYTHONPATH, *the interpreter's own]``), temp folder
and bytecode prefix are the request's, and this package's modules are dropped so the
run's copy is imported. Only modules the probed vLLM imports first thing anyway are
preloaded (torch before any of vLLM's own environment settings; libraries that read no
environment), and a server whose preloads started a thread refuses to fork (rc 70): a
fork copies only the calling thread. The toolchain starts it only for trees that do not
shadow a preloaded name.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import threading
import traceback
from importlib import import_module, invalidate_caches
from typing import Any

#: The exit code of a request the server refused to fork (EX_SOFTWARE).
REFUSED = 70


def _own_entries() -> set[str]:
    """This server's own search-path entries: its folder and its PYTHONPATH."""
    entries = {os.getcwd(), ""}
    entries.update(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
    return entries


def _as_run(request: dict[str, Any], interpreter_path: list[str]) -> int:
    """In the forked process: become the run ``request`` describes and run it."""
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(request["cwd"])
    env: dict[str, str] = request["env"]
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # read TMPDIR again
    sys.pycache_prefix = env.get("PYTHONPYCACHEPREFIX")
    package = __package__ or ""
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        del sys.modules[name]
    python_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["cwd"], *python_path, *interpreter_path]
    invalidate_caches()
    child = import_module(f"{package}.child")
    # What a fresh `python -m ...child` has: the run as __main__ (and as multiprocessing's
    # alias of it), not this server's module.
    sys.modules["__main__"] = child
    if "__mp_main__" in sys.modules:
        sys.modules["__mp_main__"] = child
    sys.argv = [str(child.__file__), *request["argv"]]
    code: int = child.main(request["argv"])
    return code


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def main(preload: list[str]) -> int:
    interpreter_path = [p for p in sys.path if p not in _own_entries()]
    for name in preload:
        # One that does not import is the run's to import, and to fail on if it must.
        with contextlib.suppress(Exception):
            import_module(name)
    replies = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        if _threads() > 1:
            replies.write(json.dumps({"rc": REFUSED, "why": "threads after preload"}) + "\n")
            replies.flush()
            continue
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _as_run(request, interpreter_path)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
