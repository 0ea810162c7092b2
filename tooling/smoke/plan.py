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

import math
import sys
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from ..errors import SmokeCapacityError, SmokePairError
from . import checks
from .config import (
    FIDELITY_LENGTHS,
    LOSSLESS_PROMPTS,
    PREFIX_PROMPT_TOKENS,
    REFERENCE_SHARDS,
    EngineSettings,
    GpuFacts,
    SmokeConfig,
    TargetInfo,
)
from .pair import GIB, PairFacts
from .server import ServeOptions, build_serve_command

TINY_MODULE = "tooling.smoke.serving.tiny"
ENGINE_MODULE = "tooling.smoke.serving.engine_run"
FIRST_TOKENS_MODULE = "tooling.smoke.serving.distribution"
REFERENCE_MODULE = "tooling.smoke.serving.reference"

#: What an engine needs beyond its weights and KV cache: CUDA context, compiled graphs,
#: activations. A fixed part and a share of the weights (larger models, larger buffers).
ENGINE_OVERHEAD_BYTES = 3 * GIB
ENGINE_OVERHEAD_SHARE = 0.05
REFERENCE_OVERHEAD_BYTES = 2 * GIB
#: A generated pair past this size is drawn in bf16 on the GPU (``tiny --device cuda``):
#: drawn in fp32 on the CPU, the seed's width holds twice its size in host memory and takes
#: minutes. The smaller pairs keep their CPU draw, so their weights stay the same.
LARGE_PAIR_BYTES = 8 * GIB
#: The smallest fixed KV cache an engine gets (what the tiny pairs start with).
MIN_KV_CACHE_BYTES = 4 * GIB
#: Room left for the sizes this plan cannot see (allocator slack, other tenants).
KV_MARGIN = 1.1
#: A first start is not measured yet: this many seconds per GiB of the largest engine's
#: weights on top of the start floor (loading and compiling grow with the model).
FIRST_START_S_PER_GIB = 8.0
TINY_S_PER_GIB = 4.0
#: Engines that start together compete for the CPU while they compile: each one more
#: adds this share to the first start's limit.
CONCURRENT_START_SHARE = 0.25
#: Later limits, as multiples of the first engine's measured start.
START_TIMES = 2.0
REQUEST_TIMES = 0.5
ENGINE_RUN_TIMES = 1.5
REFERENCE_TIMES = 2.0
LOAD_TIMES = 1.0
#: Fidelity prompts the reference compares when the target is too large to hold twice on
#: one GPU: it then runs alone after the engines, and fewer prompts bound its time.
REFERENCE_SUBSET = 2
#: First-token prompts per length (K, K+1, K+2, 3(K+1)): the full run, and --quick.
FIRST_TOKENS_PER_LENGTH = 3
FIRST_TOKENS_PER_LENGTH_QUICK = 1


class Mode(StrEnum):
    FULL = "full"
    QUICK = "quick"


class Layout(StrEnum):
    SIDE_BY_SIDE = "side by side"
    ONE_AFTER_ANOTHER = "one after another"


class Role(StrEnum):
    """What a step is, for the runner: how it is started, waited for and read."""

    MODELS = "models"
    SERVE_DFLASH = "serve-dflash"
    SERVE_PLAIN = "serve-plain"
    ENGINE = "engine"
    FIRST_TOKENS_DFLASH = "first-tokens-dflash"
    FIRST_TOKENS_PLAIN = "first-tokens-plain"
    REFERENCE = "reference"


