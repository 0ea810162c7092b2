"""Patch 33's probe on the patched tree and on trees that hold prompts wrong (slow).

The patched 0.20.1 tree's ``vllm/`` is copied and one condition of the scheduler's hold
changed: a hold with no limit, a hold while nothing runs, a hold while a prompt still
prefills, no hold once the waiting would fill the free slots, or a config that takes a negative
count. The probe must read each
absent, and its details must say which case went wrong. On 0.34.0, which has no such option
but a prefill cadence of its own, the probe reads the cadence: present on stock 0.34.0, absent
where the cadence acts only under data parallelism.
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


#: Where 0.34.0 applies its prefill cadence outside data parallelism: made DP-only, as the
#: releases before it had it, no prompt waits.
LOCAL_CADENCE = ("self.parallel_config.data_parallel_size == 1", "False")


def test_0340s_own_cadence_reads_present_and_a_dp_only_cadence_absent(
    catalog, fetch_release, probe_python, cache, tmp_path
):
    """0.34.0 has no ``join_hold_steps`` but a prefill cadence of its own: the probe reads
    it by behaviour (fix 33 superseded there), and reads absent on the same tree with the
    cadence applied only under data parallelism, naming the held case."""
    upstream = fetch_release(catalog.get("0.34.0"), with_wheel=False)
    stock = probe_tree(upstream.source_dir, probe_python, cache, "join_hold")
    assert stock.status == PRESENT, stock.evidence
    assert "prefill cadence" in stock.evidence
    assert stock.details["cases"]["held"]["waited"] == [3, 2]
    assert stock.details["cases"]["spaced"]["waited"] == [0, 3]
    old, new = LOCAL_CADENCE
    root = mutated_tree(
        upstream.source_dir, tmp_path, SCHEDULER, old, new, "self.local_prefill_interval = ("
    )
    result = probe_tree(root, probe_python, cache, "join_hold")
    assert result.status == ABSENT, result.evidence
    assert "held" in result.evidence.rsplit("; wrong: ", 1)[-1].split(", ")
