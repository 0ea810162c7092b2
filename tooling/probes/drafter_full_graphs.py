"""Fix 22: DFlash's drafter replays full CUDA graphs, by default (``dflash_full_cudagraphs``).

The drafter's first pass queries K + 1 tokens for every request (the bonus token and K
masks), a uniform batch. vLLM 0.20.1 gives a drafter PIECEWISE graphs only, so each of its
attention layers launches from Python between the pieces, every step: at one request that
launch is a large part of a DFlash step's CPU time (docs/notebook/2026-12-04-trained-speed.md).

The probe drives ``DFlashProposer.propose`` of the V1 runner (as ``spec_prefill_dispatch``
builds it: a hybrid target, a DFlash drafter at K = 15, FULL_AND_PIECEWISE) on the CPU.
The drafter's model is stood in for by one that records the forward context it runs in,
and the full-graph wrapper by a pass-through (a CPU captures no graph); the proposer, its
dispatcher, its buffers and its capture loop are vLLM's:

- with the speculative config as users leave it: one request, then one again, then three:
  the mode each first pass runs in, its batch descriptor, and the addresses of the query
  starts and sequence lengths the attention reads (a full graph reads the addresses it was
  captured with);
- the capture: every full key of the drafter's dispatcher captured under FULL after a
  warm-up, its query slots the padding slot (it writes no KV);
- control: ``"dflash_full_cudagraphs": false`` keeps PIECEWISE (a tree without the option
  is its own control).

Fixed: each pass replays FULL with a uniform descriptor of its requests, at the same
addresses every step, and every key is captured. Absent: PIECEWISE, or moving addresses.
"""

from __future__ import annotations

from typing import Any

from . import _harness
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult
from .spec_prefill_dispatch import _runner_and_scheduler, option_config

NAME = "drafter_full_graphs"
K = 15
OFF = {"dflash_full_cudagraphs": False}
PASSES = (1, 1, 3)


