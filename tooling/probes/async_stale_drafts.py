"""Fix 21: a request the asynchronous scheduler passes over verifies no drafts the worker
cannot fill.

With asynchronous scheduling (0.20.1's default with DFlash) the scheduler gives each
request it schedules K placeholder drafts (-1) for the next step, which the worker fills
from the drafts it made in that batch. A running request the scheduler passes over in a
step (max_model_len leaves it no token until its drafts' outcome is known, or the step's
budget ran out before it) leaves the worker's batch, and its drafts with it; stock 0.20.1
keeps its placeholders and schedules them when the request comes back, and the worker
hands the model -1 as token ids: on a GPU, a device-side assert in the embedding, and the
engine dies (the GPU fuzzer's first crash, tests/data/gpu-fuzz).

Runs vLLM's real Scheduler for the seed's geometry (``_schedsim``), driven the way the
engine core drives it with asynchronous scheduling (two batches in flight), on the cases
the scheduler fuzzer found and shrank, each a prompt that ends at max_model_len beside
decodes:

- K = 7, max_model_len 700: a 690-token prompt asking for 5 tokens;
- K = 15, max_model_len 256: a 238-token prompt asking for 8, arriving beside decodes;
- K = 15, max_model_len 1024, --max-num-batched-tokens 768 --max-num-seqs 4 and
  long_prefill_token_threshold 100: the GPU finding's own settings and prompts, from 1006
  tokens asking for 18 (prompt plus output = max_model_len).

Fixed means every request scheduled with drafts was in the previous batch; absent, that
one verifies drafts the worker never made (``stale-drafts``).
"""

from __future__ import annotations

from . import _harness
from ._schedprobe import served_verdict
from ._schedsim import Case, Req, Settings, h200_platform
from ._schedstep import run_case, worker_fills_drafts_from_last_batch
from .result import UNKNOWN, ProbeResult

NAME = "async_stale_drafts"
K7 = Settings(
    k=7,
    max_num_batched_tokens=2048,
    max_num_seqs=8,
    max_model_len=700,
    long_prefill_token_threshold=100,
)
K15 = Settings(k=15, max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=256)
GPU = Settings(
    k=15,
    max_num_batched_tokens=768,
    max_num_seqs=4,
    max_model_len=1024,
    long_prefill_token_threshold=100,
)
CASES = (
    ("K=7, max_model_len 700", Case(K7, (Req(0, 1, 87), Req(0, 690, 5), Req(1, 1, 32)), seed=58)),
    (
        "K=15, max_model_len 256",
        Case(K15, (Req(0, 1, 4), Req(0, 1, 16), Req(21, 1, 100), Req(22, 238, 8)), seed=151),
    ),
    (
        "K=15, max_model_len 1024, 768 tokens a step, 4 sequences",
        Case(
            GPU,
            (
                Req(0, 696, 100),
                Req(0, 480, 100),
                Req(0, 1006, 18),
                Req(0, 1008, 2),
                Req(2, 15, 2),
                Req(5, 480, 32),
            ),
            seed=0,
        ),
    ),
)
DEFECTS = ("stale-drafts",)


def run() -> ProbeResult:
    if not worker_fills_drafts_from_last_batch():
        # The question is the V1 worker's; 0.34.0's ledger says why the fix is not needed.
        return ProbeResult(
            probe=NAME,
            status=UNKNOWN,
            evidence="no V1 model runner: the V2 worker takes each request's drafts from its "
            "own persistent row, not from its previous batch, so a placeholder the scheduler "
            "keeps is never what the model embeds",
        )
    root = _harness.scratch_dir()
    with h200_platform():
        results = [(label, run_case(case, root)) for label, case in CASES]
    return served_verdict(NAME, "asynchronous scheduling at the seed's geometry", results, DEFECTS)
