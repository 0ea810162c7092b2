"""Fix 19: a hybrid target's Gated DeltaNet groups share one metadata build a step.

vLLM puts a hybrid model's GDN layers into several KV-cache groups of one spec (the seed's
48 into six groups of eight with patch 18; the trained pair's 18 into three) and builds
every group's metadata every step. The FlashAttention groups build once and hand the result
on (``update_block_table``); stock GDN builds again for each group. With speculative
decoding a GDN build is dozens of small tensor operations, the runner's largest CPU cost
in a DFlash step at one request.

The probe makes two of this release's GDN builders for one spec, on a CUDA device as
served (``_cuda_on_cpu``: 0.34.0 shares GDN metadata only there), from the real config of
a hybrid target served two ways: with a DFlash drafter, and plain. Prefix caching is on, so
Mamba cache mode "align" and its gather of each request's last blocks; graphs are
FULL_AND_PIECEWISE. Each kind of step (verifying drafts, drafts beside a prefill, decodes;
plain decodes, decodes beside a prefill) is built the way the release's runner builds its
groups: 0.20.1's V1 runner builds the first group and hands it on with
``update_block_table``, and captures each group's full graph on its own build; 0.34.0's V2
runner does both through its own ``build_attn_metadata``, sharing at capture too.

Present means the second group's metadata equals its own build of the step in every field,
and for the step of the captured shape every tensor its full graph read at capture from a
builder's buffer is read from that same buffer again. Absent: the builder cannot take
another group's metadata (each group is built in full), or what it takes differs, or a
captured graph would read a stale buffer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import _harness
from ._cuda_on_cpu import cuda_on_cpu
from ._v2_runner import V2Groups
from .result import ABSENT, PRESENT, ProbeResult

NAME = "gdn_metadata_groups"
K = 3
BLOCK = 16
COLUMNS = 64
"""Block-table columns: max_model_len 1024 in blocks of 16."""


def _batch(query_lens: list[int], seq_lens: list[int], seed: int) -> Any:
    """Common metadata of requests with these query and sequence lengths, on a block table
    of distinct block ids drawn from ``seed`` (one table per group). Each field is given
    where this release's metadata has it."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
    generator = torch.Generator().manual_seed(seed)
    table = torch.randperm(4096, generator=generator)[: len(query_lens) * COLUMNS] + 1
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    queries = torch.tensor(query_lens, dtype=torch.int32)
    optional = {
        "_num_computed_tokens_cpu": lens - queries,
        "seq_lens_cpu_upper_bound": lens.clone(),
        # A request whose whole sequence is this step's query has no state yet.
        "is_prefilling": lens == queries,
    }
    fields = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
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
        **{name: value for name, value in optional.items() if name in fields},
    )


def _align_indices(builders: tuple[Any, ...], batches: tuple[Any, ...]) -> None:
    """Give each builder its group's aligned state indices for the step, where the
    release's runner computes them for the builders ahead of any build (0.34.0's V2
    runner, in Mamba cache mode "align"; the builder opts in with the attribute)."""
    from vllm.v1.attention.backends.utils import mamba_get_block_table_tensor

    for builder, batch in zip(builders, batches, strict=True):
        if hasattr(builder, "mamba_aligned_state_indices"):
            builder.mamba_aligned_state_indices = mamba_get_block_table_tensor(
                batch.block_table_tensor, batch.seq_lens, builder.kv_cache_spec, "align"
            )


@dataclasses.dataclass(frozen=True)
class Setup:
    """One way of serving the hybrid target: its drafts a step (0: no drafter), each kind
    of step as the requests' query lengths, sequence lengths and drafts (0: none), and the
    kind whose shape its full graphs are captured for at start-up."""

    name: str
    k: int
    batches: dict[str, tuple[list[int], list[int], list[int]]]
    captured: str


