"""Fix 32 (opt-in): a Gated DeltaNet verify step writes one recurrent state a request.

vLLM 0.20.1's speculative GDN kernel writes a full recurrent state after every one of a
verify step's K + 1 tokens, into the request's K + 1 state slots, so that the next step can
start from the slot of the last token it accepted. With ``"gdn_spec_replay": true`` in
``--speculative-config`` the patched layer keeps the state after the step's first token in
slot 0 and the other tokens' inputs as rows in the request's last slot, and the next step
replays the accepted rows first: one state read and one state write a request a layer.

The probe asks the tree's ``SpeculativeConfig`` for the option. Where it is, it builds a
hybrid target's config with the option, without and with prefix caching (Mamba cache mode
"align", whose copies read slots 1 .. K as states: refused, naming the flag that turns it
off). Then it runs the tree's own ``GatedDeltaNetAttention._forward_core`` (the speculative
branch, on a stand-in layer of small dims and a hand-built metadata of verify rows) for a few
steps of three requests at K = ``K``, each step accepting a drawn count, once with the option
off (the stock kernel) and once with it on, in Triton's interpreter on the CPU, with a float32
and a bf16 state. Slots nothing has written hold NaN, so a read of one shows. After each step
the replaying run's accepted state is read with the tree's ``fold``.

Present: the option is there, refused with prefix caching alone, and with it on every step's
outputs and accepted states equal the stock kernel's (exactly with a float32 state, within
bf16 rounding with a bf16 state), and slots 1 .. K - 1 are never written. Absent: no option,
prefix caching not refused, or a run that differs or writes those slots. Unknown: the layer
could not be run.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

from . import _harness
from ._interpreted import NotInterpreted, run_interpreted
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

NAME = "gdn_spec_replay"
K = 3
# Value heads of two 32-wide blocks, as the kernels tile them: the blocks share each gate row.
H, HV, DK, DV, WIDTH = 2, 4, 16, 64, 4
#: Tokens each of the three requests verifies, step by step (1: a decode with no drafts).
STEPS = [[K + 1, K + 1, 1], [K + 1, 2, K + 1], [1, K + 1, K + 1], [K + 1, K + 1, K + 1]]
#: With a bf16 state the replay rounds the state after a step's first token, stock after its
#: last accepted one: a few bf16 steps of the largest value, never a wrong row's difference.
BF16_TOLERANCE = 2e-2


class _Layer:
    """The attributes ``_forward_core`` reads of a ``GatedDeltaNetAttention`` layer."""

    prefix = "model.layers.0.linear_attn"
    enable_packed_recurrent_decode = False
    activation = "silu"
    tp_size = 1
    num_k_heads, num_v_heads, head_k_dim, head_v_dim = H, HV, DK, DV
    key_dim, value_dim = H * DK, HV * DV
    num_spec = K


def _layer(cls: Any, replay: bool, kv_cache: Any, weights: dict[str, Any]) -> Any:
    layer = _Layer()
    layer.rearrange_mixed_qkv = cls.rearrange_mixed_qkv.__get__(layer)  # type: ignore[attr-defined]
    layer.gdn_spec_replay = replay  # type: ignore[attr-defined]
    layer.kv_cache = kv_cache  # type: ignore[attr-defined]
    layer.conv1d = SimpleNamespace(weight=weights["conv"], bias=None)  # type: ignore[attr-defined]
    layer.A_log, layer.dt_bias = weights["A_log"], weights["dt_bias"]  # type: ignore[attr-defined]
    return layer


def _slots(requests: int) -> Any:
    """Each request's K + 1 state slots, then a spare one each for reading its accepted
    state; slot 0 is the null block."""
    import torch

    table = torch.arange(1, requests * (K + 1) + 1, dtype=torch.int32).view(requests, K + 1)
    spare = torch.arange(requests, dtype=torch.int32) + requests * (K + 1) + 1
    return table, spare


def _cache(state_dtype: Any, requests: int, start: Any, conv_start: Any) -> tuple[Any, Any]:
    """A conv state and a recurrent state laid out as the served page is (the recurrent
    part a strided view after other data), NaN in every slot but each request's first."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    table, _ = _slots(requests)
    slots = requests * (K + 2) + 1
    page = torch.full((slots, 8 + HV * DV * DK), float("nan"), dtype=state_dtype)
    ssm = page[:, 8:].view(slots, HV, DV, DK)
    ssm[table[:, 0].long()] = start.to(state_dtype)
    conv = conv_start.clone()
    if not is_conv_state_dim_first():
        conv = conv.transpose(-1, -2).contiguous()
    return conv, ssm


