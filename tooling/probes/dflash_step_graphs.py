"""Fix 40: a DFlash decode step replays as one CUDA graph (``dflash_step_graphs``).

At one request a DFlash step is host time: after its query pass replays a full graph (fix
22), the drafter still launches from Python, every step, the target's hidden states'
combination, the first pass's input kernel, the context K/V write, the query metadata's
tensor operations and the greedy sampling of the drafts. With the option, a decode step in
which every request verified K drafts, at a batch of a captured size, copies the runner's
inputs to buffers of its own and replays one graph of all of that.

The probe builds vLLM's V1 model runner on the CPU with a DFlash drafter at K = ``K``
(FULL_AND_PIECEWISE, as ``drafter_full_graphs`` does) twice: with the option and without.
The drafter's model is stood in for by one whose drafts follow its inputs (each draft is a
function of its query row's input id and position) and which records what it is asked to
combine, write and run, and inside which graph; CUDAGraphWrapper by a pass-through that says
which graph is running (a CPU captures none). The input kernel is vLLM's own, run by Triton's
interpreter in an interpreter of its own. Both drafters get the same steps on the same block
table: one request, three requests (each verified K drafts, some rejected), and two requests
of which one verified fewer (a step no step graph fits).

Present: with the option the steps that fit ran their combination, input kernel, context
write, forward and sampling inside one full graph, the other step outside it, every captured
key has a step graph whose warm-ups wrote no KV slot, and every draft, context row and query
row equals the drafter's without the option. Absent: the tree refuses the option, or a step
that fits ran any of it outside. Unknown: a draft or a row differs (a step graph that reads
stale inputs), or the steps could not be run.
"""

from __future__ import annotations

from typing import Any

from . import _harness
from ._interpreted import NotInterpreted, run_interpreted
from ._v1 import without_v1_runner
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult
from .spec_prefill_dispatch import _runner_and_scheduler, option_config

NAME = "dflash_step_graphs"
K = 15
ON = {"dflash_step_graphs": True}
BLOCK = 16
VOCAB = 97
#: (what, query tokens a request, sequence lengths, drafts rejected, next token ids)
STEPS = (
    ("one request", (K + 1,), (40,), (3,), (11,)),
    ("three requests", (K + 1,) * 3, (40, 70, 23), (0, 15, 7), (5, 6, 7)),
    ("two requests, one verified fewer drafts", (K + 1, 9), (60, 33), (2, 0), (8, 9)),
)
FITS = (True, True, False)
#: What a step that fits runs inside its graph.
PARTS = ("combine", "inputs", "context", "forward", "sample")


class _Calls:
    """What ran, in which graph: ``active`` holds a (graph, mode) per wrapper running."""

    def __init__(self) -> None:
        self.active: list[tuple[str, str]] = []
        self.seen: list[dict[str, Any]] = []

    def where(self) -> str:
        """ "step" inside a full graph of more than the model, "model" inside the model's
        own, else "host"."""
        full = [graph for graph, mode in self.active if mode == "FULL"]
        if "step" in full:
            return "step"
        return "model" if full else "host"

    def add(self, part: str, **data: Any) -> None:
        self.seen.append({"part": part, "where": self.where(), **data})


def _wrapper(calls: _Calls, model: Any) -> type:
    class PassThrough:
        """CUDAGraphWrapper on a CPU: runs what it wraps, saying which graph runs."""

        def __init__(self, runnable: Any, *args: Any, **kwargs: Any) -> None:
            self.runnable = runnable

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            from vllm.forward_context import get_forward_context

            graph = "model" if self.runnable is model else "step"
            calls.active.append((graph, get_forward_context().cudagraph_runtime_mode.name))
            try:
                return self.runnable(*args, **kwargs)
            finally:
                calls.active.pop()

    return PassThrough