SETUPS = (
    Setup(
        f"DFlash at K={K}",
        K,
        {
            "verifying drafts": ([K + 1] * 4, [40, 57, 33, 80], [K] * 4),
            "drafts beside a prefill": ([K + 1, K + 1, 20], [61, 35, 20], [K, K, 0]),
            "decodes without drafts": ([1] * 4, [18, 49, 100, 7], [0] * 4),
        },
        "verifying drafts",
    ),
    Setup(
        "plain",
        0,
        {
            "decodes": ([1] * 4, [18, 49, 100, 7], [0] * 4),
            "decodes beside a prefill": ([1, 1, 20], [61, 35, 20], [0, 0, 0]),
        },
        "decodes",
    ),
)
NAMES = ("gdn-a", "gdn-b")


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


def _extra(runner: Any, setup: Setup, kind: str) -> dict[str, Any]:
    """What the runner hands a GDN build besides the batch: nothing without a drafter."""
    import torch

    if not setup.k:
        return {}
    query_lens, seq_lens, drafts = setup.batches[kind]
    accepted = torch.tensor(
        [1 + i % (setup.k + 1) for i in range(len(query_lens))], dtype=torch.int32
    )
    return {
        "num_accepted_tokens": accepted,
        "num_decode_draft_tokens_cpu": torch.tensor(
            runner.decode_drafts(query_lens, seq_lens, drafts), dtype=torch.int32
        ),
    }


class _V1Runner:
    """0.20.1's V1 runner (``_build_attention_metadata``): at start-up each group captures
    its full graph on its own build; each step the first group builds and a group of the
    same spec takes it through ``update_block_table``."""

    def __init__(self, first: Any, second: Any, spec: Any) -> None:
        self.first, self.second = first, second

    def capture(self, theirs: Any, own: Any) -> Any:
        return self.second.build_for_cudagraph_capture(own)

    @staticmethod
    def decode_drafts(query_lens: list[int], seq_lens: list[int], drafts: list[int]) -> list[int]:
        """Each request's decode drafts as the runner hands them to GDN (-1: not a spec
        decode): a request that drafted nothing is -1."""
        return [d if d > 0 else -1 for d in drafts]

    def step(self, theirs: Any, own: Any, extra: dict[str, Any]) -> Any:
        built = self.first.build(0, theirs, **extra)
        return self.second.update_block_table(built, own.block_table_tensor, own.slot_mapping)


class _V2Runner:
    """0.34.0's V2 runner: capture and every step go through its own
    ``build_attn_metadata`` over both groups, which decides what is shared."""

    def __init__(self, first: Any, second: Any, spec: Any) -> None:
        from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend

        self.groups = V2Groups.of(GDNAttentionBackend, spec, NAMES, (first, second))

    def _build(self, theirs: Any, own: Any, extra: dict[str, Any], capture: bool) -> Any:
        from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridAttnMetadata

        hybrid = MambaHybridAttnMetadata(theirs.is_prefilling & (not capture), **extra)
        metadata = self.groups.build((theirs, own), capture=capture, model_specific=hybrid)
        return metadata[NAMES[1]]

    @staticmethod
    def decode_drafts(query_lens: list[int], seq_lens: list[int], drafts: list[int]) -> list[int]:
        """Each request's decode drafts as the runner hands them to GDN: every decode its
        count, 0 included; a prefill -1."""
        return [-1 if q == s else d for q, s, d in zip(query_lens, seq_lens, drafts, strict=True)]

    def capture(self, theirs: Any, own: Any) -> Any:
        # Capture builds its own drafts and accepted counts, as the runner's dummy run does.
        extra = {"num_accepted_tokens": None, "num_decode_draft_tokens_cpu": None}
        return self._build(theirs, own, extra, capture=True)

    def step(self, theirs: Any, own: Any, extra: dict[str, Any]) -> Any:
        return self._build(theirs, own, extra, capture=False)


def _buffers(builders: tuple[Any, ...]) -> list[Any]:
    import torch

    return [v for b in builders for v in vars(b).values() if isinstance(v, torch.Tensor)]


