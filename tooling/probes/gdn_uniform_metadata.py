"""Fix 25: a step of speculative decodes alone builds its Gated DeltaNet metadata by slicing.

In a drafting engine's steady step every request is a decode that verifies its drafts (or,
with none, decodes one token on the speculative path: fix 24). vLLM's GDN builder still runs
its mixed-batch code for it: CPU masks, reductions read back with ``.item()``, an upload of
the mask, a device ``query_lens`` nobody reads, ``arange`` and ``empty`` on the device,
mask-indexed gathers of the block table and the accepted counts, then copies of all of it
into the graph buffers. On the GPU host each such operation is a launch, and the GDN build
was a DFlash step's largest metadata cost, with drafting off too.

The probe builds the metadata of such steps with this release's GDN builder, on a CUDA
device as served (``_cuda_on_cpu``), from the served config of a hybrid target with a DFlash
drafter at K = 3, prefix caching on (Mamba cache mode "align", each request's aligned state
indices handed to the builder where the release's runner hands them: 0.34.0's V2 runner) and
FULL_AND_PIECEWISE graphs:
four requests verifying 3 drafts, and four decoding one token with no drafts, each padded by
two empty rows as the runner pads a step to a captured size. For each it counts the tensor
operations the build dispatches (``TorchDispatchMode``), and checks every field against what
the GDN layer is to read: the block table's last 1 + K blocks of each request, the
requests' query starts, their accepted counts, the speculative tokens in order, the padding's
null state and count of 1. A step of drafts beside a prefill is checked the same way, so a
fast path cannot take it. The verify step runs twice in a row (a build may leave the padding
as its last step of that layout wrote it), then two requests verify drafts in as many rows,
whose padding must cover the rows the four left.

Present: each uniform step's metadata is right and costs at most ``MAX_OPS`` operations,
which is what slicing the block table, the starts and the counts into the graph buffers
takes. Absent: right, but built by the mixed-batch code (over ``MAX_OPS``). Unknown: any
metadata that is wrong, since that is another defect than this fix's.
"""

from __future__ import annotations

from typing import Any

from . import _harness
from ._cuda_on_cpu import cuda_on_cpu
from .gdn_metadata_groups import BLOCK, Setup, _align_indices, _batch, _builders
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

NAME = "gdn_uniform_metadata"
K = 3
PADDING = 2
MAX_OPS = 20
"""Operations other than views a uniform step's build may dispatch: the block table's gather
of each request's last blocks and the graph buffers' copies and fills, with a little room;
the mixed-batch code dispatches several times as many."""
STEPS: dict[str, tuple[list[int], list[int], list[int]]] = {
    "verifying drafts": ([K + 1] * 4, [40, 57, 33, 80], [K] * 4),
    # The same layout again, where a build may leave the padding as its last step wrote it.
    "verifying drafts again": ([K + 1] * 4, [41, 58, 34, 81], [K] * 4),
    # Fewer requests in as many rows: their padding must cover the rows the four left.
    "two verifying drafts": ([K + 1] * 2, [42, 59], [K] * 2),
    "decodes without drafts": ([1] * 4, [18, 49, 100, 7], [0] * 4),
    "drafts beside a prefill": ([K + 1, K + 1, 20], [61, 35, 20], [K, K, -1]),
}
UNIFORM = ("verifying drafts", "decodes without drafts")
#: Every step of speculative decodes alone, each padded to ``ROWS`` rows.
PADDED = (*UNIFORM, "verifying drafts again", "two verifying drafts")
ROWS = 4 + PADDING


