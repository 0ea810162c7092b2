"""In-process vLLM run with the DFlash drafter: every proposal, each drafter layer's window.

Runs on the GPU host as ``python -m tooling.smoke.serving.engine_run IN.json OUT.json`` with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the model runner lives in this process. Before the
engine exists, ``DFlashProposer.propose`` is wrapped to record, per call and request row, the
bonus token (the target's sampled next token), its position and the drafted tokens, and the
context features the target handed the drafter (the concatenated aux hidden states, per
position). After start-up it reads the window each drafter attention layer computes with
(``impl.sliding_window``) and the aux layers the runner derives from the drafter config. The
fidelity prompts run one at a time; then (``concurrent``) a batch of shared-prefix prompts of
several lengths runs at once, with the lookahead-slot audit (``slotaudit``) on every first
drafter pass. That run then serves the boundary prompt alone
(``slotaudit.boundary_prompt_length`` tokens, the drafter group's manager block size read from
the scheduler): its first pass ends on a block's first slot, the one slot a K-slot reservation
leaves out, which a hybrid target's large blocks seldom meet otherwise (no fidelity prompt:
nothing of it is recorded but the audit).

Rows are matched to prompts by the request's prompt token ids (every prompt is distinct), so
proposals of a concurrent batch are attributed correctly.

The audit's ownership snapshot: ``Scheduler.schedule`` is wrapped to record, on the
SchedulerOutput it returns, the manager blocks every live request owns after that step's
allocation; ``GPUModelRunner.propose_draft_token_ids`` receives that same object (in-process
engine) and the first pass is audited against it. With async scheduling the scheduler may
already have planned the next step, but blocks are freed only when a step's output is
processed, so the snapshot taken for step N is what step N's writes must respect.

Attribute paths checked against vLLM 0.20.1:
``LLM.llm_engine.model_executor`` (v1/engine/llm_engine.py, in-process only)
``LLM.llm_engine.engine_core.engine_core.scheduler`` (core_client.py: InprocClient, core.py)
``.driver_worker.worker.model_runner`` (uniproc_executor.py, worker_base.py) ``.drafter``
(gpu_model_runner.py: DFlashProposer) ``.model`` (DFlashQwen3ForCausalLM),
``DFlashProposer.positions`` (dflash.py: query positions, bonus first),
``DFlashProposer.set_inputs_first_pass`` (returns the query CommonAttentionMetadata whose
``slot_mapping`` the kernel wrote), ``runner.input_batch.req_ids``,
``runner.requests[id].prompt_token_ids``, ``Scheduler.kv_cache_manager.coordinator
.single_type_managers[g].req_to_blocks``, ``runner.input_batch.block_table.block_tables``.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .child import exit_now, serve
from .slotaudit import SlotAudit, audit_first_pass, boundary_prompt_length

logger = logging.getLogger(__name__)

#: Token ids of the seeded random prompts: in any tokenizer's vocabulary.
RANDOM_IDS = (10, 1000)


@dataclass
class EngineRunInput:
    """What the orchestrator asks of the in-process run (serialised as JSON)."""

    target: str
    drafter: str
    texts: list[str]
    lengths: list[int]
    max_tokens: int = 40
    num_speculative_tokens: int = 3
    speculative_options: dict[str, Any] = field(default_factory=dict)
    """More of the drafter's ``speculative_config`` (``tooling smoke --speculative-option``)."""
    attention_backend: str = "FLASH_ATTN"
    max_model_len: int = 1024
    gpu_memory_utilization: float = 0.3
    seed: int = 0
    enforce_eager: bool = False
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    max_num_seqs: int = 8
    block_size: int | None = 16
    kv_cache_memory_bytes: int | None = None
    language_model_only: bool = False
    gdn_prefill_backend: str | None = None
    features_path: str | None = None
    """Where to save the recorded context features (torch.save); None: not recorded."""
    concurrent: list[dict[str, Any]] | None = None
    """Prompts of the concurrent batch: ``{"prompt": [ids], "max_tokens": n}``."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EngineRunInput:
        return cls(**data)


@dataclass
class ProposalRecorder:
    """Collects each proposal vLLM's DFlash drafter makes, tagged with its prompt's index."""

    prompt_index: dict[tuple[int, ...], int] = field(default_factory=dict)
    """Prompt token ids -> index in the run's prompt list."""
    proposals: list[dict[str, Any]] = field(default_factory=list)
    unmatched_rows: int = 0
    group: str = "sequential"
    features: dict[int, dict[int, Any]] | None = None
    """Prompt index -> position -> context feature (CPU float32); None: not recorded."""
    runner: Any = None
    """The model runner (the proposer keeps no reference to it); set once the engine is up,
    None again while the boundary prompt runs."""

    def prompt_of(self, runner: Any, request_id: str) -> int:
        state = runner.requests.get(request_id)
        ids = tuple(getattr(state, "prompt_token_ids", None) or ())
        return self.prompt_index.get(ids, -1)

    def record(self, proposer: Any, bound: inspect.BoundArguments, drafts: Any) -> None:
        runner = self.runner
        if runner is None:
            return  # start-up (no request yet) or the boundary prompt (no fidelity prompt)
        next_token_ids = bound.arguments["next_token_ids"]
        k = int(drafts.shape[-1])
        rows = drafts.reshape(-1, k).tolist()
        bonuses = next_token_ids.reshape(-1).tolist()
        # The DFlash kernel writes each request's query positions (bonus first,
        # then the masks) to proposer.positions, 1 + k per request.
        positions = proposer.positions[: len(rows) * (1 + k)].tolist()
        request_ids = list(runner.input_batch.req_ids[: len(rows)])
        for row, (bonus, drafted) in enumerate(zip(bonuses, rows, strict=False)):
            prompt = self.prompt_of(runner, request_ids[row]) if row < len(request_ids) else -1
            if prompt < 0:
                # A padded row or a dummy run: no request to compare with.
                self.unmatched_rows += 1
                continue
            self.proposals.append(
                {
                    "prompt": prompt,
                    "group": self.group,
                    "position": int(positions[row * (1 + k)]),
                    "bonus": int(bonus),
                    "drafts": [int(t) for t in drafted],
                }
            )

    def record_features(self, proposer: Any, bound: inspect.BoundArguments) -> None:
        """Keep the context features of every token, by prompt and position.

        A position seen again (a rejected draft recomputed) keeps the later
        value: the token that stays in the sequence is verified last.
        """
        runner = self.runner
        if self.features is None or runner is None:
            return
        hidden = bound.arguments["target_hidden_states"]
        positions = bound.arguments["target_positions"]
        if positions.dim() == 2:  # M-RoPE: three equal rows for text
            positions = positions[0]
        cad = bound.arguments["common_attn_metadata"]
        starts = cad.query_start_loc_cpu.tolist()
        hidden = hidden.float().cpu()
        positions = positions.cpu().tolist()
        request_ids = list(runner.input_batch.req_ids[: len(starts) - 1])
        for row, request_id in enumerate(request_ids):
            prompt = self.prompt_of(runner, request_id)
            if prompt < 0:
                continue
            store = self.features.setdefault(prompt, {})
            for i in range(starts[row], starts[row + 1]):
                store[int(positions[i])] = hidden[i]


