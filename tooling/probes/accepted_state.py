"""Fix 24: on a hybrid target a decode with no drafts reads the state its last step accepted.

A hybrid (Gated DeltaNet) target keeps 1 + K recurrent-state slots a request. A verify step
writes the state after each of its tokens to slots 0..K, and the next step starts from the
slot of the last token it accepted (``num_accepted_tokens - 1``), on the GDN builder's
speculative path. Stock 0.20.1 sends a step in which no decode has drafts down the
non-speculative path, which starts from slot 0: after a step that accepted n > 1 tokens that
slot holds the state after the first of them only, and the request goes on from a state that
misses n - 1 tokens, with no error. Such steps come with a budget's range of 0 (fix 23),
with drafts trimmed to none, and with a request the scheduler passed over and brought back,
whose accepted count stock also reset to 1 while it was out of the batch.

The probe drives the V1 model runner (``CPUModelRunner``) for a hybrid target with a DFlash
drafter at K = 3 through its own ``execute_model``, stopping at the model's forward, where
the GDN layer reads its metadata from the forward context: ``_update_states``,
``_prepare_inputs`` (which fills each row's decode drafts) and ``_build_attention_metadata``
(which hands the GDN builder the accepted counts) all run as served. vLLM's real Scheduler
schedules each step. Four requests prefill 20-token prompts, then verify 3 drafts each; the
step's output (the rejection sampler's tokens, -1 past the last accepted) goes to the
runner's own ``_update_states_after_model_execute`` and to the scheduler, accepting
``ACCEPTED``. No drafts are proposed after it, and the next step's token budget is lowered
to 3, so the scheduler passes over the last request (``PASSED_OVER``) while the other three
decode a token each without drafts. The step after brings it back. Then, after a verify step
in which ``PREEMPTED`` accepts ``ACCEPTED[PREEMPTED]`` tokens, the scheduler's own
``_preempt_request`` preempts it, and a lowered budget chunks its recompute: a
first chunk of ``FIRST_CHUNK`` tokens, past its prompt, and a later one of the tokens left
(several), from computed tokens past its prompt, with no drafts, beside the others' one-token
decodes.

Stood in for: the model (its forward raises with the metadata), the runner's KV-cache setup
(one GDN group of 1 + K state blocks a request, Mamba cache mode "none", its metadata builder
made as ``initialize_kv_cache`` makes it and the input batch re-made for it by the runner's
``may_reinitialize_input_batch``: no layers or cache tensors, which the metadata does not
read) and the slot-mapping kernel (recorded: the probe's vLLM has no compiled ops, and the
GDN build reads no slot mapping).

Which slot a row starts from is read off the GDN metadata: the state index the kernel loads
(``spec_state_indices[row, num_accepted - 1]`` on the speculative path, the
non-speculative state index otherwise) found among the request's own state blocks.

Fixed: each of the three decodes without drafts starts from the slot its verify step
accepted into, and the passed-over request, back, keeps its count and starts from its slot
too; the preempted request's count starts again at 1 when it is resumed (its states went
with its blocks); and the recompute's later chunk takes the non-speculative (prefill) path,
which a row of several tokens needs: on the speculative path it would write states past its
1 + K slots.
And the runner's own dummy batch (``_dummy_run``, as a graph capture's warm-up runs it), on a
fresh runner and after those steps, takes the non-speculative path or reads accepted counts of
at least 1: its buffers hold zeros or a real step's rows, and a row read as a decode with 0
accepted starts from the slot before the request's first.
Synchronous scheduling only: the runner's asynchronous path reads the previous step's sampled
tokens and counts through ``sample_tokens``'s GPU hand-over, which a run without the model
does not make. Unknown where the V2 runner serves (0.34.0 has no other; from 0.29.0 the
config may choose it), which keeps accepted counts in its own request state, or where the
steps do not run as written.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from . import _harness
from ._v1 import CannotStep, NotServedByV1, without_v1_runner
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult
from .spec_prefill_dispatch import _request

NAME = "accepted_state"
K = 3
PROMPT = 20
#: Tokens each request's verify step accepts (the bonus token included), by request.
ACCEPTED = {"r0": 2, "r1": 4, "r2": 1, "r3": 3}
#: The request the scheduler passes over in the step without drafts: the last it runs.
PASSED_OVER = "r3"
#: The request preempted and recomputed in two chunks, the first of ``FIRST_CHUNK`` tokens:
#: past its prompt, so the second starts from computed tokens past it too.
PREEMPTED = "r1"
FIRST_CHUNK = PROMPT + 2
#: The GDN layer whose metadata the forward would read.
LAYER = "model.layers.0.linear_attn"
#: Why a tree served by the V2 runner reads unknown.
V2 = (
    "the V2 runner keeps each request's accepted count in its own request state, which this "
    "probe does not drive"
)


class _Forward(Exception):
    """Raised by the model's forward in place of running it: the GDN layer's metadata."""

    def __init__(self, metadata: Any) -> None:
        super().__init__("forward")
        self.metadata = metadata


@dataclass
class Read:
    """What one step's GDN metadata makes each row start from."""

    speculative: int
    """Rows on the speculative path (``num_spec_decodes``)."""
    slots: dict[str, int] = field(default_factory=dict)
    """Each request's starting state slot among its 1 + K state blocks."""
    counts: dict[str, int] = field(default_factory=dict)
    """Each row's accepted count as the runner's input batch holds it."""


