"""Where the GPU host keeps things (``$WORK`` and the folders under it), the environment its
children run in, how a child runs, and the checks every step makes of what it was given."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from .. import procs
from ..entry import answer
from ..errors import HostStepError, HostUsageError
from ..paths import REPO_DIR

logger = logging.getLogger(__name__)

#: ``$WORK`` unset: the host's scratch folder.
DEFAULT_WORK = Path("/tmp/dflash")
#: ``$SOURCE_DATE_EPOCH`` unset: the date every wheel built on the host carries, so its
#: bytes are the build machine's (docs/notebook/2026-12-01-reproducibility.md).
SOURCE_DATE_EPOCH = "1795910400"
#: The host's interpreter, found on PATH: the builds, smokes and the recipe run in it with
#: a site of their own on PYTHONPATH, from this checkout (the folder they start in).
PYTHON = "python3"
#: Offline, and NVLink multicast off for every child (the host's GPUs are shared; a program
#: using it can take them out of service): NCCL, PyTorch and NVSHMEM, Ray's workers too.
FIXED_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "PYTHONUNBUFFERED": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


class Modules:
    """The toolchain's modules the host runs with ``python3 -m``: named here alone, so a
    module that moves is renamed in one place."""

    TOOLING = "tooling"
    TRAINER = "tooling.trainer"
    TINY = "tooling.smoke.serving.tiny"
    PROOF = "tooling.trained.hybrid_proof"
    PROOF_ENGINE = "tooling.smoke.serving.distribution"
    TRAINED_PLAN = "tooling.trained.hybrid"
    #: The plan's engine sites (its ``SITES``), which the ablations follow.
    TRAINED_SITES = "tooling.trained.hybrid_plan"
    TRAINED_CALL = "tooling.trained.measure"
    SPEED = "tooling.trained.speed"


@dataclass(frozen=True)
class Layout:
    """The host's folders, all under ``work``."""

    work: Path

    @property
    def site(self) -> Path:
        """vLLM's dependencies: the bundle, installed with pip --target."""
        return self.work / "site"

    @property
    def engines(self) -> Path:
        """One vLLM install per engine variant: stock, patched, no-<patch id>."""
        return self.work / "engines"

    @property
    def cache(self) -> Path:
        return self.work / "cache"

    @property
    def payload(self) -> Path:
        """What the parts join into: bundle/, the sdist and train-wheels/."""
        return self.work / "joined" / "payload"

    @property
    def session(self) -> Path:
        return self.work / "session"

    @property
    def pair(self) -> Path:
        """The trained hybrid pair (the recipe's, or one carried in)."""
        return self.work / "hybrid-pair"

    @property
    def runs(self) -> Path:
        """The trained pair's calls' results."""
        return self.work / "trained"

    def engine(self, name: str) -> Path:
        return self.engines / name

    def env(self, pythonpath: str | None = None, **more: str) -> dict[str, str]:
        """The environment of a child: this process's, the host's locations and
        ``FIXED_ENV``, ``pythonpath`` on PYTHONPATH, and ``more``."""
        env = {
            "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH,
            **os.environ,
            **FIXED_ENV,
            "WORK": str(self.work),
            "SITE": str(self.site),
            "ENGINES": str(self.engines),
            "VLLM_DFLASH_CACHE": str(self.cache),
            **more,
        }
        if pythonpath is not None:
            env["PYTHONPATH"] = pythonpath
        return env


#: What a background step needs of this checkout (``tooling`` and what it reads: the series,
#: the GPU scripts and their lists, the benchmarks, the probes' requirements, the kept GPU
#: cases).
CHECKOUT_PARTS = ("tooling", "patches", "ci", "bench", "requirements", "tests/data")


def checkout_copy(work: Path) -> Path:
    """A copy of this checkout's ``CHECKOUT_PARTS`` in a new folder under ``work``, for a step
    that runs in the background. The driver's tool copies the checkout in again with each of
    its calls, and a step reading it meanwhile found files missing (2026-12-05: the session's
    build lost ``patches/0001-...``); each copy is a folder of its own, so a later start never
    writes over what a running step reads."""
    root = work / "checkouts"
    root.mkdir(parents=True, exist_ok=True)
    target = Path(tempfile.mkdtemp(dir=root, prefix=time.strftime("%Y%m%d-%H%M%S-")))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in CHECKOUT_PARTS:
        if (REPO_DIR / part).is_dir():
            shutil.copytree(REPO_DIR / part, target / part, ignore=ignore, symlinks=True)
    return target


def detached(
    layout: Layout, cmd: Sequence[str], *, log: Path, env: Mapping[str, str]
) -> subprocess.Popen[bytes]:
    """``cmd`` started in a session of its own (through ``tooling.procs``) in a copy of this
    checkout (``checkout_copy``): ``python3 -m`` imports the toolchain from there."""
    return procs.start_group(
        cmd, log=log, env=env, cwd=checkout_copy(layout.work), truncate_log=True
    )


def say(line: str) -> None:
    """A line of the step's own output, in order with its children's (they share stdout)."""
    answer(line)