class _Recorder:
    """What ran through the drafter's forward: (mode, descriptor, tokens, query slots)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any, int, list[int]]] = []

    def record(self, input_ids: Any) -> None:
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        slots = next(iter(context.slot_mapping.values()), None) if context.slot_mapping else None
        self.seen.append(
            (
                context.cudagraph_runtime_mode.name,
                context.batch_descriptor,
                int(input_ids.shape[0]),
                [] if slots is None else slots.tolist(),
            )
        )


def _stub_model(recorder: _Recorder, hidden: int) -> Any:
    import torch
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

    class Stub(DFlashQwen3ForCausalLM):  # passes propose's isinstance check
        def __init__(self) -> None:
            torch.nn.Module.__init__(self)

        def combine_hidden_states(self, h: Any) -> Any:
            return h[..., :hidden]

        def precompute_and_store_context_kv(self, *args: Any, **kwargs: Any) -> None:
            pass

        def forward(self, input_ids: Any, positions: Any, inputs_embeds: Any = None) -> Any:
            recorder.record(input_ids)
            return torch.zeros(input_ids.shape[0], hidden)

        def compute_logits(self, h: Any) -> Any:
            return torch.zeros(h.shape[0], 8)

    return Stub()


class _PassThrough:
    """Stands in for CUDAGraphWrapper on a CPU: runs what it wraps."""

    def __init__(self, runnable: Any, *args: Any, **kwargs: Any) -> None:
        self.runnable = runnable

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.runnable(*args, **kwargs)


class _Kernel:
    """The Triton input kernel, which a CPU cannot launch: the indices to sample."""

    def __getitem__(self, grid: Any) -> _Kernel:
        return self

    def __call__(self, **kwargs: Any) -> None:
        kwargs["out_token_indices_ptr"].zero_()


def _drafter(config: Any, recorder: _Recorder) -> Any:
    runner, _ = _runner_and_scheduler(config)
    drafter = runner.drafter
    hidden = config.speculative_config.draft_model_config.hf_config.hidden_size
    drafter.model = _stub_model(recorder, hidden)
    drafter._draft_attn_layer_names = {"drafter.layers.0.attn"}
    drafter.draft_attn_groups = []
    return drafter, hidden, drafter.cudagraph_dispatcher.cudagraph_mode


def _passes(config: Any, drafter: Any, hidden: int) -> list[tuple[int, int]]:
    """Each pass of PASSES through ``propose``; the attention's query-start and
    sequence-length addresses of each."""
    addresses: list[tuple[int, int]] = []
    build = drafter.build_per_group_and_layer_attn_metadata

    def recorded(cad: Any, draft_index: int = 0) -> Any:
        addresses.append((cad.query_start_loc.data_ptr(), cad.seq_lens.data_ptr()))
        return build(cad, draft_index)

    drafter.build_per_group_and_layer_attn_metadata = recorded
    try:
        _propose_each(config, drafter, hidden)
    finally:
        drafter.build_per_group_and_layer_attn_metadata = build
    return addresses


def _propose_each(config: Any, drafter: Any, hidden: int) -> None:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.spec_decode import dflash

    for requests in PASSES:
        tokens = requests * (K + 1)
        starts = torch.arange(requests + 1, dtype=torch.int32) * (K + 1)
        cad = CommonAttentionMetadata(
            query_start_loc=starts,
            query_start_loc_cpu=starts.clone(),
            seq_lens=torch.full((requests,), 100, dtype=torch.int32),
            num_reqs=requests,
            num_actual_tokens=tokens,
            max_query_len=K + 1,
            max_seq_len=100,
            block_table_tensor=torch.zeros((requests, 8), dtype=torch.int32),
            slot_mapping=torch.zeros(tokens, dtype=torch.int64),
        )
        with (
            set_current_vllm_config(config),
            _harness.replaced(dflash, copy_and_expand_dflash_inputs_kernel=_Kernel()),
        ):
            drafter.propose(
                target_token_ids=torch.zeros(tokens, dtype=torch.int32),
                target_positions=torch.arange(tokens),
                target_hidden_states=torch.zeros(tokens, 3 * hidden),
                next_token_ids=torch.zeros(requests, dtype=torch.int32),
                token_indices_to_sample=None,
                common_attn_metadata=cad,
                sampling_metadata=None,
                num_rejected_tokens_gpu=torch.zeros(requests, dtype=torch.int32),
            )


def _captured(config: Any, drafter: Any, recorder: _Recorder) -> tuple[int, int, bool]:
    """(full keys, keys captured under FULL after a warm-up with padding slots only, the
    capture ran at all)."""
    import torch
    from vllm.config import CUDAGraphMode, set_current_vllm_config

    capture = getattr(drafter, "capture_full_graphs", None)
    keys = drafter.cudagraph_dispatcher.cudagraph_keys.get(CUDAGraphMode.FULL, set())
    if capture is None:
        return len(keys), 0, False
    recorder.seen.clear()
    with set_current_vllm_config(config):
        capture(torch.zeros((256, 8), dtype=torch.int32))
    captured = set()
    for i, (mode, desc, tokens, slots) in enumerate(recorder.seen):
        warmed = i > 0 and recorder.seen[i - 1][:3] == ("NONE", desc, tokens)
        if mode == "FULL" and warmed and slots and set(slots) == {-1}:
            captured.add(desc)
    return len(keys), len(captured & set(keys)), True


def _said(mode: str, desc: Any) -> str:
    if desc is None:
        return mode
    return f"{mode} {desc.num_tokens} tokens, uniform={desc.uniform}, num_reqs={desc.num_reqs}"


def _control(pair: Any) -> tuple[set[str], str]:
    """The modes of the drafter's first passes with the option off, and how it was turned
    off: a tree that refuses the option has only its default."""
    config = option_config(NAME, "", pair, K, OFF, OFF)
    said = "dflash_full_cudagraphs false"
    if isinstance(config, ProbeResult):
        config = _harness.vllm_config(pair, num_speculative_tokens=K)
        said = "no such option, the default"
    recorder = _Recorder()
    drafter, hidden, _ = _drafter(config, recorder)
    _passes(config, drafter, hidden)
    return {m for m, _, _, _ in recorder.seen}, said


def run() -> ProbeResult:
    _harness.install_cpu_platform()
    pair = _harness.hybrid_pair()
    config = _harness.vllm_config(pair, num_speculative_tokens=K)
    from vllm.v1.spec_decode import dflash

    recorder = _Recorder()
    # A CPU captures no graph: whatever wraps the drafter's model runs it.
    with _harness.replaced(dflash, CUDAGraphWrapper=_PassThrough):
        drafter, hidden, mode = _drafter(config, recorder)
        addresses = _passes(config, drafter, hidden)
        passes = [(m, d) for m, d, _, _ in recorder.seen]
        keys, captured, ran = _captured(config, drafter, recorder)
        control_modes, control_said = _control(pair)

    full = all(
        m == "FULL" and d is not None and d.uniform and d.num_reqs == n
        for (m, d), n in zip(passes, PASSES, strict=True)
    )
    stable = len(set(addresses)) == 1
    evidence = (
        f"hybrid target, K = {K}, FULL_AND_PIECEWISE, defaults: the drafter's dispatcher in "
        f"{mode}: "
        + "; ".join(
            f"{n} request(s): {_said(m, d)}" for (m, d), n in zip(passes, PASSES, strict=True)
        )
        + f"; attention metadata at {len(set(addresses))} address(es) over {len(addresses)} "
        f"passes; capture: {captured} of {keys} full keys"
        + ("" if ran else " (no capture here)")
        + f"; {control_said}: {', '.join(sorted(control_modes))}"
    )
    if control_modes != {"PIECEWISE"}:
        status = UNKNOWN
        evidence = "with the option off the drafter is not PIECEWISE: " + evidence
    elif full and stable and keys and captured == keys:
        status = PRESENT
    else:
        status = ABSENT
    return ProbeResult(
        probe=NAME,
        status=status,
        evidence=evidence,
        details={"passes": [m for m, _ in passes], "keys": keys, "captured": captured},
    )