@dataclass
class Dummy:
    """The GDN path of the runner's own dummy batch (warm-up and graph capture)."""

    path: str
    counts: list[int] = field(default_factory=list)
    """The accepted counts its rows read, on the speculative path: each must be at least 1,
    as a count of 0 starts from the slot before the request's first (the first full graph
    capture's illegal memory access on one H100)."""

    @property
    def safe(self) -> bool:
        return self.path == "non-speculative" or min(self.counts, default=1) >= 1


@dataclass
class Recompute:
    """``PREEMPTED``'s recompute after its preemption, and the GDN path of its later chunk."""

    chunks: list[int]
    """The tokens scheduled for it in the two steps."""
    computed: int
    """Its computed tokens, as the runner's input batch holds them, at the later chunk."""
    resumed_count: int = 0
    """Its accepted count as the input batch holds it at its first chunk: its states went
    with its blocks, so 1 (the first slot), not the count its last step before accepted."""
    paths: dict[str, str] = field(default_factory=dict)
    """Each row's GDN path in the later chunk's step."""


class _Served:
    """A hybrid target's runner and vLLM's scheduler over one GDN KV-cache group."""

    def __init__(self) -> None:
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import AttentionGroup

        self.config = _harness.vllm_config(_harness.hybrid_pair(), num_speculative_tokens=K)
        if not _harness.serves_v1(self.config):
            raise NotServedByV1("the config chooses the V2 model runner")
        cache = self.config.cache_config
        # The spec the GDN layer gives: one block holds a request's whole state (the
        # config's mamba block size), 1 + K blocks a request for the drafts' states.
        spec = MambaSpec(
            block_size=cache.mamba_block_size,
            shapes=((1,),),
            dtypes=(torch.float32,),
            mamba_type="gdn_attention",
            mamba_cache_mode=cache.mamba_cache_mode,
            num_speculative_blocks=K,
        )
        kv_cache = KVCacheConfig(
            num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec([LAYER], spec)]
        )
        cache.num_gpu_blocks = 64
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=kv_cache,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=spec.block_size,
            log_stats=False,
        )
        self.runner = runner = _harness.v1_runner(self.config)
        with set_current_vllm_config(self.config):
            runner.kv_cache_config = kv_cache
            group = AttentionGroup(GDNAttentionBackend, [LAYER], spec, 0)
            group.create_metadata_builders(self.config, runner.device, spec.block_size)
            runner.attn_groups = [[group]]
            runner.may_reinitialize_input_batch(kv_cache, [spec.block_size])
            runner.calculate_reorder_batch_threshold()

        def forward(**kwargs: Any) -> Any:
            from vllm.forward_context import get_forward_context

            raise _Forward(get_forward_context().attn_metadata[LAYER])

        runner._model_forward = forward
        # The dummy batch calls the model itself.
        runner.model = forward

    def execute(self, out: Any) -> Any:
        """The GDN metadata ``execute_model`` builds for ``out``, up to the forward."""
        import vllm.v1.worker.block_table as block_table
        from vllm.config import set_current_vllm_config

        kernel = "_compute_slot_mapping_kernel"
        with set_current_vllm_config(self.config), _harness.recording(block_table, kernel):
            try:
                self.runner.execute_model(out)
            except _Forward as reached:
                return reached.metadata
        raise CannotStep("execute_model returned before the model's forward")

    def dummy(self) -> Dummy:
        """The GDN metadata of the runner's ``_dummy_run`` of one token a row, built as a
        capture's warm-up builds it, up to the forward."""
        import vllm.v1.worker.block_table as block_table
        from vllm.config import set_current_vllm_config

        kernel = "_compute_slot_mapping_kernel"
        with set_current_vllm_config(self.config), _harness.recording(block_table, kernel):
            try:
                self.runner._dummy_run(len(ACCEPTED), force_attention=True)
            except _Forward as reached:
                metadata = reached.metadata
                spec = int(metadata.num_spec_decodes)
                if not spec:
                    return Dummy("non-speculative")
                counts = metadata.num_accepted_tokens[:spec]
                return Dummy("speculative", [int(c) for c in counts])
        raise CannotStep("_dummy_run returned before the model's forward")

    def sampled(self, out: Any, accepted: dict[str, int], discarded: Collection[str] = ()) -> None:
        """The step's sampling: ``accepted[r]`` tokens of each request, for the runner's
        bookkeeping of accepted counts and for the scheduler, which gets none of the
        ``discarded`` requests' (chunks short of their end, whose tokens the runner drops)."""
        import torch

        rows = self.runner.input_batch.req_ids
        tokens = torch.full((len(rows), K + 1), -1, dtype=torch.int32)
        for i, rid in enumerate(rows):
            tokens[i, : accepted[rid]] = 9
        self.runner._update_states_after_model_execute(tokens, out)
        sampled = {rid: [] if rid in discarded else [9] * accepted[rid] for rid in rows}
        self.scheduler.update_from_output(out, _harness.model_outputs(sampled))

    def drafted(self, rids: list[str]) -> Any:
        """The requests' prompts prefilled (one token sampled each), then K drafts each
        handed to the scheduler: the scheduler's output for their verify step."""
        from vllm.v1.outputs import DraftTokenIds

        sched = self.scheduler
        for i, rid in enumerate(rids):
            sched.add_request(_request(rid, PROMPT, 1 + 100 * i))
        out = sched.schedule()
        self.execute(out)
        self.sampled(out, dict.fromkeys(rids, 1))
        sched.update_draft_token_ids(DraftTokenIds(rids, [[8] * K for _ in rids]))
        return sched.schedule()

    def read(self, metadata: Any) -> Read:
        """Each row's starting slot under ``metadata``, and its count in the input batch."""
        batch = self.runner.input_batch
        rows = batch.req_ids
        found = Read(speculative=int(metadata.num_spec_decodes))
        for i, rid in enumerate(rows):
            if found.speculative == len(rows):
                count = int(metadata.num_accepted_tokens[i])
                index = int(metadata.spec_state_indices_tensor[i, count - 1])
            elif found.speculative == 0:
                index = int(metadata.non_spec_state_indices_tensor[i])
            else:
                raise CannotStep(f"{found.speculative} of {len(rows)} decodes are speculative")
            blocks = list(self.runner.requests[rid].block_ids[0])
            if index not in blocks:
                raise CannotStep(f"{rid} reads state block {index}, not one of {blocks}")
            found.slots[rid] = blocks.index(index)
            found.counts[rid] = int(batch.num_accepted_tokens_cpu[i])
        return found