def _metadata(meta_cls: Any, t: list[int], table: Any, counts: Any) -> Any:
    import torch

    starts = torch.zeros(len(t) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(t, dtype=torch.int32), 0)
    n = int(starts[-1])
    return meta_cls(
        num_prefills=0,
        num_prefill_tokens=0,
        num_decodes=0,
        num_decode_tokens=0,
        num_spec_decodes=len(t),
        num_spec_decode_tokens=n,
        num_actual_tokens=n,
        spec_query_start_loc=starts,
        spec_state_indices_tensor=table,
        spec_sequence_masks=torch.ones(len(t), dtype=torch.bool),
        spec_token_indx=torch.arange(n),
        num_accepted_tokens=counts.clone(),
    )


def _accepted(run: dict[str, Any], replay: bool, counts: Any, fold: Any) -> Any:
    import torch

    ssm, table, spare = run["ssm"], run["table"], run["spare"]
    if not replay:
        return torch.stack([ssm[table[i, c - 1]] for i, c in enumerate(counts.tolist())])
    fold(ssm, table[:, 0], spare, table[:, K], counts, run["in_dtype"], H, K)
    return ssm[spare.long()]


def _largest(diff: Any) -> float:
    """The largest difference, a NaN counted as infinite (``max`` would drop it)."""
    return float(diff.abs().nan_to_num(nan=float("inf")).max())


def _compare(state_dtype_name: str) -> dict[str, Any]:
    """Both runs of the probe's steps with one state dtype; the largest differences."""
    import torch
    from vllm.model_executor.layers.fla.ops.replay_gating import fold
    from vllm.model_executor.layers.mamba import gdn_linear_attn as gla
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    state_dtype = getattr(torch, state_dtype_name)
    gen = torch.Generator().manual_seed(0)
    requests = len(STEPS[0])
    conv_dim = 2 * H * DK + HV * DV
    weights = {
        "conv": torch.randn(conv_dim, 1, WIDTH, generator=gen).to(torch.bfloat16) * 0.5,
        "A_log": torch.randn(HV, generator=gen) * 0.5,
        "dt_bias": torch.randn(HV, generator=gen) * 0.5,
    }
    start = torch.randn(requests, HV, DV, DK, generator=gen) * 0.3
    conv_start = torch.randn(requests * (K + 2) + 1, conv_dim, WIDTH - 1 + K, generator=gen)
    table, spare = _slots(requests)
    runs = {}
    for replay in (False, True):
        conv, ssm = _cache(state_dtype, requests, start, conv_start.to(torch.bfloat16))
        runs[replay] = {"ssm": ssm, "table": table, "spare": spare, "in_dtype": torch.bfloat16}
        runs[replay]["layer"] = _layer(gla.GatedDeltaNetAttention, replay, (conv, ssm), weights)
    # The convolution is not this fix's and both runs share it; its kernel does not run in
    # this Triton's interpreter (a mask dtype it refuses).
    gla.causal_conv1d_update = lambda x, *args, **kwargs: x
    rng = random.Random(0)
    counts = torch.ones(requests, dtype=torch.int32)
    found: dict[str, Any] = {"out": 0.0, "state": 0.0, "finite": True}
    for t in STEPS:
        n = sum(t)
        mixed = torch.randn(n, conv_dim, generator=gen).to(torch.bfloat16)
        a = torch.randn(n, HV, generator=gen).to(torch.bfloat16)
        b = torch.randn(n, HV, generator=gen).to(torch.bfloat16)
        meta = _metadata(GDNAttentionMetadata, t, table, counts)
        context = SimpleNamespace(attn_metadata={_Layer.prefix: meta})
        gla.get_forward_context = lambda context=context: context
        outs = {}
        for replay, run in runs.items():
            out = torch.zeros(n, HV, DV, dtype=torch.bfloat16)
            gla.GatedDeltaNetAttention._forward_core(run["layer"], mixed, b, a, out)
            outs[replay] = out.float()
        counts = torch.tensor([rng.randint(1, x) for x in t], dtype=torch.int32)
        states = {r: _accepted(run, r, counts, fold).float() for r, run in runs.items()}
        found["finite"] &= bool(
            torch.isfinite(outs[True]).all() and torch.isfinite(states[True]).all()
        )
        found["out"] = max(found["out"], _largest(outs[True] - outs[False]))
        found["state"] = max(found["state"], _largest(states[True] - states[False]))
    unused = runs[True]["ssm"][table[:, 1:K].reshape(-1).long()]
    found["written"] = int((~torch.isnan(unused.float())).flatten(1).any(1).sum())
    found["counts"] = counts.tolist()
    return found


