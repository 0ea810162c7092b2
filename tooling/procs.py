"""Child processes that always end: each runs in its own process group, stopped as a group.

The one way the toolchain starts a child. ``vllm serve`` forks an engine-core
process, ``pip --python`` runs pip again under the target interpreter, and a
child can ignore SIGTERM, so stopping means: SIGTERM to the whole group, a
grace period, then SIGKILL to the group, then a wait until no member is left.
The same path runs on normal exit, on an error, on a time-out and on Ctrl-C
(KeyboardInterrupt); the CLI turns SIGTERM and SIGHUP into KeyboardInterrupt,
so they too run the clean-up, and nothing a run started outlives it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ToolingError

logger = logging.getLogger(__name__)

ALREADY_EXITED = "already exited"
TERMINATED = "terminated"
KILLED = "killed"


@dataclass(frozen=True)
class StopOutcome:
    """How a process group ended."""

    how: str
    """``already exited``, ``terminated`` (SIGTERM sufficed) or ``killed`` (SIGKILL needed)."""
    returncode: int | None
    seconds: float
    leftover: bool = False
    """True when some member of the group still existed after the final wait."""


@dataclass(frozen=True)
class ChildResult:
    """A child run to completion, or stopped at its time limit."""

    returncode: int | None
    seconds: float
    timed_out: bool
    log: Path


def shown(cmd: Sequence[str]) -> str:
    """``cmd`` as one shell line for the log: a script argument (``-c`` code) by its first
    line, a URL's password left out."""

    def short(arg: str) -> str:
        first = next((line.strip() for line in arg.splitlines() if line.strip()), "")
        return arg if arg == first and len(arg) <= 160 else f"{first[:80]} ..."

    return redacted(shlex.join(short(a) for a in cmd))


def redacted(text: str) -> str:
    """``text`` for the log with a URL's password (``scheme://user:pass@``) left out."""
    return re.sub(r"://[^/@\s]+@", "://***@", text)