def _paths(served: _Served, metadata: Any) -> dict[str, str]:
    """Each row's GDN path under ``metadata``: speculative where its sequence mask is set."""
    masks = getattr(metadata, "spec_sequence_masks_cpu", None)
    if masks is None:
        masks = metadata.spec_sequence_masks
    paths = {}
    for i, rid in enumerate(served.runner.input_batch.req_ids):
        spec = int(metadata.num_spec_decodes) > 0 and masks is not None and bool(masks[i])
        paths[rid] = "speculative" if spec else "non-speculative"
    return paths


def _recompute(served: _Served, out: Any) -> Recompute:
    """After the step ``out`` (all four decoding) and a verify step in which ``PREEMPTED``
    accepts ``ACCEPTED[PREEMPTED]`` tokens, ``PREEMPTED`` preempted by the scheduler and
    recomputed in two chunks beside the others' decodes without drafts."""
    from vllm.v1.outputs import DraftTokenIds

    sched = served.scheduler
    rids = list(ACCEPTED)
    served.sampled(out, dict.fromkeys(rids, 1))
    sched.update_draft_token_ids(DraftTokenIds(rids, [[8] * K for _ in rids]))
    out = sched.schedule()
    served.execute(out)
    served.sampled(out, {rid: ACCEPTED[PREEMPTED] if rid == PREEMPTED else 1 for rid in rids})
    request = sched.requests[PREEMPTED]
    # The scheduler's own preemption (which wants the request out of running first); as
    # when schedule() preempts, the step it happens in runs the others only (a budget of
    # their decodes), so the runner drops it from the batch before it comes back.
    sched.running.remove(request)
    sched._preempt_request(request, time.monotonic())
    others = [r for r in rids if r != PREEMPTED]
    budget = sched.max_num_scheduled_tokens
    sched.max_num_scheduled_tokens = len(others)
    out = sched.schedule()
    _scheduled(out, others)
    served.execute(out)
    served.sampled(out, dict.fromkeys(others, 1))
    # A budget of the others' decodes and FIRST_CHUNK: its recompute is chunked.
    sched.max_num_scheduled_tokens = len(others) + FIRST_CHUNK
    out = sched.schedule()
    sched.max_num_scheduled_tokens = budget
    first = out.num_scheduled_tokens.get(PREEMPTED)
    if first != FIRST_CHUNK:
        raise CannotStep(f"{PREEMPTED}'s first recompute chunk is {first} tokens")
    served.execute(out)
    batch = served.runner.input_batch
    resumed_count = int(batch.num_accepted_tokens_cpu[batch.req_id_to_index[PREEMPTED]])
    served.sampled(out, dict.fromkeys(rids, 1), discarded=(PREEMPTED,))
    out = sched.schedule()
    rest = out.num_scheduled_tokens.get(PREEMPTED, 0)
    if rest < 2 or any(out.scheduled_spec_decode_tokens.values()):
        raise CannotStep(
            f"{PREEMPTED}'s later recompute chunk is {rest} tokens, drafts "
            f"{dict(out.scheduled_spec_decode_tokens)}"
        )
    metadata = served.execute(out)
    computed = int(batch.num_computed_tokens_cpu[batch.req_id_to_index[PREEMPTED]])
    if computed < PROMPT:
        raise CannotStep(f"{PREEMPTED}'s later recompute chunk starts from {computed}")
    return Recompute(
        [first, rest], computed, resumed_count=resumed_count, paths=_paths(served, metadata)
    )


