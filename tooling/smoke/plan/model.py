"""The plan's data: what each step is (``Role``), the steps, the reference's placement, the
whole ``SmokePlan`` as JSON and, for people, ``render``; and the child processes' modules and
command lines the steps run."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from .. import checks
from ..config import (
    EngineSettings,
    GpuFacts,
    TargetInfo,
)
from ..pair import GIB
from .deadlines import Deadlines

TINY_MODULE = "tooling.smoke.serving.tiny"
ENGINE_MODULE = "tooling.smoke.serving.engine_run"
FIRST_TOKENS_MODULE = "tooling.smoke.serving.distribution"
REFERENCE_MODULE = "tooling.smoke.serving.reference"


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
    if plan.engine.speculative_options:
        more = ", ".join(f"{k}={json.dumps(v)}" for k, v in plan.engine.speculative_options)
        lines.append(f"every DFlash engine's --speculative-config adds: {more}")
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


def child_argv(
    python: str, module: str, workdir: Path, request: str, result: str
) -> tuple[str, ...]:
    """``python -m module REQUEST RESULT``: a child of the JSON protocol (``serving.child``)."""
    return (python, "-m", module, str(workdir / request), str(workdir / result))
