"""What the GPU fuzzer's tests share: a case, hand-built records of a workload and its
requests, and the GPU findings kept under tests/data/gpu-fuzz."""

from __future__ import annotations

from pathlib import Path

from tooling.fuzzing.gpu_case import GpuCase, GpuReq, GpuSettings
from tooling.fuzzing.gpu_oracles import RequestRun, WorkloadRun

CASE = GpuCase(
    GpuSettings(k=15, max_num_batched_tokens=512, prefix_caching=True, cudagraph_mode="eager"),
    (GpuReq(arrival=2, prompt_len=16, max_tokens=9, stop=True, logprobs=5),),
)

GPU_CASES = sorted((Path(__file__).parent / "data" / "gpu-fuzz").glob("*.json"))


def lp(first: float, second: float, tokens: tuple[int, int] = (1, 2)) -> dict[str, float]:
    return {str(tokens[0]): first, str(tokens[1]): second}


def run(results: dict[str, RequestRun], **more) -> WorkloadRun:
    steps = len(more.get("scheduled", [1, 1]))
    values = {
        "index": 0,
        "bound": 100,
        "results": results,
        "scheduled": [1] * steps,
        "produced": [1] * steps,
        "unfinished": [0] * steps,
    }
    return WorkloadRun(**{**values, **more})


def done(tokens: list[int], logprobs: list[dict[str, float]], **more) -> RequestRun:
    return RequestRun(tokens, logprobs, "length", added=0, finished=3, **more)