#: The steps each check reads, its optional inputs included (check 1 takes the reference's
#: margins and check 10's noise, as checks 5 and 7 take the noise; check 2 the features the
#: reference matched to layers):
#: until every planned one has run, a report written meanwhile holds the check pending.
CHECK_READS: dict[str, tuple[Role, ...]] = {
    checks.LOSSLESS: (
        Role.SERVE_DFLASH,
        Role.SERVE_PLAIN,
        Role.REFERENCE,
        Role.FIRST_TOKENS_DFLASH,
        Role.FIRST_TOKENS_PLAIN,
    ),
    checks.AUX_LAYERS: (Role.SERVE_DFLASH, Role.ENGINE, Role.REFERENCE),
    checks.DRAFTER_WINDOWS: (Role.ENGINE,),
    checks.PREFIX_CACHE: (Role.SERVE_DFLASH, Role.SERVE_PLAIN),
    checks.FIDELITY: (
        Role.ENGINE,
        Role.REFERENCE,
        Role.FIRST_TOKENS_DFLASH,
        Role.FIRST_TOKENS_PLAIN,
    ),
    checks.ACCEPTANCE: (Role.SERVE_DFLASH,),
    checks.WARM_CACHE: (
        Role.ENGINE,
        Role.REFERENCE,
        Role.FIRST_TOKENS_DFLASH,
        Role.FIRST_TOKENS_PLAIN,
    ),
    checks.SLOT_AUDIT: (Role.ENGINE,),
    checks.LOAD: (Role.SERVE_DFLASH, Role.SERVE_PLAIN),
    checks.FIRST_TOKENS: (Role.FIRST_TOKENS_DFLASH, Role.FIRST_TOKENS_PLAIN),
}

#: The order the runner starts a wave's processes in (and waits for their work).
START_ORDER = (
    Role.REFERENCE,
    Role.SERVE_DFLASH,
    Role.SERVE_PLAIN,
    Role.FIRST_TOKENS_DFLASH,
    Role.FIRST_TOKENS_PLAIN,
    Role.ENGINE,
)


@dataclass(frozen=True)
class Limit:
    """A time limit: ``times`` the measured first engine start, at least ``floor_s``."""

    floor_s: float
    times: float

    def seconds(self, measured_start_s: float | None) -> float:
        if measured_start_s is None:
            return self.floor_s
        return max(self.floor_s, self.times * measured_start_s)


@dataclass(frozen=True)
class Deadlines:
    first_start_s: float
    """An engine start before any start was measured."""
    start: Limit
    """An engine start once one was measured."""
    request: Limit
    engine_run: Limit
    """An in-process child's work after its engine started."""
    reference: Limit
    load: Limit
    tiny_s: float
    server_stop_s: float
    total_s: float | None
    """The whole run (``--time-limit``); None: only each step's own limit."""

    def start_s(self, measured_start_s: float | None) -> float:
        if measured_start_s is None:
            return self.first_start_s
        return self.start.seconds(measured_start_s)

    def child_s(self, work: Limit, measured_start_s: float | None) -> float:
        """A child that starts an engine (or loads the models) and then works."""
        return self.start_s(measured_start_s) + work.seconds(measured_start_s)


@dataclass(frozen=True)
class Step:
    """One process (or, for the reference, ``processes`` alike) of the run."""

    name: str
    role: Role
    wave: int
    gpus: tuple[int, ...]
    """Indices into the GPUs visible to the run; empty for the model generation."""
    argv: tuple[str, ...]
    memory_bytes: int = 0
    """What it needs on each of its GPUs."""
    kv_cache_memory_bytes: int | None = None
    processes: int = 1
    loads_before_the_engine: bool = False
    """The reference: started with its wave's engines, it loads while they run."""
    run: str = "engine"
    """Which engine run it belongs to: ``engine``, or ``warm-A``/``warm-B`` (check 7)."""


@dataclass(frozen=True)
class ReferencePlan:
    placement: str
    """``beside the engines``, ``own GPU``, ``after the engines`` or ``not run``."""
    shards: int
    prompts: tuple[int, ...]
    """Indices of the fidelity prompts it compares (all, or the stated subset)."""
    why: str


