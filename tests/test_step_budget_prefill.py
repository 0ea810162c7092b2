"""Fix 14 on vLLM's real Scheduler (the fixed tree, on the CPU): with README's serving line on
an H200's defaults, DFlash's prompts get the step budget plain vLLM's get, so a burst of
prompts is prefilled in as many steps; 8192 tokens set by hand, as 0.20.1's default left
DFlash, give them 4370 a step."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from .helpers import run_on_tree

SCRIPT = textwrap.dedent(
    """
    import json
    import sys
    import tempfile
    from pathlib import Path

    from tooling.probes._schedsim import Case, Req, Settings, h200_platform
    from tooling.probes._schedstep import run_case

    out = {}
    with tempfile.TemporaryDirectory() as tmp, h200_platform():
        for label, tokens in (("default", None), ("8192 set", 8192)):
            settings = Settings(
                k=15, max_num_batched_tokens=tokens, max_model_len=2048, prefix_caching=False
            )
            # One token each: every step that schedules tokens prefills prompts.
            reqs = tuple(Req(arrival=0, prompt_len=256, max_tokens=1) for _ in range(64))
            steps = []
            observe = lambda scheduler, output: steps.append(output.total_num_scheduled_tokens)
            outcome = run_case(Case(settings, reqs), Path(tmp), observe=observe)
            out[label] = {
                "outcome": outcome.outcome,
                "facts": outcome.facts,
                "prefill_steps": [n for n in steps if n],
            }
    Path(sys.argv[2]).write_text(json.dumps(out))
    """
)


@pytest.mark.slow
def test_readme_line_prefills_with_plains_budget(patched_0201, probe_python, tmp_path):
    assert patched_0201.ok
    result = run_on_tree(
        probe_python, Path(patched_0201.work_dir), tmp_path, SCRIPT, "", timeout=600
    )
    default, by_hand = result["default"], result["8192 set"]
    assert default["outcome"] == by_hand["outcome"] == "pass", result
    # The default widened by 273 sequences' 14 drafting slots; the scheduler keeps 8192.
    assert default["facts"]["max_num_batched_tokens"] == 8192 + 14 * 273, default["facts"]
    assert default["facts"]["budget"] == 8192, default["facts"]
    assert by_hand["facts"]["budget"] == 8192 - 14 * 273, by_hand["facts"]
    # 64 prompts of 256 tokens: two full steps, against four with the budget cut.
    assert default["prefill_steps"] == [8192, 8192], default
    assert len(by_hand["prefill_steps"]) == 4, by_hand
    assert sum(by_hand["prefill_steps"]) == 64 * 256, by_hand
