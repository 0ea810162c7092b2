"""Fix 19: a hybrid target's Gated DeltaNet groups share one metadata build a step.

vLLM puts a hybrid model's GDN layers into several KV-cache groups of one spec (the seed's
48 into six groups of eight with patch 18; the trained pair's 18 into three) and builds
every group's metadata every step. The FlashAttention groups build once and hand the result
on (``update_block_table``); stock GDN builds again for each group. With speculative
decoding a GDN build is dozens of small tensor operations, the runner's largest CPU cost
in a DFlash step at one request.

The probe makes two of this release's GDN builders for one spec, from the real config of a
hybrid target with a DFlash drafter (prefix caching, so Mamba cache mode "align" and its
gather of each request's last blocks), under FULL_AND_PIECEWISE graphs. Three batches, one
per kind of step: requests verifying drafts (the full-graph buffers), drafts beside a
prefill (fresh tensors), and decodes without drafts (the other full-graph buffers). Each is
built by the first builder on its block table and handed to the second with another block
table. Present means the second builder takes it, and what it gets equals the second
builder's own build of that batch in every field, none of it in the first builder's buffers
(a full graph of the second group's layers reads only the second builder's). Absent: the
builder cannot take another group's metadata (each group is built in full), or what it takes
differs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import _harness
from .result import ABSENT, PRESENT, ProbeResult

NAME = "gdn_metadata_groups"
K = 3
BLOCK = 16
COLUMNS = 64
"""Block-table columns: max_model_len 1024 in blocks of 16."""


def _batch(query_lens: list[int], seq_lens: list[int], seed: int) -> Any:
    """Common metadata of requests with these query and sequence lengths, on a block table
    of distinct block ids drawn from ``seed`` (one table per group)."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
    generator = torch.Generator().manual_seed(seed)
    table = torch.randperm(4096, generator=generator)[: len(query_lens) * COLUMNS] + 1
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts.clone(),
        seq_lens=lens,
        num_reqs=len(query_lens),
        num_actual_tokens=int(starts[-1]),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=table.view(len(query_lens), COLUMNS).to(torch.int32),
        slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.int64),
        _num_computed_tokens_cpu=lens - torch.tensor(query_lens, dtype=torch.int32),
    )


#: Each kind of step: the requests' query lengths, sequence lengths and drafts (-1: none).
BATCHES = {
    "verifying drafts": ([K + 1] * 4, [40, 57, 33, 80], [K] * 4),
    "drafts beside a prefill": ([K + 1, K + 1, 20], [61, 35, 20], [K, K, -1]),
    "decodes without drafts": ([1] * 4, [18, 49, 100, 7], [-1] * 4),
}


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _tensors(metadata: Any) -> dict[str, Any]:
    import torch

    return {
        f.name: getattr(metadata, f.name)
        for f in dataclasses.fields(metadata)
        if isinstance(getattr(metadata, f.name), torch.Tensor)
    }


def _inside(tensor: Any, buffers: list[Any]) -> bool:
    start = tensor.data_ptr()
    return tensor.numel() > 0 and any(
        b.data_ptr() <= start < b.data_ptr() + b.numel() * b.element_size() for b in buffers
    )


def _compare(first: Any, second: Any, kind: str) -> list[str]:
    """How the second builder's metadata for the ``kind`` batch, handed from the first,
    differs from its own build of it (empty: not at all)."""
    import torch

    query_lens, seq_lens, drafts = BATCHES[kind]
    accepted = torch.tensor([1 + i % (K + 1) for i in range(len(query_lens))], dtype=torch.int32)
    extra = {
        "num_accepted_tokens": accepted,
        "num_decode_draft_tokens_cpu": torch.tensor(drafts, dtype=torch.int32),
    }
    built = first.build(0, _batch(query_lens, seq_lens, 1), **extra)
    own = _batch(query_lens, seq_lens, 2)
    handed = second.update_block_table(built, own.block_table_tensor, own.slot_mapping)
    handed_values = {k: v.clone() for k, v in _tensors(handed).items()}
    first_buffers = [v for v in vars(first).values() if isinstance(v, torch.Tensor)]
    foreign = sorted(k for k, v in _tensors(handed).items() if _inside(v, first_buffers))
    fresh = second.build(0, own, **extra)
    problems = [f"{name} reads the first group's buffer" for name in foreign]
    for field in dataclasses.fields(fresh):
        mine = getattr(fresh, field.name)
        theirs = handed_values.get(field.name, getattr(handed, field.name))
        if not _same(theirs, mine):
            problems.append(f"{field.name} differs from the group's own build")
    return problems


def run() -> ProbeResult:
    _harness.install_cpu_platform()
    import torch
    from vllm.config import CUDAGraphMode, set_current_vllm_config
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import MambaSpec

    pair = _harness.hybrid_pair()
    config = _harness.vllm_config(
        pair,
        num_speculative_tokens=K,
        block_size=BLOCK,
        prefix_caching=True,
        mamba_cache_mode="align",
    )
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    config.compilation_config.max_cudagraph_capture_size = 32
    spec = MambaSpec(
        block_size=BLOCK,
        shapes=((2, 4), (2, 4, 4)),
        dtypes=(torch.bfloat16, torch.bfloat16),
        mamba_type="gdn_attention",
        mamba_cache_mode="align",
        num_speculative_blocks=K,
    )
    with set_current_vllm_config(config):
        first, second = (
            GDNAttentionMetadataBuilder(spec, [name], config, torch.device("cpu"))
            for name in ("gdn-a", "gdn-b")
        )
        if not second.supports_update_block_table:
            return ProbeResult(
                probe=NAME,
                status=ABSENT,
                evidence="the GDN metadata builder cannot take another group's metadata: "
                "every GDN KV-cache group is built in full every step",
                details={"supports_update_block_table": False},
            )
        problems = {kind: _compare(first, second, kind) for kind in BATCHES}
    wrong = {kind: found for kind, found in problems.items() if found}
    if wrong:
        evidence = f"a GDN group takes another group's metadata, but wrongly: {wrong}"
    else:
        evidence = (
            "a GDN group takes another group's metadata with its own state indices, equal to "
            f"its own build and in its own buffers, for each step: {', '.join(BATCHES)}"
        )
    return ProbeResult(
        probe=NAME,
        status=ABSENT if wrong else PRESENT,
        evidence=evidence,
        details={"supports_update_block_table": True, "differences": problems},
    )