@dataclass(frozen=True)
class SmokePlan:
    workdir: Path
    mode: Mode
    layout: Layout
    why: str
    gpus: GpuFacts
    pair: dict[str, Any]
    target: str
    drafter: str
    target_info: TargetInfo
    engine: EngineSettings
    """The flags every engine gets, the fixed KV cache included."""
    steps: tuple[Step, ...]
    deadlines: Deadlines
    reference: ReferencePlan
    checks: dict[str, str]
    """Check id -> ``run`` or why it is skipped."""
    prompts: dict[str, Any]

    def waves(self) -> list[list[Step]]:
        """The steps of each wave, in start order; wave 0 is the model generation."""
        count = max((s.wave for s in self.steps), default=0) + 1
        return [[s for s in self.steps if s.wave == w] for w in range(count)]

    def step(self, role: Role, run: str = "engine") -> Step | None:
        return next((s for s in self.steps if s.role == role and s.run == run), None)

    def runs(self, check: str) -> bool:
        return self.checks.get(check) == "run"

    def waits_for(self, check: str, waves_done: int) -> list[str]:
        """The planned steps ``check`` reads that run after wave ``waves_done``: what a
        report written then still waits for (none once the run is over)."""
        reads = CHECK_READS.get(check, ())
        return [s.name for s in self.steps if s.role in reads and s.wave > waves_done]

    def to_json(self) -> dict[str, Any]:
        deadlines = asdict(self.deadlines)
        return {
            "workdir": str(self.workdir),
            "time_limit_s": self.deadlines.total_s,
            "mode": str(self.mode),
            "layout": str(self.layout),
            "why": self.why,
            "gpus": {"count": self.gpus.count, "total_gib": round(self.gpus.total_bytes / GIB, 1)},
            "pair": self.pair,
            "target": self.target,
            "drafter": self.drafter,
            "target_info": asdict(self.target_info),
            "engine": asdict(self.engine),
            "steps": [
                {
                    "step": s.name,
                    "role": str(s.role),
                    "run": s.run,
                    "wave": s.wave,
                    "gpus": list(s.gpus),
                    "memory_gib": round(s.memory_bytes / GIB, 2),
                    "kv_cache_memory_bytes": s.kv_cache_memory_bytes,
                    "processes": s.processes,
                    "loads_before_the_engine": s.loads_before_the_engine,
                    "argv": list(s.argv),
                }
                for s in self.steps
            ],
            "deadlines": deadlines,
            "reference": {**asdict(self.reference), "prompts": list(self.reference.prompts)},
            "checks": self.checks,
            "prompts": self.prompts,
        }


def render(plan: SmokePlan) -> str:
    """The plan for people: what runs where and why, then each wave's processes."""
    d = plan.deadlines
    lines = [
        f"{plan.mode} smoke of {plan.target} with {plan.drafter}",
        f"pair: {plan.pair}",
        f"GPUs: {plan.gpus.count} x {plan.gpus.total_bytes / GIB:.1f} GiB; engines "
        f"{plan.layout}: {plan.why}",
        f"reference: {plan.reference.placement}, {plan.reference.shards} process(es), "
        f"prompts {list(plan.reference.prompts)}: {plan.reference.why}",
        f"deadlines: first engine start {d.first_start_s:.0f} s; then start "
        f"{d.start.times:g} x measured start (at least {d.start.floor_s:.0f} s), request "
        f"{d.request.times:g} x (at least {d.request.floor_s:.0f} s); whole run "
        + ("unbounded" if d.total_s is None else f"{d.total_s:.0f} s"),
    ]
    backend = plan.engine.distributed_executor_backend
    if backend is not None:
        lines.append(
            f"DFlash server: --distributed-executor-backend {backend} at tensor parallel "
            f"{plan.engine.tensor_parallel_size} (the plain server: vLLM's choice; the "
            "in-process engines: TP 1, no executor)"
        )
    for wave, steps in enumerate(plan.waves()):
        for s in steps:
            where = f"GPU {','.join(map(str, s.gpus))}" if s.gpus else "CPU"
            kv = f", KV {s.kv_cache_memory_bytes / GIB:.1f} GiB" if s.kv_cache_memory_bytes else ""
            lines.append(
                f"  wave {wave}: {s.name} on {where} ({s.memory_bytes / GIB:.1f} GiB{kv}"
                + (f", {s.processes} processes" if s.processes > 1 else "")
                + ")"
            )
    lines += [f"  check {c}: {why}" for c, why in plan.checks.items()]
    return "\n".join(lines)


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


def _argv(python: str, module: str, workdir: Path, request: str, result: str) -> tuple[str, ...]:
    """``python -m module REQUEST RESULT``: a child of the JSON protocol (``serving.child``)."""
    return (python, "-m", module, str(workdir / request), str(workdir / result))


# --- sizing ---------------------------------------------------------------------------


