"""``tooling smoke``: serve a target with a DFlash drafter on a GPU host and check every fix at
run time (stage: ``tooling.smoke``)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..errors import SmokeError
from .options import FiniteRange, emit, json_option, settings_of

if TYPE_CHECKING:
    from ..smoke import SmokeConfig
    from .smoke_request import SmokeRequest


@click.command("smoke")
@click.option("--tiny", is_flag=True, help="Generate a seeded tiny target, tokenizer and drafter.")
@click.option("--target", help="Target model: a local folder or a hub id.")
@click.option("--drafter", help="DFlash drafter: a local folder or a hub id.")
@click.option(
    "--wheel",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="pip-install this vLLM wheel (no deps) and smoke-test it.",
)
@click.option(
    "--workdir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Where models, logs and the report go (default: build/smoke/<time>).",
)
@click.option(
    "--expect",
    type=click.Choice(["fixed", "stock"]),
    default="fixed",
    show_default=True,
    help="stock: a negative control (checks 2-5 must fail).",
)
# Every step yields at least one token, so a floor of 1 or less could not fail.
@click.option("--min-acceptance-length", type=FiniteRange(min=1.0, min_open=True))
@click.option(
    "--fidelity-gate",
    type=FiniteRange(min=0.0, max=1.0, min_open=True),
    default=0.99,
    show_default=True,
)
@click.option("--no-fidelity", is_flag=True, help="Skip the in-process reference comparison.")
# K is at most a drafter block less one: past any block, a prompt of K + 2 tokens to build.
@click.option(
    "--num-speculative-tokens", type=click.IntRange(min=1, max=1024), default=3, show_default=True
)
@click.option(
    "--gpu-memory-utilization",
    type=FiniteRange(min=0.0, max=1.0, min_open=True),
    default=0.3,
    show_default=True,
)
@click.option(
    "--kv-cache-memory-bytes",
    type=click.IntRange(min=1),
    help="Fixed KV-cache size per engine, no memory profiling (for runs sharing a GPU).",
)
@click.option(
    "--time-limit",
    # A week: past any run's, and a deadline every clock and timer still holds.
    type=FiniteRange(min=0.0, max=7 * 86400, min_open=True),
    help="Seconds for the whole run (default: none; every step has its own limit, "
    "scaled to the first engine's measured start).",
)
@click.option(
    "--tiny-arch",
    type=click.Choice(["hybrid", "seed", "qwen3"]),
    default="hybrid",
    show_default=True,
    help="--tiny target: Qwen3.5/3.6-family hybrid, the seed-shaped hybrid (Qwen3.6-27B's "
    "depth and heads, hidden width narrowed), or attention-only Qwen3.",
)
@click.option(
    "--tiny-hidden-size",
    type=click.IntRange(min=1),
    help="With --tiny-arch seed: the hidden width (5120 is the seed's own).",
)
@click.option(
    "--quick",
    is_flag=True,
    help="Only the checks one start of the engines answers (aux layers, windows, slot audit, "
    "first tokens of K..K+2-token prompts): a yes/no in one start.",
)
@click.option(
    "--gpus",
    metavar="COUNTxGIB",
    help="Plan for these GPUs (e.g. 2x141) instead of those the serving interpreter sees.",
)
@click.option(
    "--speculative-option",
    "speculative_options",
    multiple=True,
    metavar="KEY=VALUE",
    callback=lambda _ctx, _param, values: speculative_options(values),
    help="One more key of every DFlash engine's --speculative-config, VALUE read as JSON "
    '(true, 4, "text"), e.g. dflash_full_cudagraphs=false (repeatable).',
)
@click.option("--enforce-eager", is_flag=True, help="Eager mode (default: compiled + CUDA graphs).")
@click.option("--kv-cache-dtype", default="auto", show_default=True, help="e.g. fp8.")
@click.option("--tensor-parallel-size", type=click.IntRange(min=1), default=1, show_default=True)
@click.option(
    "--disable-custom-all-reduce",
    is_flag=True,
    help="The servers use NCCL's all-reduce (0.20.1's custom one faults at TP=2 on a hybrid "
    "target with DFlash, stock and patched alike).",
)
@click.option(
    "--distributed-executor-backend",
    type=click.Choice(["mp", "ray"]),
    help="The DFlash server's executor (default: vLLM's choice, mp on one host); ray starts "
    "a Ray instance for it. The plain server keeps vLLM's choice; the in-process engines run "
    "at TP 1 without one.",
)
@click.option("--no-load", is_flag=True, help="Skip the concurrent bursts against the servers.")
@click.option("--no-audit", is_flag=True, help="Skip the concurrent audited in-process batch.")
@click.option(
    "--warm-cache",
    is_flag=True,
    help="Check 7: another build compiles into the cache first (--stock-site/--stock-wheel).",
)
@click.option(
    "--stock-site",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    help="A folder where another vLLM build is installed (pip --target), for --warm-cache.",
)
@click.option(
    "--stock-wheel",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="Another vLLM wheel to install (no deps) for --warm-cache.",
)
@click.option(
    "--sequential",
    is_flag=True,
    help="Start the engines one after another (default: side by side when they fit the "
    "GPUs at once, each with a fixed KV cache).",
)
@click.option(
    "--dry-run", is_flag=True, help="Print the plan a run would execute, starting no engine."
)
@click.option(
    "--trained",
    is_flag=True,
    help="Acceptance table on the trained pair (trains it when not cached).",
)
@click.option(
    "--trained-hybrid",
    is_flag=True,
    help="On the hybrid recipe's trained pair (trained when not cached): acceptance at each "
    "K, one request at a time and 16 at once, the strict lossless check alone and under "
    "load, and decode speed; needs --engine for patched, stock and each no-<patch> ablation "
    "(patches 1-3 and 12).",
)
@click.option(
    "--engine",
    "engines",
    multiple=True,
    metavar="NAME=DIR",
    help="With --trained or --trained-hybrid: a vLLM install to measure (repeatable).",
)
@json_option
@click.pass_context
def smoke_command(ctx: click.Context, **options: Any) -> None:
    """Serve a target with a DFlash drafter on a GPU and check every fix at run time."""
    from .smoke_request import smoke_requested

    settings = settings_of(ctx)
    asked = SmokeOptions(**options)
    outcome = smoke_requested(
        asked.request(settings.cache.root),
        notify=None if settings.json else lambda m: click.echo(m, err=True),
    )
    emit(settings, outcome.data, outcome.text)
    if outcome.failure is not None:
        raise SmokeError(outcome.failure)


#: The keys the smoke sets itself in every DFlash engine's ``speculative_config``.
OWN_KEYS = {
    "method": "",
    "model": "--drafter",
    "num_speculative_tokens": "--num-speculative-tokens",
}


def speculative_options(values: tuple[str, ...]) -> tuple[tuple[str, Any], ...]:
    """``--speculative-option``'s KEY=VALUE pairs, each VALUE as JSON where it reads as JSON
    (``true``, ``4``), else as text; a key the smoke sets itself is refused, naming it."""
    pairs: dict[str, Any] = {}
    for value in values:
        key, sep, text = value.partition("=")
        if not sep or not key.isidentifier():
            raise click.BadParameter(f"{value!r}: not KEY=VALUE with KEY a config key")
        if key in OWN_KEYS:
            own = f" (give {OWN_KEYS[key]})" if OWN_KEYS[key] else ""
            raise click.BadParameter(f"{key}: the smoke sets it itself{own}")
        try:
            pairs[key] = json.loads(text)
        except ValueError:
            pairs[key] = text
    return tuple(pairs.items())


@dataclass(frozen=True)
class SmokeOptions:
    """The command's options as typed (each field one option's parameter)."""

    tiny: bool
    target: str | None
    drafter: str | None
    wheel: Path | None
    workdir: Path | None
    expect: str
    min_acceptance_length: float | None
    fidelity_gate: float
    no_fidelity: bool
    num_speculative_tokens: int
    speculative_options: tuple[tuple[str, Any], ...]
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None
    time_limit: float | None
    tiny_arch: str
    tiny_hidden_size: int | None
    quick: bool
    gpus: str | None
    enforce_eager: bool
    kv_cache_dtype: str
    tensor_parallel_size: int
    disable_custom_all_reduce: bool
    distributed_executor_backend: str | None
    no_load: bool
    no_audit: bool
    warm_cache: bool
    stock_site: Path | None
    stock_wheel: Path | None
    sequential: bool
    dry_run: bool
    trained: bool
    trained_hybrid: bool
    engines: tuple[str, ...]

    def config(self) -> SmokeConfig:
        """The run's settings (the workdir resolved, by default one per start time)."""
        from ..smoke import EngineSettings, GpuFacts, SmokeConfig, Timeouts

        workdir = self.workdir or Path("build") / "smoke" / time.strftime("%Y%m%d-%H%M%S")
        return SmokeConfig(
            workdir=workdir.resolve(),
            target=self.target,
            drafter=self.drafter,
            tiny=self.tiny,
            engine=EngineSettings(
                num_speculative_tokens=self.num_speculative_tokens,
                speculative_options=self.speculative_options,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                enforce_eager=self.enforce_eager,
                kv_cache_dtype=self.kv_cache_dtype,
                tensor_parallel_size=self.tensor_parallel_size,
                disable_custom_all_reduce=self.disable_custom_all_reduce,
                distributed_executor_backend=self.distributed_executor_backend,
            ),
            timeouts=Timeouts(total=self.time_limit),
            fidelity_gate=self.fidelity_gate,
            min_acceptance_length=self.min_acceptance_length,
            run_fidelity=not self.no_fidelity,
            expect=self.expect,
            tiny_arch=self.tiny_arch,
            tiny_hidden_size=self.tiny_hidden_size,
            quick=self.quick,
            gpus=GpuFacts.parse(self.gpus) if self.gpus else None,
            load=not self.no_load,
            audit=not self.no_audit,
            warm_cache=self.warm_cache,
            other_site=str(self.stock_site.resolve()) if self.stock_site else None,
            overlap_engines=False if self.sequential else None,
        )

    def request(self, cache_dir: Path) -> SmokeRequest:
        from .smoke_request import SmokeRequest

        return SmokeRequest(
            config=self.config(),
            cache_dir=cache_dir,
            wheel=self.wheel,
            stock_wheel=self.stock_wheel,
            trained=self.trained,
            trained_hybrid=self.trained_hybrid,
            engines=self.engines,
            dry_run=self.dry_run,
        )
