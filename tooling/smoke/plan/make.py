"""The smoke's plan: which engines, where, in what order, with which deadlines, checks and prompts.

``plan_smoke`` is pure: the run's settings, the pair's figures (``pair.PairFacts``)
and the GPUs (``config.GpuFacts``) in, one ``SmokePlan`` out. ``--dry-run`` prints
that object and the runner executes that same object, so the two cannot drift.

Memory: every engine gets a fixed KV cache (``kv_cache_memory_bytes``) sized from
the pair's KV figures, since engines sharing a GPU must not profile memory while a
neighbour starts or stops (vLLM 0.20.1 asserts then). When every engine fits the
GPUs at once they start side by side (one start's wait for all); otherwise they
run one after another, one GPU each, as many at a time as there are GPUs.

Deadlines: the first engine's start is bounded from the pair's size; every later
limit is a multiple of that measured start, with a floor, so a pair that starts
slowly gets time in proportion rather than a fixed total.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ...errors import SmokeCapacityError, SmokePairError
from .. import checks
from ..config import (
    FIDELITY_LENGTHS,
    LOSSLESS_PROMPTS,
    PREFIX_PROMPT_TOKENS,
    EngineSettings,
    GpuFacts,
    SmokeConfig,
    TargetInfo,
)
from ..pair import GIB, PairFacts
from ..server import ServeOptions, build_serve_command
from .deadlines import (
    deadlines_for,
)
from .memory import (
    PlannedEngine,
    kv_cache_bytes,
    place,
    reference_bytes,
    refuse_what_does_not_fit,
)
from .model import (
    ENGINE_MODULE,
    FIRST_TOKENS_MODULE,
    START_ORDER,
    TINY_MODULE,
    Mode,
    Role,
    SmokePlan,
    Step,
    child_argv,
)
from .reference import (
    plan_reference,
    warm_steps,
)

#: drawn in fp32 on the CPU, the seed's width holds twice its size in host memory and takes
#: minutes. The smaller pairs keep their CPU draw, so their weights stay the same.
LARGE_PAIR_BYTES = 8 * GIB

TINY_S_PER_GIB = 4.0

#: First-token prompts per length (K, K+1, K+2, 3(K+1)): the full run, and --quick.
FIRST_TOKENS_PER_LENGTH = 3
FIRST_TOKENS_PER_LENGTH_QUICK = 1


def serve_options(
    engine: EngineSettings,
    target_info: TargetInfo,
    target: str,
    drafter: str | None,
    kv: int | None,
    port: int,
) -> ServeOptions:
    """One server of the plan: the shared flags with its own KV size."""
    return ServeOptions(
        target,
        drafter,
        replace(engine, kv_cache_memory_bytes=kv),
        port=port,
        language_model_only=target_info.multimodal,
        gdn_prefill_backend=target_info.gdn_prefill_backend,
    )


@dataclass(frozen=True)
class ModelsDraw:
    """How ``--tiny`` writes its pair into ``out``: ``python -m TINY_MODULE *args``, within
    ``limit_s``. The runner starts it before the plan exists (it overlaps the preflight),
    so both take it from here."""

    out: Path
    options: tuple[str, ...]
    limit_s: float

    @property
    def args(self) -> tuple[str, ...]:
        return (str(self.out), *self.options)


def models_draw(config: SmokeConfig, pair: PairFacts) -> ModelsDraw | None:
    """The generator's arguments and limit for ``config``'s tiny pair; None without
    ``--tiny`` (pure)."""
    if not config.tiny:
        return None
    options = ["--seed", str(config.tiny_seed), "--arch", config.tiny_arch]
    if config.tiny_hidden_size is not None:
        options += ["--hidden-size", str(config.tiny_hidden_size)]
    both = pair.target.weight_bytes + pair.drafter.weight_bytes
    if both > LARGE_PAIR_BYTES:
        options += ["--device", "cuda"]
    limit_s = config.timeouts.tiny + TINY_S_PER_GIB * both / GIB
    return ModelsDraw(config.workdir.resolve() / "models", tuple(options), limit_s)


@dataclass(frozen=True)
class _Asked:
    """What every step of one plan shares."""

    config: SmokeConfig
    pair: PairFacts
    gpus: GpuFacts
    base: EngineSettings
    target_info: TargetInfo
    python: str
    workdir: Path

    @property
    def tp(self) -> int:
        return self.base.tensor_parallel_size


def _asked(config: SmokeConfig, pair: PairFacts, gpus: GpuFacts) -> _Asked:
    """The plan's shared inputs; SmokePairError when K is more than the drafter's block
    drafts, SmokeCapacityError when the tensor-parallel size is more than the GPUs."""
    config.validate()
    target_info = TargetInfo(hybrid=pair.target.hybrid, multimodal=pair.target.multimodal)
    base = config.engine_settings(target_info.hybrid)
    k, block = base.num_speculative_tokens, pair.drafter.block_size
    if block is not None and k > block - 1:
        raise SmokePairError(
            f"{pair.drafter.path}: its block_size {block} drafts at most {block - 1} tokens a "
            f"step; --num-speculative-tokens {k} asks for more"
        )
    tp = base.tensor_parallel_size
    if gpus.count < tp:
        raise SmokeCapacityError(
            f"--tensor-parallel-size {tp} needs {tp} GPUs; {gpus.count} visible"
        )
    python = config.python or sys.executable
    return _Asked(config, pair, gpus, base, target_info, python, config.workdir.resolve())


def _engines(asked: _Asked) -> tuple[list[PlannedEngine], EngineSettings]:
    """The run's engines, in waves' order (the in-process engine early, so the reference, which
    compares its proposals, can load beside a later wave's engines rather than after all), and
    the flags every engine shares."""
    pair, base, tp, quick = asked.pair, asked.base, asked.tp, asked.config.quick
    spec_kv = kv_cache_bytes(pair, base, True, tp)
    target_w, both_w = (
        pair.target.weight_bytes,
        pair.target.weight_bytes + pair.drafter.weight_bytes,
    )
    plain_kv = kv_cache_bytes(pair, base, False, tp)
    spec_kv_1 = kv_cache_bytes(pair, base, True, 1)
    plain_kv_1 = kv_cache_bytes(pair, base, False, 1)
    # The first-token check serves its DFlash engine's prompts one at a time (the plain
    # engine's also together, for the noise): on a pair as large as the seed's, the smaller
    # cache lets it share a wave with the plain engine.
    first_kv = kv_cache_bytes(pair, base, True, 1, alone=True)
    # The flags every engine shares; each step's KV size is its own (an engine without the
    # drafter keeps no recurrent state per draft position).
    engine = replace(base, kv_cache_memory_bytes=spec_kv)
    target, drafter = pair.target.path, pair.drafter.path

    def child(module: str, name: str) -> tuple[str, ...]:
        return child_argv(asked.python, module, asked.workdir, f"{name}-in.json", f"{name}.json")

    def serve(draft: str | None, kv: int) -> tuple[str, ...]:
        options = serve_options(engine, asked.target_info, target, draft, kv, port=0)
        return tuple(build_serve_command(options, asked.python))

    engines: list[PlannedEngine] = []
    if not quick:
        engines.append(
            PlannedEngine(
                "serve with DFlash", Role.SERVE_DFLASH, tp, both_w, spec_kv, serve(drafter, spec_kv)
            )
        )
    if asked.config.run_fidelity:
        engines.append(
            PlannedEngine(
                "in-process engine (engine)",
                Role.ENGINE,
                1,
                both_w,
                spec_kv_1,
                child(ENGINE_MODULE, "engine"),
            )
        )
    if not quick:
        engines.append(
            PlannedEngine(
                "serve without speculation",
                Role.SERVE_PLAIN,
                tp,
                target_w,
                plain_kv,
                serve(None, plain_kv),
            )
        )
    engines += [
        PlannedEngine(
            "first tokens with DFlash",
            Role.FIRST_TOKENS_DFLASH,
            1,
            both_w,
            first_kv,
            child(FIRST_TOKENS_MODULE, "first-tokens-dflash"),
        ),
        PlannedEngine(
            "first tokens without speculation",
            Role.FIRST_TOKENS_PLAIN,
            1,
            target_w,
            plain_kv_1,
            child(FIRST_TOKENS_MODULE, "first-tokens-plain"),
        ),
    ]
    return engines, engine


def _prompts(config: SmokeConfig, k: int) -> dict[str, Any]:
    """How many prompts of each kind the run serves (the plan's ``prompts``)."""
    from ..distribution_plan import first_token_prompts

    quick = config.quick
    per_length = FIRST_TOKENS_PER_LENGTH_QUICK if quick else FIRST_TOKENS_PER_LENGTH
    return {
        "lossless": 0 if quick else len(LOSSLESS_PROMPTS),
        "prefix_tokens": 0 if quick else PREFIX_PROMPT_TOKENS,
        "fidelity_lengths": list(FIDELITY_LENGTHS) if config.run_fidelity else [],
        "first_tokens": {p["name"]: p["length"] for p in first_token_prompts(k, per_length)},
        "first_tokens_per_length": per_length,
    }


def _steps(
    asked: _Asked,
    engines: list[PlannedEngine],
    ref_step: Step | None,
    draw: ModelsDraw | None,
) -> list[Step]:
    """Every step in start order: the generated pair's draw, check 7's waves, the plan's own."""
    config, pair, python, workdir = asked.config, asked.pair, asked.python, asked.workdir
    steps: list[Step] = []
    if draw is not None:
        both_w = pair.target.weight_bytes + pair.drafter.weight_bytes
        argv = (python, "-m", TINY_MODULE, *draw.args)
        # Drawn on the GPU, the pair is there whole before it is written (wave 0, alone).
        on_gpu = "cuda" in draw.options
        steps.append(
            Step("models", Role.MODELS, 0, (0,) if on_gpu else (), argv, both_w if on_gpu else 0)
        )
    # Check 7's waves come first, the plan's own after them.
    warm = warm_steps(engines, ref_step, asked.gpus, python, workdir) if config.warm_cache else []
    offset = max((s.wave for s in warm), default=0)
    main = [Step(e.name, e.role, e.wave + offset, e.gpus, e.argv, e.need, e.kv) for e in engines]
    if ref_step is not None:
        main.append(replace(ref_step, wave=ref_step.wave + offset))
    return steps + sorted(warm + main, key=lambda s: (s.wave, START_ORDER.index(s.role)))


def plan_smoke(config: SmokeConfig, pair: PairFacts, gpus: GpuFacts) -> SmokePlan:
    """The plan for ``config``'s run of ``pair`` on ``gpus`` (pure). SmokeCapacityError,
    one line naming the figures, when an engine does not fit one GPU's usable memory;
    SmokePairError when K is more than the drafter's block drafts."""
    asked = _asked(config, pair, gpus)
    engines, engine = _engines(asked)
    ref_need = reference_bytes(pair, config.reference_dtype)
    refuse_what_does_not_fit(engines, gpus, asked.tp, ref_need, config)
    placed = place(engines, gpus, config.overlap_engines)
    reference, ref_step = plan_reference(
        config,
        pair,
        gpus,
        engines,
        placed.board,
        ref_need,
        asked.python,
        asked.workdir,
        share=config.overlap_engines is not False,
    )
    draw = models_draw(config, pair)
    first_wave = min(e.wave for e in engines)
    deadlines = deadlines_for(
        config.timeouts,
        largest=max(e.weights for e in engines),
        together=sum(1 for e in engines if e.wave == first_wave),
        tiny_s=draw.limit_s if draw is not None else None,
    )
    return SmokePlan(
        workdir=asked.workdir,
        mode=Mode.QUICK if config.quick else Mode.FULL,
        layout=placed.layout,
        why=placed.why,
        gpus=gpus,
        pair=pair.to_json(),
        target=pair.target.path,
        drafter=pair.drafter.path,
        target_info=asked.target_info,
        engine=engine,
        steps=tuple(_steps(asked, engines, ref_step, draw)),
        deadlines=deadlines,
        reference=reference,
        checks=_checks(config),
        prompts=_prompts(config, engine.num_speculative_tokens),
    )


def _checks(config: SmokeConfig) -> dict[str, str]:
    """Check id -> ``run``, or why it is skipped."""
    quick = "not in --quick (one engine start)" if config.quick else ""
    out: dict[str, str] = {}
    for check in checks.ORDER:
        why = ""
        if check in (checks.LOSSLESS, checks.PREFIX_CACHE, checks.ACCEPTANCE, checks.LOAD):
            why = quick
        if check == checks.LOAD and not why and not config.load:
            why = "not asked (--no-load)"
        if check in (checks.DRAFTER_WINDOWS, checks.FIDELITY) and not config.run_fidelity:
            why = "skipped (--no-fidelity)"
        if check == checks.FIDELITY and not why:
            why = quick
        if check == checks.AUX_LAYERS and config.quick and not config.run_fidelity:
            why = "needs the in-process engine (--no-fidelity)"
        if check == checks.SLOT_AUDIT and not (config.run_fidelity and config.audit):
            why = "not asked"
        if check == checks.WARM_CACHE and not config.warm_cache:
            why = "not asked (--warm-cache)"
        out[check] = why or "run"
    return out