def kv_cache_bytes(
    pair: PairFacts, engine: EngineSettings, speculative: bool, tp: int, alone: bool = False
) -> int:
    """The fixed KV cache one engine gets per GPU: every sequence at full length, and a
    hybrid target's recurrent state for each verified position of each sequence. ``alone``:
    an engine served one request at a time needs one sequence's, though never fewer
    recurrent blocks than ``max_num_seqs`` (vLLM refuses to capture a hybrid target's full
    CUDA graphs with fewer)."""
    if engine.kv_cache_memory_bytes is not None:
        return engine.kv_cache_memory_bytes
    per_token = pair.target.kv_bytes_per_token
    if speculative:
        per_token += pair.drafter.kv_bytes_per_token
    if engine.kv_cache_dtype.startswith("fp8"):
        per_token //= 2
    sequences = 1 if alone else engine.max_num_seqs
    tokens = sequences * engine.max_model_len
    slots = sequences * ((engine.num_speculative_tokens + 1) if speculative else 1)
    if alone:
        slots = max(slots, engine.max_num_seqs)
    state = pair.target.recurrent_layers * pair.target.recurrent_state_bytes * slots
    need = (tokens * per_token + state) * KV_MARGIN / tp
    return max(MIN_KV_CACHE_BYTES, math.ceil(need / GIB) * GIB)


def engine_bytes(weights: int, kv: int, tp: int) -> int:
    """One engine's need on each of its GPUs."""
    share = weights / tp
    return int(share + kv + ENGINE_OVERHEAD_BYTES + ENGINE_OVERHEAD_SHARE * share)


def reference_bytes(pair: PairFacts, dtype: str) -> int:
    """One reference process: both models in the reference's dtype, and room to run them."""
    weights = pair.target.weight_bytes + pair.drafter.weight_bytes
    if dtype == "float32":
        weights *= 2
    return weights + REFERENCE_OVERHEAD_BYTES


@dataclass
class _Gpu:
    usable: int
    used: int = 0

    @property
    def free(self) -> int:
        return self.usable - self.used


@dataclass
class _Engine:
    name: str
    role: Role
    tp: int
    weights: int
    kv: int
    argv: tuple[str, ...]
    run: str = "engine"
    gpus: tuple[int, ...] = ()
    wave: int = 0

    @property
    def need(self) -> int:
        return engine_bytes(self.weights, self.kv, self.tp)


def _fit(gpus: list[_Gpu], need: int, count: int, exclude: set[int]) -> tuple[int, ...] | None:
    """``count`` GPUs with ``need`` free, the freest first (spreads the engines); None if not."""
    ready = sorted(
        (i for i, g in enumerate(gpus) if i not in exclude and g.free >= need),
        key=lambda i: (-gpus[i].free, i),
    )
    return tuple(sorted(ready[:count])) if len(ready) >= count else None


# --- planning -------------------------------------------------------------------------


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


