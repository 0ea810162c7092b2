"""Patch 40's probe on the patched tree, on stock, and on trees that get the step graph's
inputs wrong (slow).

The patched 0.20.1 tree's ``vllm/`` is copied and one line of its step graphs changed: the
next token ids or the rejected counts not copied to the graph's buffers before a replay, or
the warm-ups run on the runner's block table. Each such tree drafts from stale inputs, or
writes KV slots while capturing, and the probe must read it unknown; stock 0.20.1 has no such
option and reads absent.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tooling.probing import ABSENT, PRESENT, UNKNOWN

from .helpers import mutated_tree, probe_tree

pytestmark = pytest.mark.slow

DFLASH = "vllm/v1/spec_decode/dflash.py"
PARTS = ("combine", "inputs", "context", "forward", "sample")


def test_the_patched_tree_replays_a_fitting_step_as_one_graph(patched_0201, probe_python, cache):
    result = probe_tree(Path(patched_0201.work_dir), probe_python, cache, "dflash_step_graphs")
    assert result.status == PRESENT, result.evidence
    capture, on = result.details["capture"], result.details["on"]
    assert capture["step_graphs"] == capture["keys"] == 4
    assert capture["warm_up_slots"] == []
    fits, falls_back = on[:2], on[2]
    assert all(step["where"][part] == ["step"] for step in fits for part in PARTS)
    assert falls_back["where"]["forward"] == ["model"]
    assert all(falls_back["where"][p] == ["host"] for p in ("combine", "inputs", "sample"))
    assert [s["drafts"] for s in on] == result.details["off_drafts"]


def test_stock_has_no_step_graphs(upstream_0201, probe_python, cache):
    result = probe_tree(upstream_0201.source_dir, probe_python, cache, "dflash_step_graphs")
    assert result.status == ABSENT, result.evidence
    assert "refuses" in result.evidence


#: (the line changed, what replaces it, what the probe must name)
MUTATIONS = {
    "next token ids not staged": (
        "inputs.next_token_ids[:num_reqs].copy_(next_token_ids[:num_reqs])",
        "pass",
        "drafts and rows differ",
    ),
    "rejected counts not staged": (
        "inputs.num_rejected[:num_reqs].copy_(num_rejected_tokens_gpu[:num_reqs])",
        "pass",
        "drafts and rows differ",
    ),
    "warm-ups on the runner's block table": (
        "inputs.block_table = table if mode == CUDAGraphMode.FULL else no_blocks",
        "inputs.block_table = table",
        "warm-ups wrote slots [",
    ),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_tree_that_stages_a_step_wrongly_reads_unknown(
    mutation, patched_0201, probe_python, cache, tmp_path
):
    old, new, named = MUTATIONS[mutation]
    root = mutated_tree(Path(patched_0201.work_dir), tmp_path, DFLASH, old, new, "class DFlash")
    result = probe_tree(root, probe_python, cache, "dflash_step_graphs")
    assert result.status == UNKNOWN, result.evidence
    assert named in result.evidence
