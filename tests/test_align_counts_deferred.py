"""Patch 39's probe on the patched tree and on trees that skip the read back wrongly (slow).

The patched 0.20.1 tree's ``vllm/`` is copied and its test of whether a request can complete
a block changed: never, or missing the range's first or last token. Each such tree skips
the read back in a step whose state copy needs the counts, and the probe must read it
unknown, naming that step; stock 0.20.1 waits after every verify step and reads absent.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tooling.probing import ABSENT, PRESENT, UNKNOWN

from .helpers import mutated_tree, probe_tree

pytestmark = pytest.mark.slow

RUNNER = "vllm/v1/worker/gpu_model_runner.py"
TEST = "def _a_block_can_complete"
CAN = "if end // block_size * block_size >= end - len(drafts.get(req_id, ())):"


def test_the_patched_tree_waits_only_where_a_block_can_complete(patched_0201, probe_python, cache):
    result = probe_tree(Path(patched_0201.work_dir), probe_python, cache, "align_counts_deferred")
    assert result.status == PRESENT, result.evidence
    steps = result.details
    assert steps["step 1"]["reads"] == [] and steps["step 1"]["copies"] == []
    assert steps["step 1"]["events"] == 1
    assert steps["step 2"]["copies"] == [{"end": 4, "start": 4}]
    assert steps["step 3"]["copies"] == [{"end": 3, "start": 2}]
    assert steps["step 2"]["reads"] and steps["step 3"]["reads"]


def test_stock_waits_after_every_verify_step(upstream_0201, probe_python, cache):
    result = probe_tree(upstream_0201.source_dir, probe_python, cache, "align_counts_deferred")
    assert result.status == ABSENT, result.evidence
    assert result.details["step 1"]["reads"] == ["cpu", "numpy"]


#: (the replacement of the test's condition, the verify step whose state copy goes missing)
MUTATIONS = {
    "never": ("if False:", 2),
    "the range's last token missed": (
        "if (end - 1) // block_size * block_size >= end - len(drafts.get(req_id, ())):",
        2,
    ),
    "the range's first token missed": (
        "if end // block_size * block_size > end - len(drafts.get(req_id, ())):",
        3,
    ),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_tree_that_skips_a_needed_read_reads_unknown(
    mutation, patched_0201, probe_python, cache, tmp_path
):
    new, step = MUTATIONS[mutation]
    root = mutated_tree(Path(patched_0201.work_dir), tmp_path, RUNNER, CAN, new, TEST)
    result = probe_tree(root, probe_python, cache, "align_counts_deferred")
    assert result.status == UNKNOWN, result.evidence
    assert f"verify step {step} (" in result.evidence
    assert "state copies []" in result.evidence
