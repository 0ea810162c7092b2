"""The smokes on the GPU host: one production variant (``production-smoke.sh``), several at
once on one GPU (``production-smoke-all.sh``), the tiny pair on patched and stock at once
(``smoke-pair.sh``) and the trained drafter's acceptance over every engine
(``acceptance.sh``)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import SmokeError
from ..smoke_summary import summary_lines
from .layout import (
    PYTHON,
    Child,
    Layout,
    Modules,
    left_running,
    run,
    run_together,
    running,
    say,
    since,
    tail,
    written,
)
from .variants import SmokeSettings, Variant, smoke_args, smoke_site

logger = logging.getLogger(__name__)

#: What a smoke leaves behind if it leaves anything: vLLM's servers, the smoke, Ray.
LEFT_BEHIND = "vllm.entrypoints|tooling.smoke|raylet|gcs_server|ray::"
#: Past the smoke's own limit: SIGTERM makes it stop its children (no report then).
BACKSTOP_S = 40
#: The smoke command every host smoke runs.
SMOKE = (PYTHON, "-m", Modules.TOOLING, "--no-progress", "smoke")


def check_table(document: Path, err: Path) -> None:
    """The check table of a smoke's JSON; one line, then the smoke's own last lines, when it
    wrote none."""
    try:
        lines = summary_lines(document)
    except SmokeError as e:
        logger.error("error: %s", e)
        lines = tail(err, 3)
    for line in lines:
        say(line)


def production_smoke(
    variant: Variant, settings: SmokeSettings, layout: Layout, out: Path, *, shared_gpu: bool
) -> int:
    """One variant into ``out``: its JSON, its stderr, its workdir; its check table
    printed; its exit status."""
    logger.debug("step: production smoke %s into %s", variant.name, out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [*SMOKE, *smoke_args(variant, settings)]
    cmd += ["--workdir", str(out / variant.name), "--json"]
    limit = None if settings.time_limit is None else settings.time_limit + BACKSTOP_S
    start = time.monotonic()
    document, err = out / f"{variant.name}.json", out / f"{variant.name}.err"
    with written(document) as stdout, written(err) as stderr:
        code = run(
            cmd,
            env=layout.env(smoke_site(variant, settings)),
            stdout=stdout,
            stderr=stderr,
            limit_s=limit,
        )
    say(
        f"production smoke {variant.name}: exit {code} in {since(start)}s (report "
        f"{out}/{variant.name}/report.json, logs {out}/{variant.name}/logs)"
    )
    check_table(document, err)
    # Nothing may be left running: list any vLLM or Ray process this run left behind.
    if not shared_gpu and (left := left_running(LEFT_BEHIND)):
        say(left)
    return code


@dataclass(frozen=True)
class SharedSettings:
    """``production-smoke-all.sh``: the variants sharing one GPU, under one deadline."""

    variants: tuple[str, ...] = ("default", "stock", "fp8")
    time_limit: int = 500
    #: vLLM 0.20.1's start-up memory profiling asserts when a neighbour frees GPU memory
    #: meanwhile; a fixed KV cache skips it.
    kv_cache_memory_bytes: str = str(4 << 30)
    #: Then only the free memory an engine needs to start: at most one engine per variant
    #: runs at a time.
    gpu_memory_utilization: str = "0.1"


def production_smoke_all(
    shared: SharedSettings, layout: Layout, out: Path, patched_site: str, stock_site: str
) -> int:
    """Each variant in a child of its own (``tooling host smoke``), all at once; every check
    table at the end; the worst exit status."""
    logger.debug("step: production smokes %s at once", " ".join(shared.variants))
    out.mkdir(parents=True, exist_ok=True)
    env = layout.env(
        None,
        OUT=str(out),
        PATCHED_SITE=patched_site,
        STOCK_SITE=stock_site,
        TIME_LIMIT=str(shared.time_limit),
        SHARED_GPU="1",
        KV_CACHE_MEMORY_BYTES=shared.kv_cache_memory_bytes,
        GPU_MEMORY_UTILIZATION=shared.gpu_memory_utilization,
    )
    start = time.monotonic()
    codes = run_together(
        [
            Child(
                (PYTHON, "-m", Modules.TOOLING, "host", "smoke", "--", name),
                env,
                out / f"{name}.summary",
            )
            for name in shared.variants
        ]
    )
    say(f"all variants done in {since(start)}s")
    for name in shared.variants:
        say(f"=== {name}")
        say((out / f"{name}.summary").read_text(errors="replace").rstrip("\n"))
    # Nothing may be left running once every variant has stopped.
    if left := left_running("vllm.entrypoints|tooling.smoke"):
        say(left)
    return max(codes, default=0)


def smoke_pair(layout: Layout) -> None:
    """``tooling smoke --tiny`` on the patched and on the stock install at once."""
    logger.debug("step: tiny smokes on patched and stock")
    expected = {"patched": "fixed", "stock": "stock"}
    children = [
        Child(
            (
                *SMOKE,
                "--tiny",
                "--expect",
                expect,
                "--workdir",
                str(layout.work / f"smoke-{name}"),
                "--gpu-memory-utilization",
                "0.1",
                "--json",
            ),
            layout.env(f"{layout.engine(name)}:{layout.site}"),
            layout.work / f"smoke-{name}.json",
            layout.work / f"smoke-{name}.err",
        )
        for name, expect in expected.items()
    ]
    codes = run_together(children)
    for (name, expect), code in zip(expected.items(), codes, strict=True):
        say(f"smoke {name} (expect {expect}): exit {code}")


def acceptance(layout: Layout, wait_s: int) -> None:
    """Wait (at most ``wait_s``) for the recipe's summary while the recipe runs, then
    ``tooling smoke --trained`` over every engine installed."""
    logger.debug("step: acceptance over %s", layout.engines)
    summary = layout.work / "train-out" / "summary.json"
    limit = wait_s
    while not summary.is_file() and limit > 0 and running(Modules.TRAINER):
        time.sleep(5)
        limit -= 5
    for line in tail(layout.work / "train.log", 5):
        say(line)
    engines = sorted(p for p in layout.engines.glob("*/") if p.is_dir())
    pairs = [word for e in engines for word in ("--engine", f"{e.name}={e}")]
    cmd = [*SMOKE, "--trained", "--workdir", str(layout.work / "accept"), *pairs]
    say(f"acceptance: exit {run(cmd, env=layout.env(str(layout.site)))}")