def _compare(first: Any, second: Any, runner: Any, setup: Setup, kind: str) -> list[str]:
    """How the second group's metadata for the ``kind`` batch, as the runner hands it on,
    differs from the group's own build of it (empty: not at all). For the captured step,
    each tensor its full graph read at capture from a builder's buffer must be read from
    that same buffer again."""
    query_lens, seq_lens, _ = setup.batches[kind]
    batches = _batch(query_lens, seq_lens, 1), _batch(query_lens, seq_lens, 2)
    problems = []
    if kind == setup.captured:
        _align_indices((first, second), batches)
        captured = runner.capture(*batches)
        graph_reads = {
            name: tensor.data_ptr()
            for name, tensor in _tensors(captured).items()
            if _inside(tensor, _buffers((first, second)))
        }
    _align_indices((first, second), batches)
    handed = runner.step(*batches, _extra(runner, setup, kind))
    handed_values = {k: v.clone() for k, v in _tensors(handed).items()}
    if kind == setup.captured:
        moved = sorted(
            name
            for name, pointer in graph_reads.items()
            if name not in handed_values or _tensors(handed)[name].data_ptr() != pointer
        )
        problems += [f"{name} is not where the group's captured graph reads it" for name in moved]
    fresh = second.build(0, batches[1], **_extra(runner, setup, kind))
    for field in dataclasses.fields(fresh):
        mine = getattr(fresh, field.name)
        theirs = handed_values.get(field.name, getattr(handed, field.name))
        if not _same(theirs, mine):
            problems.append(f"{field.name} differs from the group's own build")
    return problems


def _builders(setup: Setup, device: Any) -> tuple[Any, Any, Any, Any]:
    """The served config of ``setup`` (prefix caching, so Mamba cache mode "align" and its
    gather of each request's last blocks; FULL_AND_PIECEWISE graphs), one GDN spec and
    two of the release's builders for it."""
    import torch
    from vllm.config import CUDAGraphMode, set_current_vllm_config
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import MambaSpec

    config = _harness.vllm_config(
        _harness.hybrid_pair(),
        method="dflash" if setup.k else None,
        num_speculative_tokens=setup.k or 1,
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
        num_speculative_blocks=setup.k,
    )
    with set_current_vllm_config(config):
        first, second = (
            GDNAttentionMetadataBuilder(spec, [name], config, device) for name in NAMES
        )
    return config, spec, first, second


def _problems(setup: Setup) -> dict[str, list[str]] | None:
    """Each kind of step's differences under ``setup``; None where the builder cannot
    take another group's metadata at all."""
    from vllm.config import set_current_vllm_config

    # Builders on a CUDA device, as served: a release may share metadata only there.
    with cuda_on_cpu() as device:
        config, spec, first, second = _builders(setup, device)
        if not second.supports_update_block_table:
            return None
        runner = (_V1Runner if _harness.serves_v1(config) else _V2Runner)(first, second, spec)
        with set_current_vllm_config(config):
            return {kind: _compare(first, second, runner, setup, kind) for kind in setup.batches}


def run() -> ProbeResult:
    _harness.install_cpu_platform()
    problems = {setup.name: _problems(setup) for setup in SETUPS}
    if any(found is None for found in problems.values()):
        return ProbeResult(
            probe=NAME,
            status=ABSENT,
            evidence="the GDN metadata builder cannot take another group's metadata: "
            "every GDN KV-cache group is built in full every step",
            details={"supports_update_block_table": False},
        )
    wrong = {
        f"{name}, {kind}": found
        for name, kinds in problems.items()
        for kind, found in (kinds or {}).items()
        if found
    }
    if wrong:
        evidence = f"a GDN group takes another group's metadata, but wrongly: {wrong}"
    else:
        evidence = (
            "a GDN group takes another group's metadata with its own state indices, equal to "
            "its own build, and its captured graph reads this step's values, for each step: "
            + "; ".join(f"{s.name}: {', '.join(s.batches)}" for s in SETUPS)
        )
    return ProbeResult(
        probe=NAME,
        status=ABSENT if wrong else PRESENT,
        evidence=evidence,
        details={"supports_update_block_table": True, "differences": problems},
    )