def _scheduled(out: Any, rids: list[str]) -> None:
    """That ``out`` decodes one token of each of ``rids``, and no drafts."""
    if dict(out.num_scheduled_tokens) != dict.fromkeys(rids, 1) or any(
        out.scheduled_spec_decode_tokens.values()
    ):
        raise CannotStep(
            f"a step meant to decode {rids} without drafts scheduled "
            f"{dict(out.num_scheduled_tokens)}, drafts {dict(out.scheduled_spec_decode_tokens)}"
        )


@dataclass
class Steps:
    """What the probe's steps read."""

    no_drafts: Read
    back: Read
    recompute: Recompute
    dummies: tuple[Dummy, Dummy]
    """The dummy batch's path on a fresh runner and after the real steps."""


def _steps() -> Steps:
    """The step of decodes without drafts after the verify step, and the one after it that
    brings ``PASSED_OVER`` back: what each row starts from; ``PREEMPTED``'s recompute; and
    the runner's dummy batch before and after them."""

    served = _Served()
    fresh = served.dummy()
    sched = served.scheduler
    rids = list(ACCEPTED)
    out = served.drafted(rids)
    verified = served.read(served.execute(out))
    # Control: a step verifying drafts starts each row from its slot on every tree.
    if verified.speculative != len(rids) or set(verified.slots.values()) != {0}:
        raise CannotStep(f"the verify step after the prompts reads {verified}")
    served.sampled(out, ACCEPTED)
    # No drafts proposed; a budget of 3 tokens leaves the last running request out.
    budget = sched.max_num_scheduled_tokens
    sched.max_num_scheduled_tokens = len(rids) - 1
    out = sched.schedule()
    sched.max_num_scheduled_tokens = budget
    stayed = [r for r in rids if r != PASSED_OVER]
    _scheduled(out, stayed)
    no_drafts = served.read(served.execute(out))
    served.sampled(out, dict.fromkeys(stayed, 1))
    out = sched.schedule()
    _scheduled(out, rids)
    back = served.read(served.execute(out))
    recompute = _recompute(served, out)
    return Steps(no_drafts, back, recompute, (fresh, served.dummy()))


