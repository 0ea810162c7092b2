"""Patch 32's probe on trees that carry the option but get the replay wrong (slow).

The patched 0.20.1 tree's ``vllm/`` is copied and one line changed: a verify step that replays
one row too many (the count used as the number of rows), a caller that keeps the stock
kernel with the option on, or a config that no longer refuses prefix caching's "align" mode.
The probe must read each absent, and say why.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tooling.probing import ABSENT, PRESENT, ProbeTarget, run_probes

pytestmark = pytest.mark.slow

KERNEL = "vllm/model_executor/layers/fla/ops/replay_gating.py"
CALLER = "vllm/model_executor/layers/mamba/gdn_linear_attn.py"
CONFIG = "vllm/config/vllm.py"
COUNT = "n_rows = tl.load(num_accepted_tokens + i_n).to(tl.int64) - 1"


def _mutated(work: Path, tmp_path: Path, path: str, old: str, new: str, first_after: str) -> Path:
    """A copy of ``work``'s ``vllm/`` with the first ``old`` after ``first_after`` in ``path``
    replaced by ``new``."""
    root = tmp_path / "tree"
    shutil.copytree(work / "vllm", root / "vllm")
    text = (root / path).read_text(encoding="utf-8")
    at = text.index(old, text.index(first_after))
    (root / path).write_text(text[:at] + new + text[at + len(old) :], encoding="utf-8")
    return root


def _probe(root: Path, probe_python: Path, cache) -> object:
    target = ProbeTarget(python=probe_python, root=root, pycache=cache.root / "pycache")
    return run_probes(target, ("gdn_spec_replay",))["gdn_spec_replay"]


def test_the_patched_tree_replays_as_stock_computes(patched_0201, probe_python, cache):
    result = _probe(Path(patched_0201.work_dir), probe_python, cache)
    assert result.status == PRESENT, result.evidence
    assert result.details["float32"]["out"] == result.details["float32"]["state"] == 0.0
    assert result.details["bfloat16"]["written"] == 0


def test_a_replay_of_one_row_too_many_reads_absent(patched_0201, probe_python, cache, tmp_path):
    root = _mutated(
        Path(patched_0201.work_dir),
        tmp_path,
        KERNEL,
        COUNT,
        COUNT.removesuffix(" - 1"),
        "def replay_verify_kernel",
    )
    result = _probe(root, probe_python, cache)
    assert result.status == ABSENT, result.evidence
    assert result.details["float32"]["out"] > 0


def test_a_caller_that_keeps_the_stock_kernel_reads_absent(
    patched_0201, probe_python, cache, tmp_path
):
    root = _mutated(
        Path(patched_0201.work_dir),
        tmp_path,
        CALLER,
        "and self.gdn_spec_replay:",
        "and False:",
        "# 2.1: Process the multi-query part",
    )
    result = _probe(root, probe_python, cache)
    assert result.status == ABSENT, result.evidence
    assert result.details["float32"]["written"] == 3 * 2


def test_a_config_that_takes_prefix_caching_reads_absent(
    patched_0201, probe_python, cache, tmp_path
):
    root = _mutated(
        Path(patched_0201.work_dir),
        tmp_path,
        CONFIG,
        "self._refuse_gdn_spec_replay_cache_mode()",
        "pass",
        "def __post_init__",
    )
    result = _probe(root, probe_python, cache)
    assert result.status == ABSENT, result.evidence
    assert result.details["refusal"]["prefix caching"] is None
