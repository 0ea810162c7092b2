"""Where the reference comparison runs: beside the engines, on a GPU free in a wave, or after
the engines; and check 7's runs, each in-process engine with its reference."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..config import (
    FIDELITY_LENGTHS,
    REFERENCE_SHARDS,
    GpuFacts,
    SmokeConfig,
)
from ..pair import GIB, PairFacts
from .memory import Gpu, PlannedEngine, fit
from .model import ENGINE_MODULE, REFERENCE_MODULE, ReferencePlan, Role, Step, child_argv

#: Fidelity prompts the reference compares when the target is too large to hold twice on
#: one GPU: it then runs alone after the engines, and fewer prompts bound its time.
REFERENCE_SUBSET = 2


_REFERENCE_INPUTS = (Role.ENGINE, Role.SERVE_DFLASH, Role.SERVE_PLAIN)


def plan_reference(
    config: SmokeConfig,
    pair: PairFacts,
    gpus: GpuFacts,
    engines: list[PlannedEngine],
    board: list[Gpu] | None,
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
    argv = child_argv(
        python, REFERENCE_MODULE, workdir, "engine-reference-setup.json", "engine-fidelity-0.json"
    )
    last = max(e.wave for e in engines)
    if board is not None:
        where = fit(board, need, 1, set())
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
            held = [Gpu(usable) for _ in range(gpus.count)]
            for e in engines:
                if e.wave == wave:
                    for i in e.gpus:
                        held[i].used += e.need if share else usable
            where = fit(held, need, 1, set())
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


def warm_steps(
    engines: list[PlannedEngine], ref: Step | None, gpus: GpuFacts, python: str, workdir: Path
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
        argv = child_argv(python, ENGINE_MODULE, workdir, f"{run}-in.json", f"{run}.json")
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
        board = [Gpu(gpus.usable_bytes) for _ in range(gpus.count)]
        board[0].used = engine.need
        where = fit(board, ref.memory_bytes, 1, set())
        beside = where is not None
        if where is None:
            wave += 1
            board = [Gpu(gpus.usable_bytes) for _ in range(gpus.count)]
            where = fit(board, ref.memory_bytes, 1, set())
            assert where is not None  # one copy fits an empty GPU (checked before)
        shards = _copies_in(board[where[0]].free, ref.memory_bytes)
        argv = child_argv(
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