def _describe(read: Read, rids: list[str]) -> str:
    path = "speculative" if read.speculative else "non-speculative"
    return f"the {path} path, starting from state slot " + ", ".join(
        f"{rid} {read.slots[rid]}" for rid in rids
    )


def _dummy_text(dummy: Dummy) -> str:
    if dummy.path == "non-speculative":
        return "the non-speculative path"
    return "the speculative path with accepted counts " + ", ".join(map(str, dummy.counts))


def run() -> ProbeResult:
    if (unknown := without_v1_runner(NAME, V2)) is not None:
        return unknown
    try:
        steps = _steps()
    except NotServedByV1 as e:
        return ProbeResult(probe=NAME, status=UNKNOWN, evidence=f"{e}: {V2}")
    except (AttributeError, TypeError, ValueError, LookupError, CannotStep) as e:
        return ProbeResult(
            probe=NAME,
            status=UNKNOWN,
            evidence="the runner could not be driven: " + " ".join(str(e).split())[:300],
        )
    no_drafts, back, recompute = steps.no_drafts, steps.back, steps.recompute
    expected = {rid: n - 1 for rid, n in ACCEPTED.items()}
    stayed = {rid: slot for rid, slot in expected.items() if rid != PASSED_OVER}
    kept = back.counts[PASSED_OVER]
    recompute_path = recompute.paths[PREEMPTED]
    fixed = (
        no_drafts.slots == stayed
        and back.slots[PASSED_OVER] == expected[PASSED_OVER]
        and recompute_path == "non-speculative"
        and recompute.resumed_count == 1
        and all(d.safe for d in steps.dummies)
    )
    first, rest = recompute.chunks
    evidence = (
        f"hybrid target, DFlash K={K}, the V1 runner's execute_model up to the forward: after a "
        "verify step accepting "
        + ", ".join(f"{rid} {n}" for rid, n in ACCEPTED.items())
        + f" tokens, {len(stayed)} decodes without drafts ({PASSED_OVER} passed over) take "
        + _describe(no_drafts, list(stayed))
        + f"; {PASSED_OVER}, back a step later, holds accepted count {kept} and takes "
        + _describe(back, [PASSED_OVER])
        + f"; {PREEMPTED}, preempted, recomputes in chunks of {first} and {rest} tokens "
        f"(prompt {PROMPT}), resumed with accepted count {recompute.resumed_count}: the "
        f"{rest}, from {recompute.computed} computed with no drafts, take the "
        f"{recompute_path} path; the runner's dummy batch, fresh and after these steps, takes "
        + " and ".join(_dummy_text(d) for d in steps.dummies)
    )
    return ProbeResult(
        probe=NAME,
        status=PRESENT if fixed else ABSENT,
        evidence=evidence,
        details={
            "accepted": ACCEPTED,
            "no_drafts": vars(no_drafts),
            "back": vars(back),
            "kept_count": kept,
            "recompute": vars(recompute),
            "dummies": [vars(d) for d in steps.dummies],
        },
    )
