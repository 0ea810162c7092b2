"""The GPU's clock while an engine measured one unit of a speed run.

Two engines measured in turns can differ by a few percent in the very same kernels, a GEMM
the series does not touch among them (docs/notebook/2026-12-07-one-and-stock.md): the SM
clock moves with the GPU's power and temperature. So a step that is slower in one engine's
windows may be the clock, not its code. The driver keeps samples of the SM clock of its own;
read after a unit, those taken since its start give the clocks the unit ran at. Its
counters of the time the clock was held down by the power cap or by heat give how long the
unit was capped.

Read in the engine's process through vLLM's own NVML bindings (``vllm.third_party.pynvml``),
on the GPU the process was given (the first of ``CUDA_VISIBLE_DEVICES``). Where they cannot
be read (no NVIDIA driver, a CPU host, a driver that keeps no samples), nothing is recorded
and the unit is measured as before.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass
from functools import cache
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Mark:
    """The start of a unit: the wall clock the driver's samples are stamped with, and the
    driver's running totals of time capped by power and by heat."""

    wall_us: int
    power_ns: int
    thermal_ns: int


def summary(mhz: list[int], before: Mark, after: Mark) -> dict[str, float] | None:
    """A unit's clock: the SM clock samples taken during it, MHz, and the time it was capped
    by power and by heat, seconds; None without a sample."""
    if not mhz:
        return None
    return {
        "sm_mhz_mean": round(statistics.fmean(mhz), 1),
        "sm_mhz_min": float(min(mhz)),
        "sm_samples": float(len(mhz)),
        "power_capped_s": max(0, after.power_ns - before.power_ns) / 1e9,
        "thermal_capped_s": max(0, after.thermal_ns - before.thermal_ns) / 1e9,
    }


def clocked(result: dict[str, Any], unit: str | None = None) -> list[dict[str, Any]]:
    """An engine's figures' units that read the clock (all, or those named ``unit``)."""
    units = result.get("beside") or []
    return [u for u in units if "sm_mhz_mean" in u and unit in (None, u.get("unit"))]


@cache
def _nvml() -> tuple[Any, Any] | None:
    """vLLM's NVML bindings and this process's GPU, or None where they do not answer."""
    try:
        from vllm.third_party import pynvml

        pynvml.nvmlInit()
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
        index = int(first) if first.isdigit() else 0
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as exc:  # no driver, no vLLM, a device named by UUID: no clock
        logger.debug("no GPU clock: %s", exc)
        return None


def mark() -> Mark | None:
    """Now, or None where the GPU's clock cannot be read."""
    found = _nvml()
    if found is None:
        return None
    nvml, handle = found
    try:
        power = nvml.nvmlDeviceGetViolationStatus(handle, nvml.NVML_PERF_POLICY_POWER)
        thermal = nvml.nvmlDeviceGetViolationStatus(handle, nvml.NVML_PERF_POLICY_THERMAL)
    except Exception as exc:
        logger.debug("no capped time: %s", exc)
        return None
    return Mark(int(time.time() * 1e6), power.violationTime, thermal.violationTime)


def since(before: Mark | None) -> dict[str, float] | None:
    """The clock of the unit that began at ``before`` and ends now (``summary``)."""
    found = _nvml()
    after = mark()
    if found is None or before is None or after is None:
        return None
    nvml, handle = found
    try:
        _, samples = nvml.nvmlDeviceGetSamples(
            handle, nvml.NVML_PROCESSOR_CLK_SAMPLES, before.wall_us
        )
    except Exception as exc:  # NVML answers "not found" when it took no sample since
        logger.debug("no clock samples: %s", exc)
        return None
    return summary([int(s.sampleValue.uiVal) for s in samples], before, after)