def _stub_model(calls: _Calls, hidden: int) -> Any:
    import torch
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

    def ints(t: Any) -> list[int]:
        return [int(v) for v in t.tolist()]

    class Inner:
        use_aux_hidden_state = True

        class fc:  # the attribute the step inputs are sized from
            input_size = 3 * hidden

    class Stub(DFlashQwen3ForCausalLM):  # passes propose's isinstance check
        def __init__(self) -> None:
            torch.nn.Module.__init__(self)
            self.model = Inner()

        def combine_hidden_states(self, h: Any) -> Any:
            calls.add("combine", rows=int(h.shape[0]))
            return h[:, :hidden] + h[:, hidden : 2 * hidden] + h[:, 2 * hidden :]

        def precompute_and_store_context_kv(
            self, states: Any, positions: Any, slots: Any = None
        ) -> None:
            if slots is not None:
                sums = [round(float(v), 3) for v in states.float().sum(-1).tolist()]
                calls.add("context", positions=ints(positions), slots=ints(slots), sums=sums)

        def forward(self, input_ids: Any, positions: Any, inputs_embeds: Any = None) -> Any:
            from vllm.forward_context import get_forward_context

            mapping = get_forward_context().slot_mapping or {}
            slots = next(iter(mapping.values()), None)
            calls.add(
                "forward",
                ids=ints(input_ids),
                positions=ints(positions),
                slots=[] if slots is None else ints(slots),
            )
            out = torch.zeros(input_ids.shape[0], hidden)
            out[:, 0] = input_ids.float()
            out[:, 1] = positions.float()
            return out

        def compute_logits(self, h: Any) -> Any:
            calls.add("sample", rows=int(h.shape[0]))
            pick = (h[:, 0].long() * 7 + h[:, 1].long()) % VOCAB
            logits = torch.zeros(h.shape[0], VOCAB)
            logits[torch.arange(h.shape[0]), pick] = 1.0
            return logits

        def get_top_tokens(self, h: Any) -> Any:
            return self.compute_logits(h).argmax(dim=-1)

    return Stub()


class _Kernel:
    """vLLM's input kernel, interpreted, its launches recorded."""

    def __init__(self, calls: _Calls, kernel: Any) -> None:
        self.calls, self.kernel = calls, kernel

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            self.calls.add("inputs")
            return self.kernel[grid](*args, **kwargs)

        return launch


def _drafter(config: Any) -> tuple[Any, Any, _Calls, Any]:
    """(the drafter, its block table, its calls, its graph wrapper's class)."""
    import torch

    runner, _ = _runner_and_scheduler(config)
    drafter = runner.drafter
    hidden = config.speculative_config.draft_model_config.hf_config.hidden_size
    calls = _Calls()
    drafter.model = _stub_model(calls, hidden)
    drafter._draft_attn_layer_names = {"drafter.layers.0.attn"}
    drafter.draft_attn_groups = []
    drafter.block_size = BLOCK
    table = runner.input_batch.block_table[drafter.kv_cache_gid].get_device_tensor(
        runner.max_num_reqs
    )
    # Distinct blocks, none the first (a warm-up on this table would write real slots).
    ids = torch.randperm(table.numel(), generator=torch.Generator().manual_seed(5)) + 1
    table.copy_(ids.view_as(table).to(table.dtype))
    return drafter, table, calls, _wrapper(calls, drafter.model)


def _step_inputs(step: tuple[Any, ...], table: Any, hidden: int) -> dict[str, Any]:
    """propose's arguments for ``step``, as the runner's padded drafter batch gives them."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    _, lens, seq_lens, rejected, next_ids = step
    n = len(lens)
    starts = torch.zeros(n + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    positions, slots = [], []
    for r, (q, s) in enumerate(zip(lens, seq_lens, strict=True)):
        for p in range(s - q, s):
            positions.append(p)
            slots.append(int(table[r, p // BLOCK]) * BLOCK + p % BLOCK)
    tokens = len(positions)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    cad = CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts.clone(),
        seq_lens=seq,
        num_reqs=n,
        num_actual_tokens=tokens,
        max_query_len=max(lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=table[:n],
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq.clone(),
    )
    generator = torch.Generator().manual_seed(tokens)
    return dict(
        target_token_ids=torch.arange(tokens, dtype=torch.int32),
        target_positions=torch.tensor(positions, dtype=torch.int64),
        target_hidden_states=torch.randint(0, 9, (tokens, 3 * hidden), generator=generator)
        .float()
        .div(8),
        next_token_ids=torch.tensor(next_ids, dtype=torch.int32),
        token_indices_to_sample=None,
        common_attn_metadata=cad,
        sampling_metadata=None,
        num_rejected_tokens_gpu=torch.tensor(rejected, dtype=torch.int32),
    )


def _captured(config: Any, drafter: Any, table: Any, calls: _Calls) -> dict[str, Any]:
    """What the capture made: full keys, step graphs captured, KV slots its warm-ups wrote."""
    from vllm.config import CUDAGraphMode, set_current_vllm_config

    keys = drafter.cudagraph_dispatcher.cudagraph_keys.get(CUDAGraphMode.FULL, set())
    calls.seen.clear()
    with set_current_vllm_config(config):
        drafter.capture_full_graphs(table)
    step_graphs = sum(1 for c in calls.seen if c["part"] == "combine" and c["where"] == "step")
    written = sorted(
        {
            s
            for c in calls.seen
            if c["where"] == "host" and c["part"] in ("context", "forward")
            for s in c["slots"]
            if s >= 0
        }
    )
    return {"keys": len(keys), "step_graphs": step_graphs, "warm_up_slots": written[:8]}


def _steps(config: Any, drafter: Any, table: Any, calls: _Calls) -> list[dict[str, Any]]:
    """Each of STEPS through ``propose``: its drafts, and each part's graph and data."""
    import torch
    from vllm.config import set_current_vllm_config

    hidden = config.speculative_config.draft_model_config.hf_config.hidden_size
    done = []
    for step in STEPS:
        calls.seen.clear()
        # The worker runs its steps in inference mode, as the capture ran.
        with set_current_vllm_config(config), torch.inference_mode():
            drafts = drafter.propose(**_step_inputs(step, table, hidden))
        done.append(
            {
                "drafts": [[int(v) for v in row] for row in drafts.tolist()],
                "where": {
                    part: sorted({c["where"] for c in calls.seen if c["part"] == part})
                    for part in PARTS
                },
                "rows": [
                    {k: v for k, v in c.items() if k != "where"}
                    for c in calls.seen
                    if c["part"] in ("context", "forward")
                ],
            }
        )
    return done


