"""Running the behavioural probes from the toolchain: the launcher, the fork server that
serves a release's runs (``host``), the cache of verdicts (``cache``) and the CPU
interpreter they run in (``env``).

The probes themselves are ``tooling.probes``, the code that runs inside the probed
interpreter; nothing there imports this package.
"""

from __future__ import annotations

from ..probes.result import ABSENT, PRESENT, UNKNOWN, ProbeResult
from .host import ProbeHost
from .launch import ProbeTarget, scratch_folder
from .package import probe_modules
from .run import ProbeRun, probe_requested, run_probes, start_probes

__all__ = [
    "ABSENT",
    "PRESENT",
    "UNKNOWN",
    "ProbeHost",
    "ProbeResult",
    "ProbeRun",
    "ProbeTarget",
    "probe_modules",
    "probe_requested",
    "run_probes",
    "scratch_folder",
    "start_probes",
]