def plan_smoke(config: SmokeConfig, pair: PairFacts, gpus: GpuFacts) -> SmokePlan:
    """The plan for ``config``'s run of ``pair`` on ``gpus`` (pure). SmokeCapacityError,
    one line naming the figures, when an engine does not fit one GPU's usable memory;
    SmokePairError when K is more than the drafter's block drafts."""
    config.validate()
    python = config.python or sys.executable
    workdir = config.workdir.resolve()
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
    quick = config.quick
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
        return _argv(python, module, workdir, f"{name}-in.json", f"{name}.json")

    def serve(draft: str | None, kv: int) -> tuple[str, ...]:
        options = serve_options(engine, target_info, target, draft, kv, port=0)
        return tuple(build_serve_command(options, python))

    # In waves, in this order: the in-process engine early, so the reference, which
    # compares its proposals, can load beside a later wave's engines rather than after all.
    engines: list[_Engine] = []
    if not quick:
        engines.append(
            _Engine(
                "serve with DFlash", Role.SERVE_DFLASH, tp, both_w, spec_kv, serve(drafter, spec_kv)
            )
        )
    fidelity = config.run_fidelity
    if fidelity:
        engines.append(
            _Engine(
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
            _Engine(
                "serve without speculation",
                Role.SERVE_PLAIN,
                tp,
                target_w,
                plain_kv,
                serve(None, plain_kv),
            )
        )
    engines += [
        _Engine(
            "first tokens with DFlash",
            Role.FIRST_TOKENS_DFLASH,
            1,
            both_w,
            first_kv,
            child(FIRST_TOKENS_MODULE, "first-tokens-dflash"),
        ),
        _Engine(
            "first tokens without speculation",
            Role.FIRST_TOKENS_PLAIN,
            1,
            target_w,
            plain_kv_1,
            child(FIRST_TOKENS_MODULE, "first-tokens-plain"),
        ),
    ]
    usable = gpus.usable_bytes
    for e in engines:
        if e.need > usable:
            raise SmokeCapacityError(
                f"{e.name} needs {e.need / GIB:.1f} GiB on each of {e.tp} GPU(s) (weights "
                f"{e.weights / e.tp / GIB:.1f}, KV cache {e.kv / GIB:.1f}, working memory "
                f"{(e.need - e.weights / e.tp - e.kv) / GIB:.1f}); a GPU here has "
                f"{usable / GIB:.1f} GiB usable of {gpus.total_bytes / GIB:.1f} GiB"
                + ("" if e.tp > 1 or tp > 1 else ": try --tensor-parallel-size 2")
            )
    ref_need = reference_bytes(pair, config.reference_dtype)
    if fidelity and not quick and ref_need > usable:
        raise SmokeCapacityError(
            f"the reference comparison needs {ref_need / GIB:.1f} GiB on one GPU (both models "
            f"in {config.reference_dtype}); a GPU here has {usable / GIB:.1f} GiB usable: "
            "pass --no-fidelity"
        )

    # Side by side when every engine fits at once, else one after another.
    board = [_Gpu(usable) for _ in range(gpus.count)]
    side_by_side = (config.overlap_engines is not False) and _place_all(engines, board)
    if side_by_side:
        layout = Layout.SIDE_BY_SIDE
        why = (
            f"all {len(engines)} engines fit at once "
            f"({sum(e.need * e.tp for e in engines) / GIB:.1f} GiB of "
            f"{gpus.count * usable / GIB:.1f} GiB usable): one start's wait for all"
        )
    else:
        layout = Layout.ONE_AFTER_ANOTHER
        board = [_Gpu(usable) for _ in range(gpus.count)]
        asked = config.overlap_engines is False
        _place_in_turn(engines, gpus.count, usable, share=not asked)
        waves = max(e.wave for e in engines)
        if asked:
            why = "asked (--sequential): one engine a GPU at a time"
        else:
            why = (
                f"the {len(engines)} engines need "
                f"{sum(e.need * e.tp for e in engines) / GIB:.1f} GiB at once, more than the "
                f"{gpus.count * usable / GIB:.1f} GiB usable: as many at a time as the GPUs hold"
            )
        why += f", in {waves} waves"

    reference, ref_step = _plan_reference(
        config,
        pair,
        gpus,
        engines,
        board if side_by_side else None,
        ref_need,
        python,
        workdir,
        share=config.overlap_engines is not False,
    )
    steps: list[Step] = []
    draw = models_draw(config, pair)
    if draw is not None:
        argv = (python, "-m", TINY_MODULE, *draw.args)
        # Drawn on the GPU, the pair is there whole before it is written (wave 0, alone).
        on_gpu = "cuda" in draw.options
        steps.append(
            Step("models", Role.MODELS, 0, (0,) if on_gpu else (), argv, both_w if on_gpu else 0)
        )
    # Check 7's waves come first, the plan's own after them.
    warm = _warm_steps(engines, ref_step, gpus, python, workdir) if config.warm_cache else []
    offset = max((s.wave for s in warm), default=0)
    main = [Step(e.name, e.role, e.wave + offset, e.gpus, e.argv, e.need, e.kv) for e in engines]
    if ref_step is not None:
        main.append(replace(ref_step, wave=ref_step.wave + offset))
    steps += sorted(warm + main, key=lambda s: (s.wave, START_ORDER.index(s.role)))

    largest = max(e.weights for e in engines)
    # The first start's allowance is for the engines of the first wave, starting together.
    first_wave = min(e.wave for e in engines)
    together = sum(1 for e in engines if e.wave == first_wave)
    t = config.timeouts
    deadlines = Deadlines(
        first_start_s=(t.server_start + FIRST_START_S_PER_GIB * largest / GIB)
        * (1 + CONCURRENT_START_SHARE * (together - 1)),
        start=Limit(t.server_start, START_TIMES),
        request=Limit(t.request, REQUEST_TIMES),
        engine_run=Limit(t.engine_run, ENGINE_RUN_TIMES),
        reference=Limit(t.reference, REFERENCE_TIMES),
        load=Limit(t.load, LOAD_TIMES),
        tiny_s=draw.limit_s if draw is not None else t.tiny,
        server_stop_s=t.server_stop,
        total_s=t.total,
    )
    from .distribution import first_token_prompts

    per_length = FIRST_TOKENS_PER_LENGTH_QUICK if quick else FIRST_TOKENS_PER_LENGTH
    prompts = {
        "lossless": 0 if quick else len(LOSSLESS_PROMPTS),
        "prefix_tokens": 0 if quick else PREFIX_PROMPT_TOKENS,
        "fidelity_lengths": list(FIDELITY_LENGTHS) if fidelity else [],
        "first_tokens": {
            p["name"]: p["length"]
            for p in first_token_prompts(engine.num_speculative_tokens, per_length)
        },
        "first_tokens_per_length": per_length,
    }
    return SmokePlan(
        workdir=workdir,
        mode=Mode.QUICK if quick else Mode.FULL,
        layout=layout,
        why=why,
        gpus=gpus,
        pair=pair.to_json(),
        target=target,
        drafter=drafter,
        target_info=target_info,
        engine=engine,
        steps=tuple(steps),
        deadlines=deadlines,
        reference=reference,
        checks=_checks(config),
        prompts=prompts,
    )


def _place_all(engines: list[_Engine], board: list[_Gpu]) -> bool:
    """Every engine on the board at once (wave 1); False, board untouched, when one does not fit."""
    placed: list[tuple[_Engine, tuple[int, ...]]] = []
    for e in sorted(engines, key=lambda e: -e.need * e.tp):
        where = _fit(board, e.need, e.tp, set())
        if where is None:
            for other, gpus in placed:
                for i in gpus:
                    board[i].used -= other.need
            return False
        for i in where:
            board[i].used += e.need
        placed.append((e, where))
    for e, where in placed:
        e.gpus, e.wave = where, 1
    return True


def _place_in_turn(engines: list[_Engine], count: int, usable: int, share: bool) -> None:
    """Waves in the engines' order: an engine joins the current wave where its GPUs still
    hold it (``share``: beside the wave's others; else only on a GPU of its own), else it
    opens the next wave."""
    wave, board = 1, [_Gpu(usable) for _ in range(count)]
    for e in engines:
        need = e.need if share else usable
        where = _fit(board, need, e.tp, set())
        if where is None:
            wave, board = wave + 1, [_Gpu(usable) for _ in range(count)]
            where = _fit(board, need, e.tp, set())
            assert where is not None  # every engine fits an empty board (checked before)
        for i in where:
            board[i].used += need
        e.gpus, e.wave = where, wave


_REFERENCE_INPUTS = (Role.ENGINE, Role.SERVE_DFLASH, Role.SERVE_PLAIN)


def _plan_reference(
    config: SmokeConfig,
    pair: PairFacts,
    gpus: GpuFacts,
    engines: list[_Engine],
    board: list[_Gpu] | None,
    need: int,
    python: str,
    workdir: Path,
    share: bool = True,
) -> tuple[ReferencePlan, Step | None]:
    """Where the reference comparison runs: beside the engines when it fits there (it
    loads while they run); in waves, in the first wave that leaves it room on a GPU (or,
    without ``share``, --sequential, a GPU free then), counting from the last of the
    in-process engine's and the two servers' waves; else after the engines."""
    all_prompts = tuple(range(len(FIDELITY_LENGTHS)))
    if not config.run_fidelity or config.quick:
        why = "not in --quick (one engine start)" if config.run_fidelity else "--no-fidelity"
        return ReferencePlan("not run", 0, (), why), None
    usable = gpus.usable_bytes
    argv = _argv(
        python, REFERENCE_MODULE, workdir, "engine-reference-setup.json", "engine-fidelity-0.json"
    )
    last = max(e.wave for e in engines)
    if board is not None:
        where = _fit(board, need, 1, set())
        if where is not None:
            shards = _copies_in(board[where[0]].free, need)
            board[where[0]].used += shards * need
            step = Step(
                "reference comparison (engine)",
                Role.REFERENCE,
                1,
                where,
                argv,
                need,
                processes=shards,
                loads_before_the_engine=True,
            )
            return ReferencePlan(
                "beside the engines",
                shards,
                all_prompts,
                f"{_copies(shards)} beside the engines",
            ), step
    else:
        # It loads while its wave's engines start and compares the in-process engine's
        # proposals; check 1's margins are at the servers' first differences, which it takes
        # once the wave is over: no wave before all three have run.
        needs = {e.wave for e in engines if e.role in _REFERENCE_INPUTS}
        for wave in range(max(needs), last + 1):
            held = [_Gpu(usable) for _ in range(gpus.count)]
            for e in engines:
                if e.wave == wave:
                    for i in e.gpus:
                        held[i].used += e.need if share else usable
            where = _fit(held, need, 1, set())
            if where is None:
                continue
            gpu = held[where[0]]
            shards = _copies_in(gpu.free, need)
            step = Step(
                "reference comparison (engine)",
                Role.REFERENCE,
                wave,
                where,
                argv,
                need,
                processes=shards,
                loads_before_the_engine=True,
            )
            if gpu.used == 0:
                return ReferencePlan(
                    "own GPU", shards, all_prompts, f"GPU {where[0]} is free in wave {wave}"
                ), step
            return ReferencePlan(
                "beside the engines",
                shards,
                all_prompts,
                f"{_copies(shards)} beside wave {wave}'s engines on GPU {where[0]}",
            ), step
    # After the engines, alone.
    wave = last + 1
    shards = _copies_in(usable, need)
    if 2 * pair.target.weight_bytes > usable:
        prompts = all_prompts[:REFERENCE_SUBSET]
        why = (
            f"the target ({pair.target.weight_bytes / GIB:.1f} GiB) is too large to hold twice "
            f"on one GPU ({usable / GIB:.1f} GiB usable): it runs after the engines, on "
            f"{len(prompts)} of the {len(all_prompts)} fidelity prompts"
        )
    else:
        prompts = all_prompts
        why = "it does not fit beside the engines: it runs after them"
    step = Step(
        "reference comparison (engine)", Role.REFERENCE, wave, (0,), argv, need, processes=shards
    )
    return ReferencePlan("after the engines", shards, prompts, why), step


def _copies_in(free: int, need: int) -> int:
    """How many reference processes a GPU with ``free`` bytes runs: as many copies of the
    pair as fit, at most REFERENCE_SHARDS, and one where the placement has made room for one."""
    return max(1, min(REFERENCE_SHARDS, free // need))


def _copies(shards: int) -> str:
    return "1 copy of the pair fits" if shards == 1 else f"{shards} copies of the pair fit"


def _warm_steps(
    engines: list[_Engine], ref: Step | None, gpus: GpuFacts, python: str, workdir: Path
) -> list[Step]:
    """Check 7's runs before the rest: the other build's in-process engine (A), then this
    one's (B), each on GPU 0 in a fresh shared compile cache and each with its reference:
    beside it where a GPU holds that, as many copies as fit there, else in a wave of its
    own after it."""
    (engine,) = [e for e in engines if e.role == Role.ENGINE]
    steps: list[Step] = []
    wave = 0
    for run in ("warm-A", "warm-B"):
        wave += 1
        argv = _argv(python, ENGINE_MODULE, workdir, f"{run}-in.json", f"{run}.json")
        steps.append(
            Step(
                f"in-process engine ({run})",
                Role.ENGINE,
                wave,
                (0,),
                argv,
                engine.need,
                engine.kv,
                run=run,
            )
        )
        if ref is None:
            continue
        board = [_Gpu(gpus.usable_bytes) for _ in range(gpus.count)]
        board[0].used = engine.need
        where = _fit(board, ref.memory_bytes, 1, set())
        beside = where is not None
        if where is None:
            wave += 1
            board = [_Gpu(gpus.usable_bytes) for _ in range(gpus.count)]
            where = _fit(board, ref.memory_bytes, 1, set())
            assert where is not None  # one copy fits an empty GPU (checked before)
        shards = _copies_in(board[where[0]].free, ref.memory_bytes)
        argv = _argv(
            python,
            REFERENCE_MODULE,
            workdir,
            f"{run}-reference-setup.json",
            f"{run}-fidelity-0.json",
        )
        steps.append(
            replace(
                ref,
                name=f"reference comparison ({run})",
                wave=wave,
                gpus=where,
                argv=argv,
                run=run,
                processes=shards,
                loads_before_the_engine=beside,
            )
        )
    return steps


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
