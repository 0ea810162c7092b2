"""Steps to every prompt's first token on vLLM's real Scheduler, DFlash at K = 15, the seed's
geometry on a platform answering as an H200 (``vllm serve``'s defaults there: 8192 tokens a
step, 1024 sequences), with the default ``max_num_batched_tokens`` (patch 14 widens it by the
drafting slots) and with 8192 set by hand, which is what 0.20.1's default left DFlash.

Each request asks for one token, so a case ends once every prompt is prefilled; "steps"
counts the scheduler's steps to the end, the engine loop's own included.

Run from the checkout's root, with the fixed tree on the path:
  PYTHONPATH=build/work/vllm-0.20.1:. $(.venv/bin/tooling probe-env) \\
      docs/notebook/2026-12-07-budget-kept/prefill_steps.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from tooling.probes._schedsim import Case, Req, Settings, h200_platform
from tooling.probes._schedstep import run_case

WORKLOADS = ((64, 256), (4, 4000), (1, 16000))


def main() -> None:
    root = Path(tempfile.mkdtemp())
    with h200_platform():
        for seqs in (None, 64):
            for label, tokens in (("default", None), ("8192 set", 8192)):
                for n, length in WORKLOADS:
                    settings = Settings(
                        k=15,
                        max_num_seqs=seqs,
                        max_num_batched_tokens=tokens,
                        max_model_len=17000,
                        prefix_caching=False,
                    )
                    reqs = tuple(Req(arrival=0, prompt_len=length, max_tokens=1) for _ in range(n))
                    out = run_case(Case(settings, reqs), root)
                    facts = out.facts
                    print(
                        f"max_num_seqs {seqs or 'unset'}, max_num_batched_tokens {label} "
                        f"({facts['max_num_batched_tokens']}, budget {facts['budget']}): "
                        f"{n} x {length} tokens: {out.outcome} in {out.steps} steps"
                    )


if __name__ == "__main__":
    main()
