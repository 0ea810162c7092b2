"""The runner's steps that are children of the JSON protocol: the first-token engines
(``serving.distribution``), the in-process engine (``serving.engine_run``), and the reference
comparison's shards (``serving.reference`` through ``reference_pool``): each one's request,
and its result read back."""

from __future__ import annotations

import contextlib
import logging
import random
from typing import Any

from . import checks, distribution, distribution_plan, load
from .config import (
    FIDELITY_LENGTHS,
    FIDELITY_TEXTS,
)
from .pair import GIB
from .plan import (
    Role,
    SmokePlan,
    Step,
)
from .reference_pool import ReferencePool, reference_pool
from .run_state import (
    JsonChild,
    Observed,
    SmokeRun,
)
from .verdicts import lossless_divergences

logger = logging.getLogger(__name__)

AUDIT_REQUESTS = 48


def variant_name(plan: SmokePlan, step: Step) -> str:
    k = plan.engine.num_speculative_tokens
    return "plain" if step.role == Role.FIRST_TOKENS_PLAIN else f"dflash-k{k}"


def _first_tokens_variants(plan: SmokePlan) -> list[distribution_plan.Variant]:
    kv = {
        s.role: (s.kv_cache_memory_bytes or 0) / GIB
        for s in plan.steps
        if s.role in (Role.FIRST_TOKENS_DFLASH, Role.FIRST_TOKENS_PLAIN)
    }
    return distribution_plan.smoke_variants(
        plan.engine.num_speculative_tokens,
        kv.get(Role.FIRST_TOKENS_PLAIN, 0.0),
        kv.get(Role.FIRST_TOKENS_DFLASH, 0.0),
    )


def first_tokens_child(run: SmokeRun, plan: SmokePlan, step: Step) -> JsonChild:
    """One engine of the first-token check (``serving.distribution``)."""
    variants = {v.name: v for v in _first_tokens_variants(plan)}
    logger.debug("first-token engine %s on GPUs %s", variant_name(plan, step), step.gpus)
    engine = plan.engine
    engine_args: dict[str, Any] = {"kv_cache_dtype": engine.kv_cache_dtype}
    if engine.block_size is not None:
        engine_args["block_size"] = engine.block_size
    request = distribution_plan.request_for(
        variants[variant_name(plan, step)],
        plan.target,
        plan.drafter,
        per_length=plan.prompts["first_tokens_per_length"],
        vocab_size=plan.pair["vocab_size"],
        max_model_len=engine.max_model_len,
        max_num_seqs=engine.max_num_seqs,
        enforce_eager=engine.enforce_eager,
        engine_args=engine_args,
        speculative_args=dict(engine.speculative_options),
    )
    d = plan.deadlines
    return JsonChild(run, step, request, d.child_s(d.engine_run, run.first_start_s))


def first_tokens_report(plan: SmokePlan, state: Observed) -> tuple[distribution.Report | None, str]:
    if not plan.runs(checks.FIRST_TOKENS):
        return None, ""
    report = distribution.build_report(state.first_tokens, _first_tokens_variants(plan))
    return report, "; ".join(report.failures)


def _engine_request(run: SmokeRun, plan: SmokePlan, step: Step, *, batch: bool) -> dict[str, Any]:
    """The in-process run's request; ``batch`` adds the concurrent audited batch."""
    config, engine = run.config, plan.engine
    concurrent = None
    if batch:
        # Shared-prefix prompts of 16-200 tokens, 4-60 output tokens: they finish
        # out of order while max_num_seqs keeps the batch turning over.
        vocab = (10, 1000)
        base = [random.Random(7).randrange(*vocab) for _ in range(max(load.PREFIX_LENGTHS))]
        concurrent = [
            {"prompt": list(item.prompt), "max_tokens": item.max_tokens}
            for item in load.load_items(base, AUDIT_REQUESTS, seed=3, vocab=vocab)
        ]
    return {
        "target": plan.target,
        "drafter": plan.drafter,
        "texts": list(FIDELITY_TEXTS),
        "lengths": list(FIDELITY_LENGTHS),
        "max_tokens": config.fidelity_max_tokens,
        "num_speculative_tokens": engine.num_speculative_tokens,
        "speculative_options": dict(engine.speculative_options),
        "attention_backend": engine.attention_backend,
        "max_model_len": engine.max_model_len,
        "gpu_memory_utilization": engine.gpu_memory_utilization,
        "seed": engine.seed,
        "enforce_eager": engine.enforce_eager,
        "kv_cache_dtype": engine.kv_cache_dtype,
        # The in-process engine holds its model runner only at TP=1; the servers
        # run at the requested TP and executor.
        "tensor_parallel_size": 1,
        "max_num_seqs": engine.max_num_seqs,
        "block_size": engine.block_size,
        "kv_cache_memory_bytes": step.kv_cache_memory_bytes,
        "language_model_only": plan.target_info.multimodal,
        "gdn_prefill_backend": plan.target_info.gdn_prefill_backend,
        "features_path": str(run.workdir / f"{step.run}-features.pt"),
        "concurrent": concurrent,
    }


