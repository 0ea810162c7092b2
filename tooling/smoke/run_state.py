"""One smoke run's state: its settings, plan, deadline, step records and progress
(``SmokeRun``), the child processes it starts and reads (``Child``, ``JsonChild``), and what
its waves observed so far (``Observed``)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import SmokeError
from ..procs import log_tail, start_group, stop_group
from . import observe
from .config import (
    DrafterInfo,
    SmokeConfig,
)
from .observe import ServerObservations
from .plan import (
    Deadline,
    SmokePlan,
    Step,
)
from .report import StepRecord
from .server import child_environment

logger = logging.getLogger(__name__)

Notify = Callable[[str], None]


class SmokeRun:
    """Shared state of one smoke run: config, plan, deadline, step records, progress."""

    def __init__(self, config: SmokeConfig, notify: Notify) -> None:
        self.config = config
        self.notify = notify
        self.deadline = Deadline(config.timeouts.total)
        self.began = time.monotonic()
        self.steps: list[StepRecord] = []
        self.python = config.python or sys.executable
        self.workdir = config.workdir.resolve()
        self.cache = self.workdir / "vllm-cache"
        self.logs = self.workdir / "logs"
        self.plan: SmokePlan | None = None
        self.first_start_s: float | None = None
        """The first engine's measured start: later limits are multiples of it."""

    # observe.Budget
    def limit(self, what: str) -> float:
        assert self.plan is not None
        d, m = self.plan.deadlines, self.first_start_s
        seconds = {
            observe.START: d.start_s(m),
            observe.REQUEST: d.request.seconds(m),
            observe.LOAD: d.load.seconds(m),
        }[what]
        return self.deadline.limit(seconds, reserve_s=d.server_stop_s)

    def started(self, seconds: float, message: str) -> None:
        if self.first_start_s is None:
            self.first_start_s = seconds
        self.notify(message)

    def environment(
        self, cache: Path | None = None, site: str | None = None, gpus: tuple[int, ...] = ()
    ) -> dict[str, str]:
        """The children's environment: offline, this run's compile cache, ``site`` first,
        and only ``gpus`` (indices into the GPUs this run sees) visible."""
        env = child_environment()
        env["VLLM_CACHE_ROOT"] = str(cache or self.cache)
        if site:
            env["PYTHONPATH"] = os.pathsep.join([site, env["PYTHONPATH"]])
        if gpus:
            seen = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(seen[i] if seen else str(i) for i in gpus)
        return env

    def step_environment(self, step: Step) -> dict[str, str]:
        """A plan step's environment: check 7's runs share a cache of their own, and the
        first (A) imports the other build."""
        if step.run.startswith("warm-"):
            site = self.config.other_site if step.run == "warm-A" else None
            return self.environment(self.workdir / "vllm-cache-warm", site, step.gpus)
        return self.environment(gpus=step.gpus)

    @contextmanager
    def step(self, name: str, log: Path | None = None) -> Iterator[StepRecord]:
        """Time a step and record how it ended; SmokeError is recorded, not raised."""
        record = StepRecord(name=name, seconds=0.0, ok=True, log=str(log) if log else None)
        self.notify(f"{name} ...")
        start = time.monotonic()
        record.started_s = start - self.began
        try:
            yield record
        except SmokeError as e:
            record.ok = False
            record.message = str(e)
            self.notify(f"{name}: {e}")
        finally:
            record.seconds = time.monotonic() - start
            self.steps.append(record)
            # The progress line names the start; the end shows with -v.
            logger.debug("%s: %s in %.1fs", name, "ok" if record.ok else "failed", record.seconds)

    def start_child(
        self, module: str, args: list[str], *, log: Path, timeout_s: float, env: dict[str, str]
    ) -> Child:
        """``python -m module args``, started now; ``wait`` bounds it to ``timeout_s``."""
        env = dict(env)
        # In-process engine: the model runner must live in this interpreter.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        limit = self.deadline.limit(timeout_s)
        logger.debug("child %s, within %.0fs", module, limit)
        proc = start_group([self.python, "-m", module, *args], log=log, env=env)
        return Child(module, proc, log, limit, time.monotonic())

    def child(
        self,
        module: str,
        args: list[str],
        *,
        log: Path,
        timeout_s: float,
        env: dict[str, str] | None = None,
    ) -> None:
        """Run ``python -m module args`` within its limit; SmokeError unless it exits 0."""
        child = self.start_child(
            module, args, log=log, timeout_s=timeout_s, env=env or self.environment()
        )
        try:
            child.wait()
        finally:
            child.stop()