def install_recorder(proposer_cls: Any, recorder: ProposalRecorder) -> None:
    """Wrap ``proposer_cls.propose`` so every call is recorded; behaviour is unchanged."""
    original = proposer_cls.propose
    signature = inspect.signature(original)
    if "next_token_ids" not in signature.parameters:
        raise RuntimeError(f"{proposer_cls.__name__}.propose has no next_token_ids parameter")

    def propose(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        # Before the call: the drafter may reuse the buffers these views read.
        recorder.record_features(self, bound)
        drafts = original(self, *args, **kwargs)
        recorder.record(self, bound, drafts)
        return drafts

    propose.__wrapped__ = original  # type: ignore[attr-defined]
    proposer_cls.propose = propose


def attention_windows(model: Any) -> list[dict[str, Any]]:
    """Name and FlashAttention window of every attention layer in ``model``, in module order.

    A vLLM ``Attention`` keeps the window its kernel uses on ``impl.sliding_window``:
    (w-1, 0) for a window of w tokens, (-1, -1) for none.
    """
    found = []
    for name, module in model.named_modules():
        impl = getattr(module, "impl", None)
        if impl is None or not hasattr(impl, "sliding_window"):
            continue
        window = impl.sliding_window
        found.append(
            {
                "layer": name,
                "window": list(window) if window is not None else None,
                "impl": type(impl).__name__,
            }
        )
    return found


def build_prompts(target: str, texts: list[str], lengths: list[int], seed: int) -> list[list[int]]:
    """Token-id prompts of the given lengths: the target's tokenizer over ``texts``.

    Falls back to seeded random ids when the target has no loadable tokenizer.
    """
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target)
    except Exception:
        tokenizer = None
    prompts = []
    for i, length in enumerate(lengths):
        if tokenizer is not None:
            text = texts[i % len(texts)]
            ids = tokenizer.encode(text, add_special_tokens=False)
            while len(ids) < length:
                ids = ids + ids
            prompts.append([int(t) for t in ids[:length]])
        else:
            rng = random.Random(seed + i)
            prompts.append([rng.randrange(*RANDOM_IDS) for _ in range(length)])
    return prompts


