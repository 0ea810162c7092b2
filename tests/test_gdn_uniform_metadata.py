"""Patch 25's slicing build gives the general build's metadata, field for field (slow).

In the probe interpreter with the patched 0.20.1 tree first on the path, two of the tree's
own GDN builders (one spec, FULL_AND_PIECEWISE, prefix caching: Mamba cache mode "align")
build drawn steps of speculative decodes alone: every request verifying K drafts, every one
decoding one token with none, or each its own number of drafts, with empty padding rows
and padded tokens as the runner pads a step to a captured size, at K = 1, 3, 7 and 15. Each
step is built with the patch's slicing path, and again with the general build (the slicing
path turned off on that builder); the second builder takes each through
``update_block_table``. Every field must be equal, and the slicing path must have been taken.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from .helpers import run_on_tree

pytestmark = pytest.mark.slow

DRAWS = 40
SCRIPT = textwrap.dedent(
    """
    import dataclasses, json, random, sys
    from tooling.probes import _harness
    _harness.install_cpu_platform()
    import torch
    from vllm.config import set_current_vllm_config
    from tooling.probes import gdn_metadata_groups as groups
    from tooling.probes._cuda_on_cpu import cuda_on_cpu

    draws = json.loads(sys.argv[1])

    def values(metadata):
        return {
            f.name: getattr(metadata, f.name).clone()
            if isinstance(getattr(metadata, f.name), torch.Tensor)
            else getattr(metadata, f.name)
            for f in dataclasses.fields(metadata)
        }

    def both(first, second, batch, extra):
        built = first.build(0, batch, **extra)
        mine = values(built)
        return mine, values(second.update_block_table(
            built, batch.block_table_tensor, batch.slot_mapping
        ))

    out = {"steps": 0, "sliced": 0, "fit": 0, "differences": []}
    for k in (1, 3, 7, 15):
        groups.K = k
        setup = groups.Setup(f"K={k}", k, {}, "")
        with cuda_on_cpu() as device:
            config, _, first, second = groups._builders(setup, device)
            with set_current_vllm_config(config):
                rng = random.Random(k)
                for draw in range(draws):
                    n, pad = rng.randint(1, 6), rng.randint(0, 3)
                    kind = rng.choice(["verify", "no drafts", "each its own"])
                    drafts = [
                        k if kind == "verify" else 0 if kind == "no drafts"
                        else rng.randint(0, k)
                        for _ in range(n)
                    ]
                    query_lens = [d + 1 for d in drafts] + [0] * pad
                    seq_lens = [rng.randint(q, 500) for q in query_lens[:n]] + [0] * pad
                    batch = groups._batch(query_lens, seq_lens, draw)
                    if kind != "each its own" and rng.random() < 0.5:
                        batch.num_actual_tokens = (drafts[0] + 1) * (n + pad)
                    rows = drafts + [-1] * pad
                    extra = {
                        "num_accepted_tokens": torch.tensor(
                            [rng.randint(1, k + 1) for _ in rows], dtype=torch.int32
                        ),
                        "num_decode_draft_tokens_cpu": torch.tensor(rows, dtype=torch.int32),
                    }
                    fast, fast_other = both(first, second, batch, extra)
                    out["sliced"] += bool(fast["spec_rows_leading"])
                    out["fit"] += sum(query_lens) <= first.decode_cudagraph_max_bs
                    for builder in (first, second):
                        builder._leading_spec_rows = lambda *args: None
                    general, general_other = both(first, second, batch, extra)
                    for builder in (first, second):
                        del builder._leading_spec_rows
                    for name, value in general.items():
                        if name == "spec_rows_leading":
                            continue
                        for which, a, b in (
                            ("built", fast[name], value),
                            ("handed on", fast_other[name], general_other[name]),
                        ):
                            if not groups._same(a, b):
                                out["differences"].append(f"K={k} draw {draw} {which}: {name}")
                    out["steps"] += 1
    json.dump(out, open(sys.argv[2], "w"))
    """
)


def test_the_slicing_build_equals_the_general_build(probe_python, patched_0201, tmp_path):
    assert patched_0201.ok
    out = run_on_tree(
        probe_python, Path(patched_0201.work_dir), tmp_path, SCRIPT, json.dumps(DRAWS), timeout=600
    )
    assert out["steps"] == 4 * DRAWS
    assert out["differences"] == []
    # A step slices exactly where it fits the builder's graph buffers.
    assert 0 < out["sliced"] == out["fit"] < out["steps"]
