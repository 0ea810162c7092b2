"""What else the host did while an engine measured one unit of a speed run.

A speed run's engines take the GPU in turns, and a step of theirs is mostly host time (the
runner's Python and its launches). So anything else on the host during a unit, a kernel
check, a compile, another tenant, is measured with it. Around each unit the engine reads
the host's busy CPU time and its own (``time.process_time``, every thread of this process);
what the host did beyond the engine is the work beside the unit. The host's time is its
control group's (cgroup v2 ``cpu.stat``: in a container, the container's, not every
tenant's of the machine beneath), else ``/proc/stat``'s (every CPU, every process, and the
time a hypervisor took from them). The other engines of the run wait for their turn in a
poll and do almost nothing meanwhile.

What this does not see: work that keeps the GPU busy with its host idle. Any process that
imports torch, compiles or runs Python shows on the CPU.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: A unit with more than this much CPU time of other work a second of its wall time was not
#: measured alone: half a core, far above what the waiting engines and the host's own daemons
#: use, and well below a process that compiles or imports torch (a core or more).
LIMIT = 0.5

#: The fields of /proc/stat's "cpu" line that count as busy: user, nice, system, irq,
#: softirq and steal (guest time is already within user and nice).
_BUSY = (0, 1, 2, 5, 6, 7)


@dataclass(frozen=True)
class Sample:
    wall_s: float
    host_cpu_s: float
    own_cpu_s: float


def _host_cpu_s(stat: Path) -> float:
    fields = stat.read_text().splitlines()[0].split()
    if fields[0] != "cpu":
        raise ValueError(f"{stat}: the first line is not the CPUs' total")
    ticks = [int(v) for v in fields[1:]]
    return sum(ticks[i] for i in _BUSY if i < len(ticks)) / os.sysconf("SC_CLK_TCK")


def _group_cpu_s(cpu_stat: Path) -> float:
    for line in cpu_stat.read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "usage_usec":
            return int(value) / 1e6
    raise ValueError(f"{cpu_stat}: no usage_usec")


#: Where the host's busy CPU time is read, the first that answers.
SOURCES = (
    (Path("/sys/fs/cgroup/cpu.stat"), _group_cpu_s),
    (Path("/proc/stat"), _host_cpu_s),
)


def sample(sources: tuple[tuple[Path, Any], ...] = SOURCES) -> Sample | None:
    """Now, or None where the host has none of ``sources`` to read."""
    for path, read in sources:
        try:
            host = read(path)
        except (OSError, ValueError, IndexError) as exc:
            logger.debug("no host CPU time from %s: %s", path, exc)
            continue
        return Sample(time.monotonic(), host, time.process_time())
    return None


def beside(before: Sample | None, after: Sample | None) -> dict[str, float] | None:
    """The unit's wall time, the engine's CPU time and the host's other CPU time, seconds."""
    if before is None or after is None:
        return None
    wall = after.wall_s - before.wall_s
    own = after.own_cpu_s - before.own_cpu_s
    other = max(0.0, (after.host_cpu_s - before.host_cpu_s) - own)
    return {"wall_s": wall, "own_cpu_s": own, "other_cpu_s": other}


def share(unit: dict[str, Any]) -> float:
    """The other work's CPU seconds a second of the unit's wall time."""
    wall = unit.get("wall_s") or 0.0
    return unit.get("other_cpu_s", 0.0) / wall if wall > 0 else 0.0


def crowded(result: dict[str, Any], limit: float = LIMIT) -> list[str]:
    """One engine's units that had more than ``limit`` of other work beside them, named."""
    return [
        f"{result.get('name', 'engine')}: {u['unit']} had {share(u):.2f} CPU-s a second of "
        f"other work beside it ({u['other_cpu_s']:.1f} s over {u['wall_s']:.1f} s)"
        for u in result.get("beside", [])
        if share(u) > limit
    ]