def _metrics_summary(metrics: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for metric in metrics:
        if not metric.name.startswith("vllm:spec_decode"):
            continue
        value = getattr(metric, "value", None)
        if value is None:
            value = getattr(metric, "values", None)
        out[metric.name] = value
    return out


class SlotAuditor:
    """Feeds ``slotaudit.audit_first_pass`` from the live scheduler and model runner."""

    def __init__(self) -> None:
        self.audit = SlotAudit()
        self.pending: list[tuple[Any, dict[str, Any]]] = []
        """(SchedulerOutput, ownership snapshot) of the last few steps."""
        self.current: dict[str, Any] | None = None
        self.runner: Any = None

    @staticmethod
    def snapshot(scheduler: Any) -> dict[str, Any]:
        managers = scheduler.kv_cache_manager.coordinator.single_type_managers
        groups = scheduler.kv_cache_config.kv_cache_groups
        return {
            "owners": [
                {req: [b.block_id for b in blocks] for req, blocks in m.req_to_blocks.items()}
                for m in managers
            ],
            "block_sizes": [g.kv_cache_spec.block_size for g in groups],
        }

    def install(self, scheduler_cls: Any, runner_cls: Any, proposer_cls: Any) -> None:
        auditor = self
        schedule = scheduler_cls.schedule
        propose_draft = runner_cls.propose_draft_token_ids
        first_pass = proposer_cls.set_inputs_first_pass
        first_signature = inspect.signature(first_pass)

        def scheduled(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            output = schedule(scheduler, *args, **kwargs)
            auditor.pending = [*auditor.pending[-7:], (output, auditor.snapshot(scheduler))]
            return output

        def proposing(runner: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            auditor.current = next(
                (snap for out, snap in auditor.pending if out is scheduler_output), None
            )
            try:
                return propose_draft(runner, scheduler_output, *args, **kwargs)
            finally:
                auditor.current = None

        def first(proposer: Any, *args: Any, **kwargs: Any) -> Any:
            result = first_pass(proposer, *args, **kwargs)
            if auditor.runner is None:
                pass  # start-up: no request yet
            elif auditor.current is not None:
                bound = first_signature.bind(proposer, *args, **kwargs)
                auditor.audit_pass(proposer, bound.arguments["cad"], result)
            else:
                auditor.audit.unaudited_passes += 1
            return result

        scheduler_cls.schedule = scheduled
        runner_cls.propose_draft_token_ids = proposing
        proposer_cls.set_inputs_first_pass = first

    def audit_pass(self, proposer: Any, cad: Any, result: Any) -> None:
        assert self.current is not None
        num_query, _, query_cad = result
        runner = self.runner
        batch = int(cad.batch_size())
        tables = runner.input_batch.block_table.block_tables
        ptr = cad.block_table_tensor.data_ptr()
        # The group whose block table the kernel read; the proposer's own as fallback.
        gid = next(
            (g for g, t in enumerate(tables) if t.block_table.gpu.data_ptr() == ptr),
            proposer.kv_cache_gid,
        )
        self.audit.add(
            audit_first_pass(
                query_cad.slot_mapping[:num_query].tolist(),
                proposer.positions[:num_query].tolist(),
                list(runner.input_batch.req_ids[:batch]),
                self.current["owners"][gid],
                self.current["block_sizes"][gid],
            )
        )


def serve_boundary_prompt(
    llm: Any, request: EngineRunInput, prompts: list[list[int]], gid: int
) -> dict[str, Any]:
    """Serve the boundary prompt alone; what the result records of it. ``gid``: the
    drafter's KV-cache group, whose manager block size the audit uses."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    block_size = int(SlotAuditor.snapshot(scheduler)["block_sizes"][gid])
    length = boundary_prompt_length(
        block_size, request.num_speculative_tokens, request.max_tokens, request.max_model_len
    )
    record: dict[str, Any] = {"length": length, "block_size": block_size}
    if length is None:
        record["not_served"] = (
            f"no prompt of m*{block_size} - {request.num_speculative_tokens} tokens leaves "
            f"{request.max_tokens} new tokens within max_model_len {request.max_model_len}"
        )
        return record
    taken = {tuple(p) for p in prompts}
    for salt in itertools.count():
        rng = random.Random(f"boundary prompt {request.seed} {salt}")
        prompt = [rng.randrange(*RANDOM_IDS) for _ in range(length)]
        if tuple(prompt) not in taken:
            break
    params = SamplingParams(
        temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True, detokenize=False
    )
    llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return record


def _save_features(path: str, features: dict[int, dict[int, Any]]) -> None:
    import torch

    packed = {}
    for prompt, by_position in features.items():
        positions = sorted(by_position)
        packed[prompt] = (positions, torch.stack([by_position[p] for p in positions]))
    torch.save(packed, path)


def run(request: EngineRunInput) -> dict[str, Any]:
    """Start the engine, generate each prompt greedily, return everything recorded."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    prompts = build_prompts(request.target, request.texts, request.lengths, request.seed)
    sequential = len(prompts)
    logger.debug("in-process engine run of %s: %d prompts", request.target, sequential)
    concurrent = request.concurrent or []
    prompts += [[int(t) for t in item["prompt"]] for item in concurrent]
    recorder = ProposalRecorder(
        prompt_index={tuple(p): i for i, p in enumerate(prompts)},
        features={} if request.features_path else None,
    )
    if len(recorder.prompt_index) != len(prompts):
        raise ValueError("the engine run's prompts are not distinct")
    install_recorder(DFlashProposer, recorder)
    auditor = SlotAuditor()
    auditor.install(Scheduler, GPUModelRunner, DFlashProposer)
    optional: dict[str, Any] = {}
    if request.block_size is not None:
        optional["block_size"] = request.block_size
    if request.kv_cache_memory_bytes is not None:
        optional["kv_cache_memory_bytes"] = request.kv_cache_memory_bytes
    if request.language_model_only:
        optional["language_model_only"] = True
    if request.gdn_prefill_backend is not None:
        optional["gdn_prefill_backend"] = request.gdn_prefill_backend
    started = time.monotonic()
    llm = LLM(
        model=request.target,
        skip_tokenizer_init=True,
        enforce_eager=request.enforce_eager,
        max_model_len=request.max_model_len,
        gpu_memory_utilization=request.gpu_memory_utilization,
        seed=request.seed,
        disable_log_stats=False,
        attention_backend=request.attention_backend,
        kv_cache_dtype=request.kv_cache_dtype,
        tensor_parallel_size=request.tensor_parallel_size,
        max_num_seqs=request.max_num_seqs,
        # Prefix caching as served: the concurrent batch shares prefixes, and the
        # audit must see cached blocks shared between live requests.
        enable_prefix_caching=True,
        speculative_config={
            "method": "dflash",
            "model": request.drafter,
            "num_speculative_tokens": request.num_speculative_tokens,
            **request.speculative_options,
        },
        **optional,
    )
    startup_s = time.monotonic() - started
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    recorder.runner = auditor.runner = runner
    drafter = runner.drafter
    windows = attention_windows(drafter.model)
    aux_layers = runner._get_eagle3_aux_layers_from_config()
    outputs: list[list[int]] = []
    for prompt in prompts[:sequential]:
        params = SamplingParams(
            temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True, detokenize=False
        )
        result = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        outputs.append([int(t) for t in result[0].outputs[0].token_ids])
    concurrent_s = None
    if concurrent:
        recorder.group = "concurrent"
        params_list = [
            SamplingParams(
                temperature=0.0,
                max_tokens=int(item["max_tokens"]),
                ignore_eos=True,
                detokenize=False,
            )
            for item in concurrent
        ]
        begin = time.monotonic()
        results = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts[sequential:]],
            params_list,
            use_tqdm=False,
        )
        concurrent_s = time.monotonic() - begin
        outputs += [[int(t) for t in r.outputs[0].token_ids] for r in results]
    spec_decode_metrics = _metrics_summary(llm.get_metrics())
    boundary = None
    if concurrent:
        recorder.runner = None
        boundary = serve_boundary_prompt(llm, request, prompts, drafter.kv_cache_gid)
    if recorder.features is not None and request.features_path:
        _save_features(request.features_path, recorder.features)
    return {
        "vllm_version": getattr(vllm, "__version__", None),
        "vllm_location": str(Path(vllm.__file__).parent),
        "startup_s": startup_s,
        "concurrent_s": concurrent_s,
        "drafter_class": type(drafter).__name__,
        "drafter_model_class": type(drafter.model).__name__,
        "windows": windows,
        "aux_layers": list(aux_layers) if aux_layers else None,
        "prompts": prompts,
        "outputs": outputs,
        "sequential_prompts": sequential,
        "proposals": recorder.proposals,
        "unmatched_rows": recorder.unmatched_rows,
        "features_path": request.features_path if recorder.features is not None else None,
        "slot_audit": auditor.audit.to_json(),
        "boundary_prompt": boundary,
        "num_speculative_tokens": request.num_speculative_tokens,
        "spec_decode_metrics": spec_decode_metrics,
    }


def main(argv: list[str]) -> int:
    """Run the request in ``argv[0]`` and write the result to ``argv[1]``; 0 when it ran."""
    return serve(
        Path(argv[0]), Path(argv[1]), lambda request: run(EngineRunInput.from_json(request))
    )


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
