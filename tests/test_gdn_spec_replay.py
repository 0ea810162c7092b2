"""Patch 32's probe on trees that carry the option but get the replay wrong (slow).

The patched 0.20.1 tree's ``vllm/`` is copied and one line changed: a verify step that replays
one row too many (the count used as the number of rows), a caller that keeps the stock
kernel with the option on, or a config that no longer refuses prefix caching's "align" mode.
The probe must read each absent, and say why.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tooling.probing import ABSENT, PRESENT

from .helpers import mutated_tree, probe_tree

pytestmark = pytest.mark.slow

KERNEL = "vllm/model_executor/layers/fla/ops/replay_gating.py"
CALLER = "vllm/model_executor/layers/mamba/gdn_linear_attn.py"
CONFIG = "vllm/config/vllm.py"
COUNT = "n_rows = tl.load(num_accepted_tokens + i_n).to(tl.int64) - 1"


def test_the_patched_tree_replays_as_stock_computes(patched_0201, probe_python, cache):
    result = probe_tree(Path(patched_0201.work_dir), probe_python, cache, "gdn_spec_replay")
    assert result.status == PRESENT, result.evidence
    assert result.details["float32"]["out"] == result.details["float32"]["state"] == 0.0
    assert result.details["bfloat16"]["written"] == 0


#: (what changes: file, the line's text, its replacement, where to look for it from; what the
#: probe's details then say: a key path and a test of its value)
MUTATIONS = {
    "a replay of one row too many": (
        (KERNEL, COUNT, COUNT.removesuffix(" - 1"), "def replay_verify_kernel"),
        (("float32", "out"), lambda diff: diff > 0),
    ),
    "a caller that keeps the stock kernel": (
        (CALLER, "and self.gdn_spec_replay:", "and False:", "# 2.1: Process the multi-query"),
        (("float32", "written"), lambda written: written == 3 * 2),
    ),
    "a config that takes prefix caching": (
        (CONFIG, "self._refuse_gdn_spec_replay_cache_mode()", "pass", "def __post_init__"),
        (("refusal", "prefix caching"), lambda said: said is None),
    ),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_mutated_tree_reads_absent(mutation, patched_0201, probe_python, cache, tmp_path):
    (path, old, new, anchor), (keys, expected) = MUTATIONS[mutation]
    root = mutated_tree(Path(patched_0201.work_dir), tmp_path, path, old, new, anchor)
    result = probe_tree(root, probe_python, cache, "gdn_spec_replay")
    assert result.status == ABSENT, result.evidence
    assert expected(result.details[keys[0]][keys[1]]), result.details
