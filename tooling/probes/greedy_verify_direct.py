"""Fix 35: an all-greedy verify step takes one argmax of the raw logits.

To verify a step's drafts, vLLM 0.20.1's V1 rejection sampler runs the full sampler on the
bonus rows (a float32 copy, the logits processors, an argmax, two conversions), then gathers
the target rows, copies them to float32 and clones that copy, and takes a second argmax,
whatever the batch asks for. Where every request is greedy and nothing can move an argmax
(no penalty, bad word, allowed-token mask or active min-tokens processor, no logprobs), both
argmaxes are the argmax of the raw logits: widening bf16 to float32 is exact. Each of those
operations is a launch on the GPU host at every step, and at the seed's vocabulary of 248,320
tokens the two float32 copies of 16 rows a request are most of the sampler's memory traffic.

The probe runs the tree's own ``RejectionSampler`` with vLLM's ``Sampler`` on a verify step of
four requests at K = ``K`` in Triton's interpreter on the CPU: bf16 logits on a coarse grid,
so that rows hold ties, and drafts that agree with the target for a drawn number of
positions. It runs the step three ways:

- all greedy, nothing else asked (the step DFlash serves): it counts the tensor operations
  the sampler dispatches outside the verify kernel, views left out;
- with vLLM's min-tokens processor active for one request whose stop token is the argmax of
  its first draft row (its rows must read that token as -inf);
- with logprobs asked for (they must come back).

Each step's tokens are checked against the greedy rule computed here from the float32 rows
(first of equal maxima, the masked token left out where min-tokens holds).

Present: every step's tokens are right and the plain greedy step dispatches at most
``MAX_OPS`` operations. Absent: right, but it dispatches more. Unknown: any token, shape or
dtype wrong, or the sampler could not be run.
"""

from __future__ import annotations

import random
from typing import Any

from . import _harness
from ._interpreted import Uncounted, counted_verdict, interpreted_or_unknown
from .gdn_uniform_metadata import _counted as counted_ops
from .result import ProbeResult

NAME = "greedy_verify_direct"
K = 3
REQUESTS = 4
VOCAB = 64
#: Operations outside the kernel an all-greedy step may dispatch: the argmax, the two
#: gathers of its rows, the bonus tokens' int32 and the output buffer, with one to spare.
MAX_OPS = 6
#: The request min-tokens holds in the second run.
HELD = 1
#: vLLM's placeholder for a position past a rejection.
PLACEHOLDER = -1


def _drawn() -> tuple[list[list[float]], list[list[int]]]:
    """Logits rows (each request's K draft rows, then its bonus row) on a grid of halves, so
    that rows hold equal maxima, and drafts that follow the target for a drawn count."""
    rnd = random.Random(35)
    rows = [[rnd.randint(-3, 3) * 0.5 for _ in range(VOCAB)] for _ in range(REQUESTS * (K + 1))]
    drafts = []
    for r in range(REQUESTS):
        agree = rnd.randint(0, K) if r != HELD else K
        block = rows[r * (K + 1) : r * (K + 1) + K]
        drafts.append(
            [
                _first_max(row) if i < agree else (_first_max(row) + 1) % VOCAB
                for i, row in enumerate(block)
            ]
        )
    return rows, drafts


def _first_max(row: list[float], masked: frozenset[int] = frozenset()) -> int:
    best = max(v for i, v in enumerate(row) if i not in masked)
    return next(i for i, v in enumerate(row) if v == best and i not in masked)


def expected(rows: list[list[float]], drafts: list[list[int]], masked: dict[int, int]) -> list:
    """Each request's tokens by the greedy rule: the target's token at each draft position
    until the first that differs from the draft, then the bonus if every draft held;
    ``masked`` is a request's stop token, left out of all its rows."""
    out = []
    for r, draft in enumerate(drafts):
        hidden = frozenset({masked[r]}) if r in masked else frozenset()
        block = rows[r * (K + 1) : (r + 1) * (K + 1)]
        tokens = []
        for pos, token in enumerate(draft):
            tokens.append(_first_max(block[pos], hidden))
            if tokens[-1] != token:
                break
        else:
            tokens.append(_first_max(block[K], hidden))
        out.append(tokens + [PLACEHOLDER] * (K + 1 - len(tokens)))
    return out


