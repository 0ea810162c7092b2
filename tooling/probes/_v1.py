"""What the probes that drive vLLM's V1 model runner on the CPU share: where a tree lacks
that runner, and where the steps they drive do not run as written."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from . import _harness
from .result import UNKNOWN, ProbeResult

T = TypeVar("T")

#: What the steps a probe drives raise where the tree's runner or scheduler differs from the
#: one the probe is written for (a renamed method or field, a step refused).
NOT_AS_WRITTEN = (ValueError, TypeError, AttributeError, KeyError)


class CannotStep(Exception):
    """The tree's runner or scheduler does not run a step as the probe drives it."""


class NotServedByV1(Exception):
    """The V1 runner does not serve the config (from 0.29.0 the config may choose V2's)."""


class RecordedEvent:
    """Stands in for the CUDA event the runner records after a copy to the host: counts its
    records; a CPU runner's copies are done when made, so a wait returns at once."""

    def __init__(self) -> None:
        self.recorded = 0

    def record(self) -> None:
        self.recorded += 1

    def synchronize(self) -> None:
        pass


def without_v1_runner(probe: str, why: str) -> ProbeResult | None:
    """Unknown, with ``why``, where the probed tree has no V1 model runner (0.34.0 has the V2
    one alone); None where it has one. The CPU platform is installed first either way."""
    _harness.install_cpu_platform()
    if _harness.has_v1_runner():
        return None
    return ProbeResult(probe=probe, status=UNKNOWN, evidence=f"no V1 model runner: {why}")


def not_as_written(probe: str, error: Exception) -> ProbeResult:
    """Unknown: the steps did not run as written, with ``error``'s first words."""
    return ProbeResult(
        probe=probe,
        status=UNKNOWN,
        evidence="the steps did not run as written: " + " ".join(str(error).split())[:300],
    )


def v1_steps(probe: str, why: str, steps: Callable[[], T]) -> T | ProbeResult:
    """What ``steps`` found on a tree with the V1 runner; else unknown: with ``why`` where the
    tree has no such runner, or with the error where the steps did not run as written."""
    if (unknown := without_v1_runner(probe, why)) is not None:
        return unknown
    try:
        return steps()
    except (CannotStep, NotServedByV1, *NOT_AS_WRITTEN) as e:
        return not_as_written(probe, e)


def draw_fault(seed: int, error: Exception) -> str:
    """A drawn schedule's fault, as a slow test reports it: its seed, its kind and its first
    words."""
    return f"seed {seed}: {type(error).__name__}: " + " ".join(str(error).split())[:300]
