"""Fix 13: a prefill chunk smaller than one Mamba block is scheduled, never floored to none.

Runs vLLM's real Scheduler for the seed's geometry (``_schedsim``: Qwen3.6-27B's hybrid
layers, z-lab's drafter, the attention block vLLM's own code sizes, 480 tokens at K = 15),
prefix caching on (Mamba cache mode "align"), with step budgets smaller than one block:

- DFlash at K = 15 with --max-num-batched-tokens 512 --max-num-seqs 16 (a budget of 288
  tokens): a 481-token prompt (one block and a token, the fixed wheel's threshold before)
  and a 961-token prompt (two blocks and a token, stock 0.20.1's, which drops a block for
  EAGLE);
- DFlash at K = 15 with --max-num-batched-tokens 824 --max-num-seqs 16 (a budget of 600
  tokens, more than a block): fifteen decodes take 240 tokens a step, and a 1000-token
  prompt arriving beside them has 360, less than a block, step after step;
- without speculation, --max-num-batched-tokens 256 (the block is 400 tokens): a
  400-token prompt, which 0.20.1 refuses with an assertion only once the weights load;
- DFlash at K = 1 with --max-num-batched-tokens 256: long prefills leave less than a block
  of each step, and a 167-token prompt arrives beside them (the fuzzer's finding on 0.34.0,
  whose 64-token blocks keep the other cases out of reach but round this chunk to none).

Fixed means every prompt finishes without being passed over while the step has room for
it, and every chunk leaves the blocks it fills holding the state at their end
(``mamba-state``); absent, that a prompt waits for ever or for the decodes beside it to end
(``starve``), or the setting is refused after loading.
"""

from __future__ import annotations

from . import _harness
from ._schedprobe import served_verdict
from ._schedsim import Case, Req, Settings, h200_platform
from ._schedstep import run_case
from .result import ProbeResult

NAME = "mamba_chunk_liveness"
DFLASH = Settings(k=15, max_num_batched_tokens=512, max_num_seqs=16, prefix_caching=True)
BESIDE_DECODES = Settings(k=15, max_num_batched_tokens=824, max_num_seqs=16, prefix_caching=True)
PLAIN = Settings(k=0, max_num_batched_tokens=256, max_num_seqs=16, prefix_caching=True)
#: Fifteen long decodes, then the prompt of the case at step 3.
DECODES = tuple(Req(arrival=0, prompt_len=20 + i, max_tokens=600) for i in range(15))
#: Found by the scheduler fuzzer on 0.34.0 (tests/data/sched-fuzz-0.34.0): prefills of about
#: 4095 tokens take the step's 256 tokens but the last few, fewer than a block (64 tokens
#: there), and the 167-token prompt arriving at step 23 is passed over while they last.
BESIDE_PREFILLS = Settings(
    k=1, max_num_batched_tokens=256, max_num_seqs=256, prefix_caching=True, kv_memory_factor=4.0
)
PREFILLS = (
    Req(arrival=0, prompt_len=4095, max_tokens=1),
    Req(arrival=3, prompt_len=2, max_tokens=4094),
    Req(arrival=4, prompt_len=4095, max_tokens=1, prefix=2, prefix_len=4093, min_tokens=1),
    Req(arrival=10, prompt_len=4086, max_tokens=1),
)
CASES = (
    ("DFlash K=15, budget 288", DFLASH, 481, (), 0),
    ("DFlash K=15, budget 288", DFLASH, 961, (), 0),
    ("DFlash K=15, budget 600 beside 15 decodes", BESIDE_DECODES, 1000, DECODES, 3),
    ("no speculation, 256 tokens a step", PLAIN, 400, (), 0),
    ("DFlash K=1, 256 tokens a step beside long prefills", BESIDE_PREFILLS, 167, PREFILLS, 23),
)
#: What each outcome says of the fix: a stall, a starved prompt or a late refusal is the
#: defect.
DEFECTS = ("stall", "starve", "livelock", "late-refusal", "mamba-state")


def run() -> ProbeResult:
    root = _harness.scratch_dir()
    results = []
    with h200_platform():
        for label, settings, prompt, beside, arrival in CASES:
            case = Case(settings, (*beside, Req(arrival=arrival, prompt_len=prompt, max_tokens=4)))
            results.append((label, prompt, run_case(case, root)))
    return served_verdict(
        NAME,
        "prefix caching at the seed's geometry",
        [(f"{label}, {prompt}-token prompt", o) for label, prompt, o in results],
        DEFECTS,
    )