def _spec(drafts: list[list[int]]) -> Any:
    """The step's speculative metadata as the runner lays it out: each request's draft rows,
    then its bonus row."""
    import torch
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    counts = [len(d) for d in drafts]
    starts = [sum(n + 1 for n in counts[:r]) for r in range(len(counts))]
    target = [s + i for s, n in zip(starts, counts, strict=True) for i in range(n)]
    bonus = [s + n for s, n in zip(starts, counts, strict=True)]
    cumsum = [sum(counts[: r + 1]) for r in range(len(counts))]
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor([t for d in drafts for t in d], dtype=torch.int32),
        num_draft_tokens=counts,
        cu_num_draft_tokens=torch.tensor(cumsum, dtype=torch.int32),
        cu_num_sampled_tokens=torch.tensor(
            [c + r + 1 for r, c in enumerate(cumsum)], dtype=torch.int32
        ),
        target_logits_indices=torch.tensor(target, dtype=torch.int64),
        bonus_logits_indices=torch.tensor(bonus, dtype=torch.int64),
        logits_indices=torch.arange(sum(counts) + len(counts), dtype=torch.int64),
    )


def _metadata(held: Any, logprobs: int | None) -> Any:
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    n = REQUESTS
    return SamplingMetadata(
        temperature=None,
        all_greedy=True,
        all_random=False,
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=logprobs,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n),
        repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors([held]),
        spec_token_ids=[[] for _ in range(n)],
    )


def _min_tokens(stop: int | None) -> Any:
    """vLLM's min-tokens processor as a speculative engine builds it, holding request HELD
    below its minimum with ``stop`` as its stop token (none: idle)."""
    import torch
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
    from vllm.v1.sample.logits_processor.interface import BatchUpdate

    held = MinTokensLogitsProcessor(None, torch.device("cpu"), False)  # type: ignore[arg-type]
    if stop is not None:
        params = SamplingParams(max_tokens=100, min_tokens=100, stop_token_ids=[stop])
        added: list[Any] = [(HELD, params, None, [])]
        held.update_state(BatchUpdate(batch_size=REQUESTS, removed=[], added=added, moved=[]))
    return held


def _counted(module: Any, step: Any) -> tuple[Any, int]:
    """``step()``'s result and the operations it dispatched outside the verify kernel."""
    kernel = Uncounted(module.rejection_greedy_sample_kernel)
    with _harness.replaced(module, rejection_greedy_sample_kernel=kernel):
        return counted_ops(step)


def verified() -> dict[str, Any]:
    """The three runs' tokens, dtypes and shapes, the plain run's operation count and the
    expected tokens (run where Triton interprets)."""
    import torch
    import vllm.v1.sample.rejection_sampler as module
    from vllm.v1.sample.sampler import Sampler

    rows, drafts = _drawn()
    logits = torch.tensor(rows, dtype=torch.bfloat16)
    widened = logits.float().tolist()
    spec = _spec(drafts)
    sampler = module.RejectionSampler(Sampler())
    stop = _first_max(widened[HELD * (K + 1)])
    runs = {
        "greedy": (_metadata(_min_tokens(None), None), {}),
        "min_tokens": (_metadata(_min_tokens(stop), None), {HELD: stop}),
        "logprobs": (_metadata(_min_tokens(None), 0), {}),
    }
    found: dict[str, Any] = {}
    for name, (sampling, masked) in runs.items():
        # Its own copy: the general path may write the logits it is given.
        given = logits.clone()
        out, ops = _counted(module, lambda s=sampling, g=given: sampler(spec, None, g, s))
        tokens = out.sampled_token_ids
        found[name] = {
            "tokens": tokens.tolist(),
            "dtype": str(tokens.dtype),
            "expected": expected(widened, drafts, masked),
            "logprobs": out.logprobs_tensors is not None,
            "ops": ops,
        }
    return found


def _wrong(found: dict[str, Any]) -> list[str]:
    wrong = [
        f"{name}: tokens {run['tokens']}, expected {run['expected']}"
        for name, run in found.items()
        if run["tokens"] != run["expected"]
    ]
    wrong += [f"{n}: dtype {r['dtype']}" for n, r in found.items() if r["dtype"] != "torch.int32"]
    if not found["logprobs"]["logprobs"]:
        wrong.append("logprobs asked for and not returned")
    return wrong


def run() -> ProbeResult:
    found = interpreted_or_unknown(NAME, "verified", "the rejection sampler could not be run")
    if isinstance(found, ProbeResult):
        return found
    wrong = _wrong(found)
    ops = found["greedy"]["ops"]
    evidence = (
        f"{REQUESTS} requests at K={K}, tied bf16 rows: tokens right all greedy, with "
        f"min-tokens held and with logprobs; the all-greedy step dispatches {ops} operations "
        f"outside the verify kernel (at most {MAX_OPS} take one argmax of the raw logits)"
    )
    what = "the verify step's tokens are"
    return counted_verdict(NAME, wrong, what, ops, MAX_OPS, evidence, {"found": found})
