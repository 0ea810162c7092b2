"""A probe function run where Triton interprets its kernels on the CPU.

vLLM must import Triton with the interpreter on and no GPU visible, so the function runs in
a fresh interpreter of its own; what it returns comes back as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult


class NotInterpreted(Exception):
    """The function did not run; the message is the tail of what its interpreter printed."""


def run_interpreted(module: str, function: str) -> Any:
    """``module.function()`` of this package, run under Triton's interpreter, its JSON read."""
    # The probes' own package, whatever its name in the probed interpreter (a copy's).
    package = __package__
    code = (
        f"import json; from {package} import _harness; _harness.install_cpu_platform(); "
        f"from {package} import {module} as m; print(json.dumps(m.{function}()))"
    )
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        # vLLM keeps Triton where no GPU driver is active only with no visible device.
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
    }
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        raise NotInterpreted(" ".join(done.stderr.split()[-40:]))
    return json.loads(done.stdout.strip().splitlines()[-1])


def interpreted_or_unknown(probe: str, function: str, what: str) -> dict[str, Any] | ProbeResult:
    """``function()`` of the probe's own module (named ``probe``) run under Triton's
    interpreter, or the probe's unknown verdict: ``what`` could not be done, and why."""
    try:
        return dict(run_interpreted(probe, function))
    except NotInterpreted as e:
        return ProbeResult(probe=probe, status=UNKNOWN, evidence=f"{what}: {e}")


class Uncounted:
    """A Triton kernel launched with the dispatch modes off: under a counting mode, the
    interpreter's own tensor operations are not the probed code's."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: Any) -> Any:
        from torch.utils._python_dispatch import _disable_current_modes

        def launch(*args: Any, **kwargs: Any) -> Any:
            with _disable_current_modes():
                return self.kernel[grid](*args, **kwargs)

        return launch


def counted_verdict(
    probe: str, wrong: list[str], what: str, ops: int, max_ops: int, evidence: str, details: Any
) -> ProbeResult:
    """The verdict of a probe that counts operations: unknown where anything is ``wrong``
    (``what`` names it), else present at most ``max_ops`` operations, absent above."""
    if wrong:
        evidence = f"{what} wrong: " + "; ".join(wrong)
        return ProbeResult(probe=probe, status=UNKNOWN, evidence=evidence, details=details)
    status = PRESENT if ops <= max_ops else ABSENT
    return ProbeResult(probe=probe, status=status, evidence=evidence, details=details)
