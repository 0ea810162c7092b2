"""Fix 15: the smallest KV cache vLLM starts with serves one request of max_model_len.

Runs vLLM's real Scheduler for the seed's geometry (``_schedsim``) over a KV cache of
exactly the memory vLLM's own start-up check asks for one request of max_model_len (its
``_max_memory_usage_bytes_from_groups`` over the groups it makes), and serves one prompt
that needs every block a request can have (prefix caching off, so only the null block
decides):

- DFlash at K = 7, max_model_len 4096, a 4033-token prompt;
- no speculation, fp8 KV, max_model_len 512, a one-token prompt (the Gated DeltaNet groups
  take their blocks up front).

Fixed means both are served; absent, that the engine starts and the prompt waits for ever
(the pool keeps one block as its null block and never gives it out).
"""

from __future__ import annotations

from . import _harness
from ._schedprobe import served_verdict
from ._schedsim import Case, Req, Settings, h200_platform
from ._schedstep import run_case
from .result import ProbeResult

NAME = "kv_null_block"
CASES = (
    (
        "DFlash K=7, max_model_len 4096",
        Settings(
            k=7,
            max_num_batched_tokens=512,
            max_num_seqs=1,
            max_model_len=4096,
            kv_memory_factor=1.0,
            prefix_caching=False,
        ),
        4033,
    ),
    (
        "no speculation, fp8 KV, max_model_len 512",
        Settings(
            k=0,
            max_num_batched_tokens=384,
            max_model_len=512,
            kv_cache_dtype="fp8",
            kv_memory_factor=1.0,
            prefix_caching=False,
        ),
        1,
    ),
)


def run() -> ProbeResult:
    root = _harness.scratch_dir()
    with h200_platform():
        results = [
            (
                label,
                prompt,
                run_case(Case(s, (Req(arrival=0, prompt_len=prompt, max_tokens=1),)), root),
            )
            for label, s, prompt in CASES
        ]
    return served_verdict(
        NAME,
        "the smallest KV cache vLLM starts with",
        [(f"{label}, {prompt}-token prompt", o) for label, prompt, o in results],
        ("stall",),
    )
