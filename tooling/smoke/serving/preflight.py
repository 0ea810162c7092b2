"""Which vLLM the serving interpreter imports, whether the reference imports, and the GPUs.

``python -m tooling.smoke.serving.preflight OUT.json ARCHS_JSON [--ray]`` writes
``{"version", "location", "dflash_error", "gpus", "gpu_error", "modelinfo_error"}``, and
with ``--ray`` ``"ray_error"`` and ``"ray_version"``; it exits non-zero (no OUT) when vLLM
does not import. ``--gpus-only`` in place of ARCHS_JSON asks torch for the GPUs alone (a
dry run's plan, no vLLM needed).

vLLM inspects each model class in a subprocess of its own (an import of vLLM and
torch, in each of the run's engines at once) unless ``VLLM_CACHE_ROOT/modelinfos``
holds the answer, keyed by the hash of the model's module. The run's cache starts
empty; answered here, where vLLM is imported already, every engine reads it. Best
effort: vLLM asks itself otherwise.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def gpus() -> dict[str, Any]:
    """Each visible GPU's free and total bytes, or why torch cannot say."""
    try:
        import torch

        return {
            "gpus": [
                dict(zip(("free", "total"), torch.cuda.mem_get_info(i), strict=True))
                for i in range(torch.cuda.device_count())
            ]
        }
    except Exception as e:
        return {"gpus": None, "gpu_error": f"{type(e).__name__}: {e}"}


def ray_executor() -> dict[str, Any]:
    """Whether vLLM's Ray executor can start here, by vLLM's own checks: the import of Ray
    its executor makes at start-up, and the Ray version and compiled-graph module it needs
    at the first request (after the server has answered /health)."""
    try:
        from vllm.v1.executor import ray_utils

        ray_utils.assert_ray_available()
        from vllm.v1.executor.ray_executor import RayDistributedExecutor

        # An instance method that reads no instance state.
        RayDistributedExecutor._check_ray_cgraph_installation(None)
        return {"ray_error": None, "ray_version": ray_utils.ray.__version__}
    except Exception as e:
        return {"ray_error": f"{type(e).__name__}: {e}", "ray_version": None}


def preflight(architectures: list[str], ray: bool = False) -> dict[str, Any]:
    import vllm

    out: dict[str, Any] = {
        "version": vllm.__version__,
        "location": str(Path(vllm.__file__).parent),
    }
    try:
        import dflash.model  # noqa: F401  (the reference the fidelity check compares with)

        out["dflash_error"] = None
    except Exception as e:
        out["dflash_error"] = f"{type(e).__name__}: {e}"
    out.update(gpus())
    try:
        from vllm.model_executor.models import registry

        registry._run_in_subprocess = lambda fn: fn()
        for arch in architectures:
            registry.ModelRegistry.models[arch].inspect_model_cls()
        out["modelinfo_error"] = None
    except Exception as e:
        out["modelinfo_error"] = f"{type(e).__name__}: {e}"
    if ray:
        out.update(ray_executor())
    return out


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    if argv[1] == "--gpus-only":
        result = gpus()
    else:
        result = preflight(json.loads(argv[1]), ray="--ray" in argv[2:])
    out.write_text(json.dumps(result), encoding="utf-8")
    logger.debug("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