def engine_child(run: SmokeRun, plan: SmokePlan, step: Step) -> tuple[dict[str, Any] | None, str]:
    """One in-process engine run (``engine``: the main one, with the audited batch).
    Returns (its result, why it is missing)."""
    batch = step.run == "engine" and plan.runs(checks.SLOT_AUDIT)
    logger.debug("in-process engine %s on GPUs %s (slot audit: %s)", step.run, step.gpus, batch)
    request = _engine_request(run, plan, step, batch=batch)
    d = plan.deadlines
    child = JsonChild(run, step, request, d.child_s(d.engine_run, run.first_start_s))
    with run.step(step.name, child.log) as record:
        result = child.start().result()
        record.extra = {"proposals": len(result["proposals"]), "vllm": result.get("vllm_location")}
        return result, ""
    return None, run.steps[-1].message or "the in-process run did not finish"


def start_reference_pool(
    run: SmokeRun, step: Step
) -> contextlib.AbstractContextManager[ReferencePool]:
    """The reference children of one engine run: started now when they load beside the
    engines, else at the comparison."""
    assert run.plan is not None
    plan = run.plan
    setup = {"target": plan.target, "drafter": plan.drafter, "dtype": run.config.reference_dtype}
    return reference_pool(
        run.python,
        run.workdir,
        run.logs,
        step.run,
        setup,
        shards=step.processes,
        env=run.step_environment(step),
        early=step.loads_before_the_engine,
    )


def reference_work(
    run: SmokeRun, plan: SmokePlan, state: Observed, name: str
) -> tuple[dict[str, Any] | None, str]:
    """The reference's work on one engine run's proposals (a FidelityInput's fields, the
    servers' divergences aside). Returns (work, why there is none)."""
    engine_result, why = state.engine.get(name, (None, "the in-process run did not run"))
    if engine_result is None:
        return None, f"needs the in-process run: {why}"
    config = run.config
    expected = state.info.expected_aux_layers() if state.info else None
    subset = set(plan.reference.prompts)
    return {
        "prompts": engine_result["prompts"],
        "outputs": engine_result["outputs"],
        "proposals": [p for p in engine_result["proposals"] if int(p["prompt"]) in subset],
        "tie_tolerance": config.fidelity_tie_tolerance,
        "context": config.context_source(plan.target_info.hybrid),
        "features_path": engine_result.get("features_path"),
        "expected_layers": list(expected) if expected else None,
    }, ""


def reference_result(
    run: SmokeRun, plan: SmokePlan, step: Step, pool: ReferencePool, state: Observed, name: str
) -> tuple[dict[str, Any] | None, str]:
    """The reference comparison of one engine run (and, for the main run, the target's
    margins at the servers' first differences), its proposals handed over now unless the
    pool has them already. Returns (fidelity result, why missing)."""
    work = None
    if not pool.dispatched:
        work, why = reference_work(run, plan, state, name)
        if work is None:
            return None, why
    divergences = []
    if name == "engine" and state.spec is not None and state.plain is not None:
        divergences = lossless_divergences(state.spec, state.plain)
    d = plan.deadlines
    if step.loads_before_the_engine:
        limit = d.reference.seconds(run.first_start_s)
    else:
        limit = d.child_s(d.reference, run.first_start_s)
    with run.step(f"reference comparison ({name})", pool.log(0)) as record:
        if work is not None:
            pool.dispatch(work)
        fidelity = pool.finish(divergences, run.deadline.limit(limit))
        record.extra = {"seconds": fidelity.get("seconds"), "shards": fidelity.get("shards")}
        return fidelity, ""
    return None, run.steps[-1].message or "the reference comparison did not finish"