def measure() -> dict[str, Any]:
    """Both drafters' steps, and the option's capture (run where Triton interprets)."""
    from vllm.v1.spec_decode import dflash

    pair = _harness.hybrid_pair()
    on = option_config(NAME, "with the option", pair, K, ON, ON)
    if isinstance(on, ProbeResult):
        return {"refused": on.evidence}
    off = _harness.vllm_config(pair, num_speculative_tokens=K, max_num_seqs=4)
    found: dict[str, Any] = {}
    for name, config in (("on", on), ("off", off)):
        drafter, table, calls, wrapper = _drafter(config)
        kernel = _Kernel(calls, dflash.copy_and_expand_dflash_inputs_kernel)
        with _harness.replaced(
            dflash, CUDAGraphWrapper=wrapper, copy_and_expand_dflash_inputs_kernel=kernel
        ):
            if name == "on":
                found["capture"] = _captured(config, drafter, table, calls)
            found[name] = _steps(config, drafter, table, calls)
    return found


def _ask() -> dict[str, Any] | ProbeResult:
    try:
        return dict(run_interpreted(NAME, "measure"))
    except NotInterpreted as e:
        return ProbeResult(
            probe=NAME, status=UNKNOWN, evidence=f"the drafters could not be asked: {e}"
        )


def run() -> ProbeResult:
    why = "the V2 runner's DFlash speculator prepares its step in its own graphs"
    if (unknown := without_v1_runner(NAME, why)) is not None:
        return unknown
    found = _ask()
    if isinstance(found, ProbeResult):
        return found
    if "refused" in found:
        return ProbeResult(probe=NAME, status=ABSENT, evidence=found["refused"])
    capture, on, off = found["capture"], found["on"], found["off"]
    differ = [
        what
        for (what, *_), a, b in zip(STEPS, on, off, strict=True)
        if a["drafts"] != b["drafts"] or a["rows"] != b["rows"]
    ]
    outside = [
        f"{what}: {part} on {', '.join(a['where'][part])}"
        for (what, *_), fits, a in zip(STEPS, FITS, on, strict=True)
        for part in PARTS
        if fits and a["where"][part] != ["step"]
    ]
    inside = [
        what
        for (what, *_), fits, a in zip(STEPS, FITS, on, strict=True)
        if not fits and any("step" in a["where"][part] for part in PARTS)
    ]
    evidence = (
        f"DFlash K={K}, FULL_AND_PIECEWISE, with dflash_step_graphs: "
        + "; ".join(
            f"{what}: " + ", ".join(f"{p} {'/'.join(a['where'][p])}" for p in PARTS)
            for (what, *_), a in zip(STEPS, on, strict=True)
        )
        + f"; step graphs captured for {capture['step_graphs']} of {capture['keys']} full "
        f"keys, warm-ups wrote slots {capture['warm_up_slots'] or 'none'}; drafts and rows "
        + ("equal the drafter's without it" if not differ else f"differ in {differ}")
    )
    details = {"capture": capture, "on": on, "off_drafts": [s["drafts"] for s in off]}
    if differ or capture["warm_up_slots"] or inside:
        return ProbeResult(probe=NAME, status=UNKNOWN, evidence=evidence, details=details)
    complete = not outside and capture["keys"] and capture["step_graphs"] == capture["keys"]
    status = PRESENT if complete else ABSENT
    return ProbeResult(probe=NAME, status=status, evidence=evidence, details=details)