def start_group(
    cmd: Sequence[str],
    *,
    log: Path,
    env: Mapping[str, str],
    cwd: Path | None = None,
    stdin: int = subprocess.DEVNULL,
    truncate_log: bool = False,
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` as the leader of a new session, stdout and stderr appended to ``log``
    (``truncate_log``: written over); ``stdin=subprocess.PIPE`` to talk to it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    logger.debug("start %s (output in %s)", shown(cmd), log)
    with open(log, "wb" if truncate_log else "ab") as out:
        # A new session: its own process group (stopped as one) and no
        # controlling terminal, so Ctrl-C reaches only us and we decide.
        return subprocess.Popen(
            list(cmd),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=stdin,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
        )


def start_server(
    cmd: Sequence[str], *, env: Mapping[str, str], cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` as the leader of a new session that is talked to over pipes: requests
    on its stdin, answers on its stdout, its stderr discarded. It lives until
    :func:`stop_group` stops it, with whatever it started."""
    logger.debug("start %s (over pipes)", shown(cmd))
    return subprocess.Popen(
        list(cmd),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=dict(env),
        cwd=cwd,
        start_new_session=True,
    )


def group_members(pgid: int) -> list[int] | None:
    """Live (non-zombie) pids in process group ``pgid``; None where /proc is unavailable.

    Zombies are left out: an orphan's zombie lingers until init reaps it, and
    some container inits never do, yet it holds no memory or GPU.
    """
    proc = Path("/proc")
    if not (proc / "self" / "stat").is_file():
        return None
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def _group_alive(pgid: int) -> bool:
    members = group_members(pgid)
    if members is not None:
        return bool(members)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _wait_group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def stop_group(
    proc: subprocess.Popen[Any], *, grace_s: float = 20.0, kill_wait_s: float = 10.0
) -> StopOutcome:
    """Stop ``proc`` and everything in its process group; return how it went.

    SIGTERM first (vLLM shuts its engine core down on it), SIGKILL after
    ``grace_s``. Members that outlive the leader (an orphaned engine core) are
    killed too. Safe to call on a process that has already exited.
    """
    start = time.monotonic()
    pgid = proc.pid  # the leader of a new session: its pid is the group id
    how = ALREADY_EXITED if proc.poll() is not None else TERMINATED
    try:
        if how == TERMINATED:
            _signal_group(pgid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                how = KILLED
                _signal_group(pgid, signal.SIGKILL)
                # A process stuck in the kernel may outlive even SIGKILL for a
                # while; report it as a leftover below rather than raise.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=kill_wait_s)
        if not _wait_group_gone(pgid, min(grace_s, 5.0)):
            _signal_group(pgid, signal.SIGKILL)
            how = KILLED if how != ALREADY_EXITED else how
    except BaseException:
        # Interrupted while waiting (a second Ctrl-C): do not leave the group behind.
        _signal_group(pgid, signal.SIGKILL)
        raise
    leftover = not _wait_group_gone(pgid, kill_wait_s)
    if how != ALREADY_EXITED or leftover:
        logger.debug("process group %d %s%s", pgid, how, ", members left" if leftover else "")
    return StopOutcome(
        how=how,
        returncode=proc.poll(),
        seconds=time.monotonic() - start,
        leftover=leftover,
    )


@contextlib.contextmanager
def started(
    cmd: Sequence[str], *, grace_s: float = 2.0, **popen: Any
) -> Iterator[subprocess.Popen[Any]]:
    """``subprocess.Popen(cmd, **popen)`` as the leader of a group of its own, the group
    stopped whole when the block ends, however it ends (done, failed, interrupted)."""
    logger.debug("start %s", shown(cmd))
    with subprocess.Popen(list(cmd), start_new_session=True, **popen) as proc:
        try:
            yield proc
        finally:
            stop_group(proc, grace_s=grace_s)


def run(
    cmd: Sequence[str],
    *,
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True, stdin=DEVNULL)`` through
    :func:`started`. OSError when it cannot start; subprocess.TimeoutExpired past
    ``timeout_s``, the group stopped."""
    with started(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=None if env is None else dict(env),
        cwd=cwd,
    ) as proc:
        out, err = proc.communicate(timeout=timeout_s)
    logger.debug("exit status %s of %s", proc.returncode, Path(cmd[0]).name)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def output(
    cmd: Sequence[str],
    *,
    what: str,
    error: type[ToolingError],
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> str:
    """What ``cmd`` prints on stdout. A failure is one ``error`` line starting with ``what``:
    it cannot start, it gives no answer within ``timeout_s`` (its group stopped), or it
    exits non-zero (then its last line on stderr)."""
    try:
        result = run(cmd, timeout_s=timeout_s, env=env, cwd=cwd)
    except OSError as e:
        raise error(f"{what}: {e.strerror or e}") from None
    except subprocess.TimeoutExpired:
        raise error(f"{what}: no answer within {timeout_s:g}s") from None
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise error(f"{what}: exit status {result.returncode}: {last}")
    return result.stdout


def run_child(
    cmd: Sequence[str],
    *,
    log: Path,
    env: Mapping[str, str],
    timeout_s: float,
    cwd: Path | None = None,
    grace_s: float = 10.0,
) -> ChildResult:
    """Run ``cmd`` to completion within ``timeout_s``; stop its group on time-out or interrupt."""
    start = time.monotonic()
    proc = start_group(cmd, log=log, env=env, cwd=cwd)
    try:
        returncode: int | None = proc.wait(timeout=max(timeout_s, 0.0))
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
        returncode = None
    finally:
        # Runs on time-out, on KeyboardInterrupt and after a normal exit alike:
        # a normal exit may still leave grandchildren in the group.
        outcome = stop_group(proc, grace_s=grace_s)
    if timed_out:
        returncode = outcome.returncode
        logger.debug("no end within %gs: %s", timeout_s, shown(cmd))
    else:
        logger.debug("exit status %s of %s", returncode, Path(cmd[0]).name)
    return ChildResult(
        returncode=returncode, seconds=time.monotonic() - start, timed_out=timed_out, log=log
    )


def log_tail(log: Path, lines: int = 1, max_chars: int = 300) -> str:
    """The last non-empty lines of ``log``, for one-line error messages."""
    try:
        text = log.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    tail = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
    return " | ".join(tail)[-max_chars:]


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt so ``finally`` clean-up runs.

    Only the main thread can install signal handlers; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"received signal {signum}")

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
