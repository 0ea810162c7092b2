"""GPU memory: what each engine and reference process needs, and where they fit.

Every engine gets a fixed KV cache (``kv_cache_memory_bytes``) sized from the pair's KV
figures, since engines sharing a GPU must not profile memory while a neighbour starts or stops
(vLLM 0.20.1 asserts then). When every engine fits the GPUs at once they start side by side
(one start's wait for all); otherwise they run in waves, as many at a time as the GPUs hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...errors import SmokeCapacityError
from ..config import (
    EngineSettings,
    GpuFacts,
    SmokeConfig,
)
from ..pair import GIB, PairFacts
from .model import Layout, Role

#: What an engine needs beyond its weights and KV cache: CUDA context, compiled graphs,
#: activations. A fixed part and a share of the weights (larger models, larger buffers).
ENGINE_OVERHEAD_BYTES = 3 * GIB
ENGINE_OVERHEAD_SHARE = 0.05
REFERENCE_OVERHEAD_BYTES = 2 * GIB
#: A generated pair past this size is drawn in bf16 on the GPU (``tiny --device cuda``):

#: The smallest fixed KV cache an engine gets (what the tiny pairs start with).
MIN_KV_CACHE_BYTES = 4 * GIB
#: Room left for the sizes this plan cannot see (allocator slack, other tenants).
KV_MARGIN = 1.1


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
class Gpu:
    usable: int
    used: int = 0

    @property
    def free(self) -> int:
        return self.usable - self.used


@dataclass
class PlannedEngine:
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


def fit(gpus: list[Gpu], need: int, count: int, exclude: set[int]) -> tuple[int, ...] | None:
    """``count`` GPUs with ``need`` free, the freest first (spreads the engines); None if not."""
    ready = sorted(
        (i for i, g in enumerate(gpus) if i not in exclude and g.free >= need),
        key=lambda i: (-gpus[i].free, i),
    )
    return tuple(sorted(ready[:count])) if len(ready) >= count else None


def place_all(engines: list[PlannedEngine], board: list[Gpu]) -> bool:
    """Every engine on the board at once (wave 1); False, board untouched, when one does not fit."""
    placed: list[tuple[PlannedEngine, tuple[int, ...]]] = []
    for e in sorted(engines, key=lambda e: -e.need * e.tp):
        where = fit(board, e.need, e.tp, set())
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


def place_in_turn(engines: list[PlannedEngine], count: int, usable: int, share: bool) -> None:
    """Waves in the engines' order: an engine joins the current wave where its GPUs still
    hold it (``share``: beside the wave's others; else only on a GPU of its own), else it
    opens the next wave."""
    wave, board = 1, [Gpu(usable) for _ in range(count)]
    for e in engines:
        need = e.need if share else usable
        where = fit(board, need, e.tp, set())
        if where is None:
            wave, board = wave + 1, [Gpu(usable) for _ in range(count)]
            where = fit(board, need, e.tp, set())
            assert where is not None  # every engine fits an empty board (checked before)
        for i in where:
            board[i].used += need
        e.gpus, e.wave = where, wave


def refuse_what_does_not_fit(
    engines: list[PlannedEngine], gpus: GpuFacts, tp: int, ref_need: int, config: SmokeConfig
) -> None:
    """SmokeCapacityError, one line naming the figures, when an engine (or the reference
    comparison the run makes) does not fit one GPU's usable memory."""
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
    if config.run_fidelity and not config.quick and ref_need > usable:
        raise SmokeCapacityError(
            f"the reference comparison needs {ref_need / GIB:.1f} GiB on one GPU (both models "
            f"in {config.reference_dtype}); a GPU here has {usable / GIB:.1f} GiB usable: "
            "pass --no-fidelity"
        )


@dataclass(frozen=True)
class Placement:
    layout: Layout
    why: str
    board: list[Gpu] | None
    """Side by side: what the engines left free on each GPU; None in waves."""


def place(engines: list[PlannedEngine], gpus: GpuFacts, overlap: bool | None) -> Placement:
    """The engines placed side by side when every one fits at once (and ``overlap`` is not
    False), else one after another; each engine's ``gpus`` and ``wave`` set."""
    usable = gpus.usable_bytes
    board = [Gpu(usable) for _ in range(gpus.count)]
    if overlap is not False and place_all(engines, board):
        why = (
            f"all {len(engines)} engines fit at once "
            f"({sum(e.need * e.tp for e in engines) / GIB:.1f} GiB of "
            f"{gpus.count * usable / GIB:.1f} GiB usable): one start's wait for all"
        )
        return Placement(Layout.SIDE_BY_SIDE, why, board)
    asked = overlap is False
    place_in_turn(engines, gpus.count, usable, share=not asked)
    waves = max(e.wave for e in engines)
    if asked:
        why = "asked (--sequential): one engine a GPU at a time"
    else:
        why = (
            f"the {len(engines)} engines need "
            f"{sum(e.need * e.tp for e in engines) / GIB:.1f} GiB at once, more than the "
            f"{gpus.count * usable / GIB:.1f} GiB usable: as many at a time as the GPUs hold"
        )
    return Placement(Layout.ONE_AFTER_ANOTHER, why + f", in {waves} waves", None)
