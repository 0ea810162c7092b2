"""The production smoke's variants (``production-smoke.sh VARIANT``) as data: what each adds
to ``tooling smoke``, and which sites and folders it needs."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

#: The seed-shaped pair at K = 15.
SEED = ("--tiny-arch", "seed", "--num-speculative-tokens", "15")
#: Patch 22's full CUDA graphs of the drafter's uniform pass, the fixed wheel's default,
#: turned off: the way a user who sets the option false is served is checked too.
NO_GRAPHS = ("--speculative-option", "dflash_full_cudagraphs=false")
#: Patch 40's option: a decode step's drafter replays one graph of its whole step. Off by
#: default until the smoke's fidelity check has compared its drafts with the reference's.
STEP_GRAPHS = ("--speculative-option", "dflash_step_graphs=true")
#: 0.20.1's custom all-reduce faults capturing a hybrid DFlash server's graphs at TP=2
#: (stock too): the servers use NCCL's (docs/serving.md, "Two GPUs: TP=2").
TP2 = ("--tensor-parallel-size", "2", "--disable-custom-all-reduce")
#: The DFlash server starts a Ray instance of its own; its workers inherit the server's
#: environment (NCCL_NVLS_ENABLE=0 among it).
RAY = ("--distributed-executor-backend", "ray")


class Site(StrEnum):
    """Which vLLM a variant's smoke imports first."""

    PATCHED = "patched"
    STOCK = "stock"


#: Placeholders in a variant's options, filled from its settings (``smoke_args``).
STOCK_SITE, PATCHED_FIRST, PAIR = "{stock_site}", "{patched_first}", "{pair}"


@dataclass(frozen=True)
class Variant:
    """One production smoke variant: its ``tooling smoke`` options (with the placeholders
    above), the site its smoke imports vLLM from first, what it needs set."""

    name: str
    args: tuple[str, ...] = ()
    site: Site = Site.PATCHED
    stock_needed: bool = False
    """STOCK_SITE is read (the stock runs, or the warm cache's other wheel)."""
    pair: bool = False
    """The pair in PAIR (--target/--drafter) instead of a generated --tiny one."""


WARM = ("--warm-cache", "--stock-site")
VARIANTS = {
    v.name: v
    for v in (
        Variant("default"),
        Variant("eager", ("--enforce-eager",)),
        Variant("qwen3", ("--tiny-arch", "qwen3")),
        Variant("warm", (*WARM, STOCK_SITE, "--no-load", "--no-audit"), stock_needed=True),
        Variant("stock", ("--expect", "stock", "--no-load"), Site.STOCK, stock_needed=True),
        Variant(
            "stock-warm",
            ("--expect", "stock", *WARM, PATCHED_FIRST, "--no-load", "--no-audit"),
            Site.STOCK,
            stock_needed=True,
        ),
        Variant("fp8", ("--kv-cache-dtype", "fp8")),
        Variant("tp2", TP2),
        Variant("ray", (*SEED, *RAY)),
        Variant("ray-tp2", (*SEED, *TP2, *RAY)),
        Variant("seed", SEED),
        Variant("no-drafter-graphs", NO_GRAPHS),
        Variant("seed-no-graphs", (*SEED, *NO_GRAPHS)),
        Variant("step-graphs", STEP_GRAPHS),
        Variant("seed-step-graphs", (*SEED, *STEP_GRAPHS)),
        Variant("seed-full", ("--tiny-arch", "seed", "--tiny-hidden-size", "5120", *SEED[2:])),
        Variant(
            "pair",
            ("--target", f"{PAIR}/target", "--drafter", f"{PAIR}/drafter", *SEED[2:]),
            pair=True,
        ),
        Variant("quick", ("--quick",)),
    )
}


@dataclass(frozen=True)
class SmokeSettings:
    """What a production smoke is given, besides its variant (the scripts' environment)."""

    patched_site: str
    stock_site: str | None = None
    pair: str | None = None
    time_limit: int | None = None
    kv_cache_memory_bytes: str | None = None
    gpu_memory_utilization: str | None = None
    more: tuple[str, ...] = ()
    """SMOKE_ARGS: more ``tooling smoke`` options for any variant."""


def smoke_args(variant: Variant, settings: SmokeSettings) -> list[str]:
    """The ``tooling smoke`` options of ``variant`` (the workdir and --json apart)."""
    args = [] if variant.pair else ["--tiny"]
    if settings.time_limit is not None:
        args += ["--time-limit", str(settings.time_limit)]
    if settings.kv_cache_memory_bytes:
        args += ["--kv-cache-memory-bytes", settings.kv_cache_memory_bytes]
    if settings.gpu_memory_utilization:
        args += ["--gpu-memory-utilization", settings.gpu_memory_utilization]
    values = {
        STOCK_SITE: settings.stock_site or "",
        PATCHED_FIRST: settings.patched_site.split(":")[0],
        PAIR: settings.pair or "",
    }
    for arg in variant.args:
        for placeholder, value in values.items():
            arg = arg.replace(placeholder, value)
        args.append(arg)
    return [*args, *settings.more]


def smoke_site(variant: Variant, settings: SmokeSettings) -> str:
    """The PYTHONPATH of ``variant``'s smoke: stock before the patched site's dependencies."""
    if variant.site is Site.STOCK:
        return f"{settings.stock_site}:{settings.patched_site}"
    return settings.patched_site
