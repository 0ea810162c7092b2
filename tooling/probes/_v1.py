"""What the probes that drive vLLM's V1 model runner on the CPU share: where a tree lacks
that runner, and where the steps they drive do not run as written."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

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


#: Tensor methods that read a tensor back to the host, waiting for the GPU where it is there.
WAITS = ("cpu", "numpy", "tolist", "item")


@contextmanager
def count_reads(device: Any, host: Any = None) -> Iterator[list[str]]:
    """The names of the ``WAITS`` called on ``device`` (a buffer, or a view into it) while
    the block runs, and with ``host`` each ``copy_`` from ``device`` into ``host``."""
    import torch
    from torch.overrides import TorchFunctionMode

    reads: list[str] = []

    def _of(tensor: Any, buffer: Any) -> bool:
        start = buffer.data_ptr()
        end = start + buffer.numel() * buffer.element_size()
        return isinstance(tensor, torch.Tensor) and start <= tensor.data_ptr() < end

    class _Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = getattr(func, "__name__", "")
            if name in WAITS and args and _of(args[0], device):
                reads.append(name)
            copied = name == "copy_" and host is not None and len(args) > 1
            if copied and _of(args[0], host) and _of(args[1], device):
                reads.append("copy_ to the host")
            return func(*args, **(kwargs or {}))

    with _Reads():
        yield reads


@contextmanager
def state_copies_recorded(prefix: str, record: Callable[..., None]) -> Iterator[None]:
    """The V1 runner's Mamba state copies (``mamba_utils``' functions named from ``prefix``,
    whatever a release calls them) replaced by ``record`` while the block runs."""
    from vllm.v1.worker import gpu_model_runner

    utils = gpu_model_runner.mamba_utils
    real = {name: getattr(utils, name) for name in dir(utils) if name.startswith(prefix)}
    for name in real:
        setattr(utils, name, record)
    try:
        yield
    finally:
        for name, function in real.items():
            setattr(utils, name, function)


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