def run(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path = REPO_DIR,
    stdout: IO[bytes] | int | None = None,
    stderr: IO[bytes] | int | None = None,
    limit_s: float | None = None,
    kill_after_s: float = 20.0,
) -> int:
    """``cmd`` to its end, its group stopped after it (through ``tooling.procs``); its exit
    status, 124 past ``limit_s`` (SIGTERM, then SIGKILL after ``kill_after_s``), as
    ``timeout`` said it. Output where ``stdout`` and ``stderr`` say, else this process's."""
    try:
        with procs.started(cmd, env=dict(env), cwd=cwd, stdout=stdout, stderr=stderr) as proc:
            try:
                return proc.wait(timeout=limit_s)
            except subprocess.TimeoutExpired:
                procs.stop_group(proc, grace_s=kill_after_s)
                return 124
    except OSError as e:
        raise HostStepError(f"{cmd[0]}: cannot start ({e.strerror or e})") from None


@dataclass(frozen=True)
class Child:
    """A child of ``run_together``: its output into ``out`` (and ``err``, else ``out`` too)."""

    cmd: tuple[str, ...]
    env: Mapping[str, str]
    out: Path
    err: Path | None = None
    limit_s: float | None = None
    kill_after_s: float = 20.0


def run_together(children: Sequence[Child]) -> list[int]:
    """Every child started at once, each waited for within its own limit (124 past it, as
    ``run``); their exit statuses in order. An interrupt stops every group."""
    started = time.monotonic()
    codes = []
    with contextlib.ExitStack() as stack:
        procs_ = []
        for child in children:
            out = stack.enter_context(written(child.out))
            err = out if child.err is None else stack.enter_context(written(child.err))
            try:
                proc = stack.enter_context(
                    procs.started(
                        child.cmd, env=dict(child.env), cwd=REPO_DIR, stdout=out, stderr=err
                    )
                )
            except OSError as e:
                raise HostStepError(f"{child.cmd[0]}: cannot start ({e.strerror or e})") from None
            procs_.append(proc)
        for child, proc in zip(children, procs_, strict=True):
            left = None if child.limit_s is None else child.limit_s - (time.monotonic() - started)
            try:
                codes.append(proc.wait(timeout=None if left is None else max(left, 0.0)))
            except subprocess.TimeoutExpired:
                procs.stop_group(proc, grace_s=child.kill_after_s)
                codes.append(124)
    return codes


def running(pattern: str) -> bool:
    """Whether a process whose command line matches ``pattern`` runs (``pgrep -f``)."""
    return procs.run(["pgrep", "-f", pattern], timeout_s=60).returncode == 0


def left_running(pattern: str) -> str:
    """The processes matching ``pattern`` (``pgrep -af``): what a smoke must not leave."""
    return procs.run(["pgrep", "-af", pattern], timeout_s=60).stdout.rstrip("\n")


def since(start: float) -> int:
    """Whole seconds since ``start`` (``time.monotonic``), as the host's log has said them."""
    return int(time.monotonic() - start)


@contextlib.contextmanager
def written(path: Path) -> Iterator[IO[bytes]]:
    """``path`` opened for a child's output, written over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as out:
        yield out


def shown(cmd: Sequence[str], *, env: Mapping[str, str], cwd: Path = REPO_DIR) -> str:
    """What ``cmd`` prints on stdout (``ls``, ``du``, ``sha256sum``: their own format, as the
    host's log has always shown it); its errors on stderr."""
    try:
        done = procs.run(cmd, env=env, cwd=cwd, timeout_s=600)
    except OSError as e:
        raise HostStepError(f"{cmd[0]}: cannot start ({e.strerror or e})") from None
    if done.stderr:
        logger.warning("%s", done.stderr.rstrip())
    return done.stdout.rstrip("\n")


def tail(path: Path, lines: int, *, skip: str | None = None) -> list[str]:
    """The last ``lines`` lines of ``path`` (none when it cannot be read), those starting with
    ``skip`` left out first."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    kept = [line for line in text.splitlines() if skip is None or not line.startswith(skip)]
    return kept[-lines:] if lines else []


# The checks below: every number is plain digits before anything reads it (the scripts'
# shell once evaluated expressions in a value), every setting present before a step acts.

_WHOLE = re.compile(r"^(0|[1-9][0-9]{0,8})$")


def whole_number(name: str, value: str) -> int:
    """``value`` as a whole number of at most 9 digits (no sign, no expression, no leading
    zero); ``name`` says which setting it is."""
    if not _WHOLE.match(value):
        raise HostUsageError(f"{name} must be a whole number (at most 9 digits), not '{value}'")
    return int(value)


def optional_number(name: str, value: str | None, default: int | None = None) -> int | None:
    return default if value is None else whole_number(name, value)


def required(name: str, value: str | None, what: str) -> str:
    """``value`` of the setting ``name``, which must be set and not empty."""
    if not value:
        raise HostUsageError(f"{name} is not set: {what}")
    return value


def absolute(value: str) -> Path:
    """A path made absolute against the folder the step was started in (a relative path is
    the caller's), not resolved."""
    return Path(os.path.abspath(value))


def sites(value: str) -> str:
    """A colon-joined site, each folder made absolute."""
    return ":".join(str(absolute(folder)) for folder in value.split(":"))


def part_size(value: str) -> int:
    size = whole_number("PART_SIZE_BYTES", value)
    if size < 1 << 20:
        raise HostUsageError(f"PART_SIZE_BYTES {size} is under 1 MiB (1048576)")
    return size
