"""Which drawn settings the DFlash engine refuses at start-up, without starting an engine.

Runs on the GPU host as ``python -m tooling.fuzzing.serving.gpu_vet IN.json OUT.json`` in
the interpreter of the vLLM under test. A setting vLLM refuses ends its engine pair before
any workload, after the pair's processes imported vLLM and began to start, on the GPU's
time; a campaign that draws several such settings spends its time on refusals. This
child imports vLLM once and, for each setting, builds the DFlash engine's ``LLM`` exactly as
``gpu_run`` does, stopped where vLLM's own ``EngineArgs.create_engine_config`` returns: every
check vLLM (and the series) makes of the settings has run, and nothing touched the GPU's
memory. A refusal is the one line the pair would have recorded; ``None`` a setting that
passes, whose pair is served as before (a refusal only an engine's start finds, such as the
memory its KV cache needs, still ends its pair there).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from ...smoke.serving.child import exit_now, serve
from ...smoke.serving.distribution import start_engine
from ..gpu_case import GpuSettings
from .gpu_run import REFUSALS, GpuRunRequest, _engine_request, _one_line

logger = logging.getLogger(__name__)


class _Built(Exception):
    """Raised once vLLM has built the engine's config: the setting passed every check."""


def vet(request: dict[str, Any]) -> dict[str, Any]:
    """``{"refused": [reason or None, ...]}`` for ``request["settings"]``, in order."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm.engine.arg_utils import EngineArgs

    built = EngineArgs.create_engine_config

    def stop_once_built(self: Any, *args: Any, **kwargs: Any) -> Any:
        built(self, *args, **kwargs)
        raise _Built

    EngineArgs.create_engine_config = stop_once_built  # type: ignore[method-assign]
    refused: list[str | None] = []
    for settings in request["settings"]:
        run = GpuRunRequest(
            role="dflash",
            target=request["target"],
            drafter=request["drafter"],
            settings=GpuSettings(**settings),
            kv_cache_memory_bytes=request["kv_cache_memory_bytes"],
            figures_file="",
            progress="",
            vocab_size=request["vocab_size"],
        )
        logger.debug("vet %s", run.settings)
        try:
            start_engine(_engine_request(run))
        except _Built:
            refused.append(None)
        except REFUSALS as e:
            refused.append(_one_line(e))
        else:
            raise RuntimeError("an engine started: the config was not built where expected")
    return {"refused": refused}


def main(argv: list[str]) -> int:
    return serve(Path(argv[0]), Path(argv[1]), vet)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
