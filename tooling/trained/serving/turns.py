"""Turns on one GPU for the engines of a speed run: each measures alone, and, interleaved, the
engines take a unit of work each in a fixed order (A B C A B C ...), so a drift of the
machine over the run (clocks, another tenant, a warming host) lands on every engine alike
rather than on the ratio between two engines measured minutes apart.

The engines are separate processes. They share a folder:

- ``lock``: held (``flock``) for the whole of a unit, so no two units share the GPU;
- ``next``: the index of the engine whose turn it is;
- ``done-INDEX``: left by an engine that has no unit left (or failed), so the others skip it
  and none waits on an engine that will never take its turn.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

#: How often a waiting engine looks at whose turn it is.
POLL_S = 0.02


@dataclass(frozen=True)
class Turns:
    """Engine ``index`` of ``count`` taking turns in ``folder``."""

    folder: Path
    index: int
    count: int
    timeout_s: float = 1800.0
    """The longest an engine waits for its turn: an engine killed before it could leave its
    ``done`` file must not hold the others for ever."""

    def __post_init__(self) -> None:
        # The engine's request carries the folder as JSON text.
        object.__setattr__(self, "folder", Path(self.folder))
        if not 0 <= self.index < self.count:
            raise ValueError(f"turns: engine {self.index} is not one of {self.count}")

    def _done(self, index: int) -> bool:
        return (self.folder / f"done-{index}").is_file()

    def _whose(self) -> int | None:
        """Whose turn it is, skipping engines that are done; None when all are."""
        path = self.folder / "next"
        start = int(path.read_text()) if path.is_file() else 0
        for step in range(self.count):
            candidate = (start + step) % self.count
            if not self._done(candidate):
                return candidate
        return None

    def _advance(self) -> None:
        nxt = self.folder / "next"
        temp = self.folder / f"next.{self.index}.tmp"
        temp.write_text(f"{(self.index + 1) % self.count}\n")
        temp.replace(nxt)

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Wait for this engine's turn, then hold the GPU for one unit of work."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if self._done(self.index):
            raise RuntimeError(f"turns: engine {self.index} took a turn after it was done")
        began = time.monotonic()
        with open(self.folder / "lock", "a+") as lock:
            while True:
                fcntl.flock(lock, fcntl.LOCK_EX)
                whose = self._whose()
                if whose == self.index:
                    break
                fcntl.flock(lock, fcntl.LOCK_UN)
                if time.monotonic() - began > self.timeout_s:
                    raise TimeoutError(
                        f"turns: engine {self.index} waited {self.timeout_s:.0f}s for engine "
                        f"{whose}, which neither took its turn nor finished"
                    )
                time.sleep(POLL_S)
            try:
                yield
            finally:
                self._advance()
                fcntl.flock(lock, fcntl.LOCK_UN)

    def finish(self) -> None:
        """No unit left for this engine (or it failed): the others no longer wait for it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"done-{self.index}").write_text("done\n")


@contextlib.contextmanager
def whole_run(lock_path: Path) -> Iterator[None]:
    """Not interleaved: the engine holds the run's lock for all its units at once."""
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
