"""Patch 33's probe on the patched tree and on trees that hold prompts wrong (slow).

The patched 0.20.1 tree's ``vllm/`` is copied and one condition of the scheduler's hold
changed: a hold with no limit, a hold while nothing runs, a hold while a prompt still
prefills, no hold once the waiting would fill the free slots, or a config that takes a negative
count. The probe must read each
absent, and its details must say which case went wrong.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tooling.probing import ABSENT, PRESENT

from .helpers import mutated_tree, probe_tree

pytestmark = pytest.mark.slow

SCHEDULER = "vllm/v1/core/sched/scheduler.py"
CONFIG = "vllm/config/speculative.py"
HOLD = "def _hold_joins"
#: The rule the first form of the patch had: a batch whose free slots the waiting prompts fill
#: joins at once, so a full batch joined one prompt a step.
SLOTS = (
    "and len(scheduled_running_reqs) > 0 "
    "and num_waiting < self.max_num_running_reqs - len(self.running)"
)


def test_the_patched_tree_holds_prompts_as_set(patched_0201, probe_python, cache):
    result = probe_tree(Path(patched_0201.work_dir), probe_python, cache, "join_hold")
    assert result.status == PRESENT, result.evidence
    assert result.details["cases"]["held"]["waited"] == [3, 2]
    assert result.details["cases"]["at once"]["waited"] == [0, 0]


#: (what changes: file, the text, its replacement, where to look for it from; the case whose
#: outcome or waits then go wrong)
MUTATIONS = {
    "a hold with no limit": (
        (SCHEDULER, "and self.joins_held < self.join_hold_steps", "", HOLD),
        "held",
    ),
    "a hold while nothing runs": (
        (SCHEDULER, "and len(scheduled_running_reqs) > 0", "", HOLD),
        "nothing running",
    ),
    "a hold while a prompt still prefills": (
        (SCHEDULER, "req.num_computed_tokens >= req.num_prompt_tokens", "True", HOLD),
        "prefilling",
    ),
    "no hold once the waiting would fill the free slots": (
        (SCHEDULER, "and len(scheduled_running_reqs) > 0", SLOTS, HOLD),
        "full batch",
    ),
    "a negative count taken": (
        (CONFIG, "if self.join_hold_steps < 0:", "if False:", "def _verify_args"),
        "negative",
    ),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_mutated_tree_reads_absent(mutation, patched_0201, probe_python, cache, tmp_path):
    (path, old, new, anchor), case = MUTATIONS[mutation]
    root = mutated_tree(Path(patched_0201.work_dir), tmp_path, path, old, new, anchor)
    result = probe_tree(root, probe_python, cache, "join_hold")
    assert result.status == ABSENT, result.evidence
    wrong = result.evidence.rsplit("; wrong: ", 1)[-1]
    assert case in wrong.split(", ") or (case == "negative" and "a negative count" in wrong)