@dataclass
class Child:
    """A started child process, stopped with its whole group."""

    module: str
    proc: subprocess.Popen[bytes]
    log: Path
    limit: float
    started: float

    def wait(self) -> None:
        """SmokeError naming the module and its log unless it exits 0 within its limit."""
        left = max(self.limit - (time.monotonic() - self.started), 0.0)
        try:
            returncode: int | None = self.proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            returncode = None
        raise_unless_done(self.module, returncode, self.limit, self.log)

    def stop(self) -> None:
        stop_group(self.proc, grace_s=10.0)


def raise_unless_done(module: str, returncode: int | None, limit: float, log: Path) -> None:
    """SmokeError naming ``module`` and its log unless it exited 0 (None: ran out of time)."""
    if returncode is None:
        raise SmokeError(f"{module} did not finish within {limit:.0f}s (log: {log})")
    if returncode != 0:
        raise SmokeError(f"{module} exited {returncode}: {log_tail(log)} (log: {log})")


def read_result(path: Path, log: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise SmokeError(f"{path.name} was not written: {log_tail(log)} (log: {log})") from None
    if not data.get("ok", True):
        raise SmokeError(f"{data.get('error')} (log: {log})")
    return data


@dataclass
class JsonChild:
    """A child of the JSON protocol (``serving.child``): request in, result out."""

    run: SmokeRun
    step: Step
    request: dict[str, Any]
    timeout_s: float
    child: Child | None = None

    @property
    def paths(self) -> tuple[Path, Path]:
        return Path(self.step.argv[3]), Path(self.step.argv[4])

    @property
    def log(self) -> Path:
        return self.run.logs / f"{Path(self.step.argv[4]).stem}-run.log"

    def start(self) -> JsonChild:
        in_path, out_path = self.paths
        in_path.write_text(json.dumps(self.request, indent=1), encoding="utf-8")
        out_path.unlink(missing_ok=True)
        self.child = self.run.start_child(
            self.step.argv[2],
            [str(in_path), str(out_path)],
            log=self.log,
            timeout_s=self.timeout_s,
            env=self.run.step_environment(self.step),
        )
        return self

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()

    def result(self) -> dict[str, Any]:
        """Its result (SmokeError when it failed); records its engine's start."""
        assert self.child is not None
        _, out_path = self.paths
        try:
            self.child.wait()
        except SmokeError:
            # The child's own error (in its result file) says more than its exit code.
            if out_path.is_file():
                read_result(out_path, self.log)
            raise
        finally:
            self.child.stop()
        result = read_result(out_path, self.log)
        logger.debug("%s: result in %s", self.step.name, out_path)
        if isinstance(result.get("startup_s"), (int, float)):
            self.run.started(result["startup_s"], f"{self.step.name}: engine started")
        return result


@dataclass
class Observed:
    """What the waves observed so far."""

    info: DrafterInfo | None = None
    info_error: str = ""
    spec: ServerObservations | None = None
    plain: ServerObservations | None = None
    engine: dict[str, tuple[dict[str, Any] | None, str]] = field(default_factory=dict)
    """Run name (``engine``, ``warm-A``, ``warm-B``) -> (in-process result, why missing)."""
    fidelity: dict[str, tuple[dict[str, Any] | None, str]] = field(default_factory=dict)
    first_tokens: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Variant name -> its result (``{"ok": false, "error": ...}`` where it failed)."""