def compared() -> dict[str, Any]:
    """Both state dtypes' comparison (run where Triton interprets)."""
    from vllm.config.speculative import SpeculativeConfig

    if "gdn_spec_replay" not in getattr(SpeculativeConfig, "__dataclass_fields__", {}):
        return {"option": False}
    return {"option": True} | {dtype: _compare(dtype) for dtype in ("float32", "bfloat16")}


def _same(found: dict[str, Any], dtype: str) -> bool:
    run = found[dtype]
    tolerance = 0.0 if dtype == "float32" else BF16_TOLERANCE
    return run["finite"] and run["written"] == 0 and max(run["out"], run["state"]) <= tolerance


def _align_refusal() -> dict[str, Any]:
    """Whether a hybrid target's config builds with the option, and what it says with prefix
    caching on (Mamba cache mode "align", whose copies read slots 1 .. K as states)."""
    _harness.install_cpu_platform()
    pair = _harness.hybrid_pair()
    spec = {"gdn_spec_replay": True}
    found: dict[str, Any] = {}
    for name, caching in (("no prefix caching", False), ("prefix caching", True)):
        try:
            _harness.vllm_config(pair, prefix_caching=caching, speculative_args=spec)
            found[name] = None
        except ValueError as e:
            # pydantic wraps the message in lines of its own.
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            found[name] = next((line for line in lines if "gdn_spec_replay" in line), lines[0])
    return found


def run() -> ProbeResult:
    from vllm.config.speculative import SpeculativeConfig

    if "gdn_spec_replay" not in getattr(SpeculativeConfig, "__dataclass_fields__", {}):
        return ProbeResult(
            probe=NAME,
            status=ABSENT,
            evidence="no gdn_spec_replay in SpeculativeConfig: a GDN verify step writes a "
            "state after every token",
        )
    refusal = _align_refusal()
    if refusal["no prefix caching"] is not None or "--no-enable-prefix-caching" not in str(
        refusal["prefix caching"]
    ):
        return ProbeResult(
            probe=NAME,
            status=ABSENT,
            evidence=f"a hybrid target's config with gdn_spec_replay: {refusal} (prefix "
            "caching's align mode must be refused, naming --no-enable-prefix-caching)",
            details={"refusal": refusal},
        )
    try:
        found = dict(run_interpreted(NAME, "compared"))
    except NotInterpreted as e:
        return ProbeResult(
            probe=NAME, status=UNKNOWN, evidence=f"the GDN layer could not be run: {e}"
        )
    evidence = (
        "prefix caching refused with the option; "
        f"_forward_core's verify rows, K={K}, {len(STEPS)} steps of 3 requests: "
        + "; ".join(
            f"{dtype} state: outputs differ from stock's by {found[dtype]['out']:.3g}, accepted "
            f"states by {found[dtype]['state']:.3g}, slots 1..K-1 written for "
            f"{found[dtype]['written']} of {3 * (K - 1)}"
            + ("" if found[dtype]["finite"] else ", non-finite values")
            for dtype in ("float32", "bfloat16")
        )
    )
    same = all(_same(found, dtype) for dtype in ("float32", "bfloat16"))
    return ProbeResult(
        probe=NAME,
        status=PRESENT if same else ABSENT,
        evidence=evidence,
        details={"refusal": refusal} | {d: found[d] for d in ("float32", "bfloat16")},
    )
