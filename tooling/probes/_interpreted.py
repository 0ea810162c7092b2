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