def _counted(build: Any) -> tuple[Any, int]:
    """``build()`` and the number of tensor operations it dispatched, views left out."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            # A view (a slice, a detach) launches nothing on the GPU.
            _Count.ops += not func.is_view
            return func(*args, **(kwargs or {}))

    with _Count():
        built = build()
    return built, _Count.ops


def _padded(query_lens: list[int], seq_lens: list[int], drafts: list[int], uniform: bool) -> Any:
    """The runner's view of a step: a uniform step's requests and empty rows to ``ROWS``,
    and its tokens padded to as many as those rows would have."""
    pad = ROWS - len(query_lens) if uniform else 0
    batch = _batch(query_lens + [0] * pad, seq_lens + [0] * pad, 1)
    if uniform:
        batch.num_actual_tokens = query_lens[0] * (len(query_lens) + pad)
    return batch, drafts + [-1] * pad


def _wrong(built: Any, batch: Any, drafts: list[int], accepted: Any, pad: int) -> list[str]:
    """What in ``built`` differs from what the GDN layer is to read for ``batch``: each
    speculative request's state slots, mask, counts and tokens, and the padding's null state
    and count of 1 where the step is uniform."""
    import torch
    from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

    spec = [i for i, d in enumerate(drafts) if d >= 0]
    starts = batch.query_start_loc_cpu
    last = torch.clamp((batch.seq_lens - 1) // BLOCK, min=0)
    blocks = [batch.block_table_tensor[r, last[r] : last[r] + K + 1] for r in spec]
    nulls = [torch.full((K + 1,), NULL_BLOCK_ID, dtype=torch.int32)] * pad
    tokens = [torch.arange(int(starts[r]), int(starts[r + 1]), dtype=torch.int32) for r in spec]
    wants: dict[str, Any] = {
        "num_spec_decodes": len(spec),
        "num_spec_decode_tokens": sum(t.shape[0] for t in tokens),
        "spec_state_indices_tensor": torch.stack(blocks + nulls).to(torch.int32),
        "spec_sequence_masks": torch.tensor([d >= 0 for d in drafts]),
        "num_accepted_tokens": torch.cat([accepted[spec], torch.ones(pad, dtype=accepted.dtype)]),
        "spec_token_indx": torch.cat(tokens),
    }
    problems = []
    for name, want in wants.items():
        got = getattr(built, name)
        if isinstance(want, torch.Tensor):
            got = None if got is None else got[: want.shape[0]].cpu()
            same = got is not None and got.shape == want.shape and bool(torch.equal(got, want))
        else:
            same = got == want
        if not same:
            problems.append(f"{name} {got} (wanted {want})")
    return problems


def _step(builder: Any, kind: str) -> tuple[int, list[str]] | None:
    """The operations the ``kind`` step's build dispatched and what in it is wrong; None for
    the step without drafts where the builder sends it down the non-speculative path (a
    release without fix 24: that step is not this fix's)."""
    import torch

    uniform = kind in PADDED
    batch, drafts = _padded(*STEPS[kind], uniform=uniform)
    accepted = torch.tensor([1 + i % (K + 1) for i in range(len(drafts))], dtype=torch.int32)
    extra = {
        "num_accepted_tokens": accepted,
        "num_decode_draft_tokens_cpu": torch.tensor(drafts, dtype=torch.int32),
    }
    _align_indices((builder,), (batch,))
    built, ops = _counted(lambda: builder.build(0, batch, **extra))
    if built.num_spec_decodes == 0 and kind == "decodes without drafts":
        return None
    return ops, _wrong(built, batch, drafts, accepted, ROWS - len(STEPS[kind][0]) if uniform else 0)


def run() -> ProbeResult:
    _harness.install_cpu_platform()
    from vllm.config import set_current_vllm_config

    setup = Setup(f"DFlash at K={K}", K, {}, "")
    with cuda_on_cpu() as device:
        config, _, builder, _ = _builders(setup, device)
        with set_current_vllm_config(config):
            steps = {kind: _step(builder, kind) for kind in STEPS}
    seen = {kind: step for kind, step in steps.items() if step is not None}
    wrong = {kind: problems for kind, (_, problems) in seen.items() if problems}
    counts = "; ".join(f"{kind}: {ops} operations" for kind, (ops, _) in seen.items())
    if wrong:
        return ProbeResult(
            probe=NAME,
            status=UNKNOWN,
            evidence=f"the GDN metadata is wrong, another defect than this fix's: {wrong}",
            details={"operations": {k: ops for k, (ops, _) in seen.items()}},
        )
    fast = all(seen[kind][0] <= MAX_OPS for kind in UNIFORM if kind in seen)
    if len(seen) < len(steps):
        counts += "; decodes without drafts: the non-speculative path (fix 24 absent), not counted"
    return ProbeResult(
        probe=NAME,
        status=PRESENT if fast else ABSENT,
        evidence=(
            f"DFlash K={K}, FULL_AND_PIECEWISE, prefix caching: every step's metadata is what "
            f"the GDN layer reads; {counts} (a uniform step "
            + ("slices" if fast else "runs the mixed-batch code")
            + f", at most {MAX_OPS} wanted)"
        ),
        details={"operations": {k: ops for k, (ops, _) in seen.items()}, "max_ops": MAX_OPS},
    )
