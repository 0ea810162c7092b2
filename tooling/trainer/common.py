"""Small helpers shared by the trainer's stages: schedule, clock, log, files."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

logger = logging.getLogger(__name__)


def lr_factor(progress: float, warmup_frac: float, min_ratio: float) -> float:
    """Learning-rate multiplier at ``progress`` in [0, 1]: linear warm-up, then cosine decay."""
    progress = min(max(progress, 0.0), 1.0)
    if warmup_frac > 0 and progress < warmup_frac:
        return max(progress / warmup_frac, 1e-3)
    span = max(1.0 - warmup_frac, 1e-9)
    cosine = 0.5 * (1.0 + math.cos(math.pi * (progress - warmup_frac) / span))
    return min_ratio + (1.0 - min_ratio) * cosine


@dataclass
class Budget:
    """A phase's limits: at most ``max_steps`` steps and ``time_s`` seconds, but never fewer
    than ``min_steps`` steps.

    Progress is whichever limit is nearer, so the learning-rate schedule still
    anneals when the clock, not the step count, ends a phase. A phase whose clock runs out
    before ``min_steps`` (a slower or shared GPU) anneals over those steps instead: what a
    phase learns follows its steps, not its seconds.
    """

    max_steps: int
    time_s: float
    min_steps: int = 0
    started: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        """Seconds since the phase started."""
        return time.perf_counter() - self.started

    def progress(self, step: int) -> float:
        """Fraction of the phase done before ``step`` (0-based)."""
        by_steps = step / max(self.max_steps, 1)
        by_time = self.elapsed() / self.time_s if self.time_s > 0 else 0.0
        floor = min(self.min_steps, self.max_steps)
        if step < floor:
            by_time = min(by_time, step / floor)
        return max(by_steps, by_time)

    def done(self, step: int) -> bool:
        """Whether the phase must stop before running ``step``."""
        return step >= self.max_steps or self.progress(step) >= 1.0

    def time_capped(self, steps_run: int) -> bool:
        """Whether the clock ended the phase before its step count."""
        return steps_run < self.max_steps


class Log:
    """The recipe's lines, each stamped with the seconds since the run began: INFO under the
    logger of the stage that says it (the trainer's entry puts them on its stderr, which
    ``train_in`` streams to the user as the child's log) and, once opened, in the run's
    ``train.log``, which outlives the process."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.file: TextIO | None = None

    def open(self, path: Path) -> None:
        """Also write every later line to ``path``."""
        logger.debug("the recipe's lines also in %s", path)
        self.file = path.open("a", encoding="utf-8")

    def close(self) -> None:
        """Close the log file, if any."""
        if self.file is not None:
            self.file.close()
            self.file = None

    def __call__(self, under: logging.Logger, message: str) -> None:
        line = f"[{time.perf_counter() - self.t0:7.1f}s] {message}"
        under.info("%s", line)
        if self.file is not None:
            self.file.write(line + "\n")
            self.file.flush()


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (temporary file in the same folder, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    logger.debug("wrote %s", path)


def sha256_file(path: Path) -> str:
    """sha256 of a file's bytes."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class StopRequest:
    """The signal that asked this process to stop, if one did.

    The handler raises KeyboardInterrupt as well, but Python drops an exception raised
    while a finalizer (``__del__``, a weakref callback) runs: the run went on and published
    its pair after a SIGTERM. The recipe reads this before it publishes.
    """

    signum: int | None = None

    @classmethod
    def check(cls) -> None:
        """Raise KeyboardInterrupt(signum) once a stop was asked for."""
        if cls.signum is not None:
            raise KeyboardInterrupt(cls.signum)


@dataclass(frozen=True)
class RunPaths:
    """The files of one run folder."""

    root: Path

    @property
    def target(self) -> Path:
        return self.root / "target"

    @property
    def drafter(self) -> Path:
        return self.root / "drafter"

    @property
    def prompts(self) -> Path:
        return self.root / "prompts.json"

    @property
    def reference(self) -> Path:
        return self.root / "reference.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def recipe(self) -> Path:
        return self.root / "recipe.json"

    @property
    def log(self) -> Path:
        return self.root / "train.log"

    def complete(self) -> bool:
        """Whether the folder holds a finished run (the summary is written last)."""
        return self.summary.is_file() and self.target.is_dir() and self.drafter.is_dir()
