"""``tooling host``: the GPU host's steps (``tooling.host``), one command each; ``ci/gpu``'s
scripts call them with ``--script`` and ``--usage``, so that a refusal names the script and
its usage line as the scripts always have. Every setting the steps read from the
environment (``$WORK``, ``$OUT``, ``$TIME_LIMIT`` ...) is read here."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any

import click

from ..errors import HostUsageError
from ..host import fuzz as fuzz_
from ..host import parts as parts_
from ..host import proof as proof_
from ..host import session as session_
from ..host import smoke as smoke_
from ..host import speed as speed_
from ..host import trained as trained_
from ..host.layout import (
    DEFAULT_WORK,
    Layout,
    absolute,
    optional_number,
    part_size,
    required,
    sites,
    whole_number,
)
from ..host.setup import SetupStep, ablations, check_parts, setup
from ..host.variants import VARIANTS, SmokeSettings
from .options import settings_of

#: ``ctx.meta`` key: the host's folders.
LAYOUT = "tooling.host.layout"
#: What a setting names, when a step refuses it unset.
OUT_BACK = "the folder this command brings back"
OUT_REPORTS = "the folder reports and logs go to"
PATCHED_WHAT = "the pip --target folder of the wheel under test"
STOCK_WHAT = "the pip --target folder of stock vLLM 0.20.1"


def env(name: str) -> str | None:
    """The setting ``name`` from the environment; unset or empty alike are None."""
    return os.environ.get(name) or None


@dataclass(frozen=True)
class Caller:
    """The script that called (``--script``) and its usage line (``--usage``)."""

    script: str | None
    usage: str | None

    def refusal(self, command: str | None, message: str, usage: bool) -> HostUsageError:
        name = self.script or f"tooling host {command or ''}".rstrip()
        shown = f" ({self.usage})" if usage and self.usage else ""
        # One line, as every refusal is: Click's own messages may run over several.
        return HostUsageError(f"{name}: {' '.join(message.split())}{shown}")


class HostGroup(click.Group):
    """Every refusal of an argument or setting is one line naming the script (or command)
    and, for an argument, its usage line; exit 2."""

    def invoke(self, ctx: click.Context) -> Any:
        caller = Caller(ctx.params.get("script"), ctx.params.get("usage"))
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            raise caller.refusal(ctx.invoked_subcommand, e.format_message(), True) from None
        except HostUsageError as e:
            raise caller.refusal(ctx.invoked_subcommand, e.message, e.usage) from None


@click.group("host", cls=HostGroup)
@click.option("--script", hidden=True, help="The ci/gpu script that calls.")
@click.option("--usage", hidden=True, help="Its usage line.")
@click.pass_context
def host_group(ctx: click.Context, script: str | None, usage: str | None) -> None:
    """The GPU host's steps: ci/gpu's scripts call these (docs/guide/gpu-steps.md).

    $WORK (default /tmp/dflash) holds everything a step writes on the host."""
    work = env("WORK")
    ctx.meta[LAYOUT] = Layout(absolute(work) if work else DEFAULT_WORK)


def layout_of(ctx: click.Context) -> Layout:
    layout: Layout = ctx.meta[LAYOUT]
    return layout


@host_group.command("setup")
@click.argument("parts")
@click.argument(
    "step", required=False, default="all", type=click.Choice([s.value for s in SetupStep])
)
@click.pass_context
def setup_command(ctx: click.Context, parts: str, step: str) -> None:
    """host-setup.sh: join PARTS, install the bundle, build every engine.

    ABLATIONS: the patch ids to build an ablation for (empty: none; unset: every patch of
    the series). PROBES=0: no probes of the patched build."""
    where, chosen = absolute(parts), SetupStep(step)
    check_parts(where, chosen)
    asked = os.environ.get("ABLATIONS")
    series = settings_of(ctx).series() if chosen is not SetupStep.INSTALL else None
    planned = ablations(series, None if asked is None else asked.split()) if series else []
    probe = None if env("PROBES") == "0" else shutil.which("python3") or "python3"
    setup(where, chosen, layout_of(ctx), planned, probe, series)


def smoke_settings() -> SmokeSettings:
    """production-smoke.sh's settings, checked, every path made absolute."""
    patched = sites(required("PATCHED_SITE", env("PATCHED_SITE"), PATCHED_WHAT))
    required("OUT", env("OUT"), OUT_REPORTS)
    limit = optional_number("TIME_LIMIT", env("TIME_LIMIT"))
    return SmokeSettings(
        patched_site=patched,
        stock_site=sites(stock) if (stock := env("STOCK_SITE")) else None,
        pair=str(absolute(pair)) if (pair := env("PAIR")) else None,
        time_limit=limit,
        kv_cache_memory_bytes=env("KV_CACHE_MEMORY_BYTES"),
        gpu_memory_utilization=env("GPU_MEMORY_UTILIZATION"),
        more=tuple((env("SMOKE_ARGS") or "").split()),
    )


@host_group.command("smoke")
@click.argument("variant", type=click.Choice(list(VARIANTS)))
@click.pass_context
def smoke_command(ctx: click.Context, variant: str) -> None:
    """production-smoke.sh: one production smoke VARIANT into $OUT.

    PATCHED_SITE, OUT; STOCK_SITE (warm, stock, stock-warm); PAIR (pair); TIME_LIMIT,
    KV_CACHE_MEMORY_BYTES, GPU_MEMORY_UTILIZATION, SMOKE_ARGS; SHARED_GPU=1: other
    processes on the GPU are expected."""
    settings = smoke_settings()
    chosen = VARIANTS[variant]
    if chosen.stock_needed:
        required("STOCK_SITE", settings.stock_site, STOCK_WHAT)
    if chosen.pair:
        required("PAIR", settings.pair, "the folder holding target/ and drafter/")
    out = absolute(env("OUT") or "")
    code = smoke_.production_smoke(
        chosen, settings, layout_of(ctx), out, shared_gpu=bool(env("SHARED_GPU"))
    )
    ctx.exit(code)


@host_group.command("smoke-all")
@click.pass_context
def smoke_all_command(ctx: click.Context) -> None:
    """production-smoke-all.sh: several variants at once on one GPU (VARIANTS, default
    "default stock fp8"), each within TIME_LIMIT (default 500 s)."""
    patched = sites(required("PATCHED_SITE", env("PATCHED_SITE"), PATCHED_WHAT))
    stock = sites(required("STOCK_SITE", env("STOCK_SITE"), STOCK_WHAT))
    out = absolute(required("OUT", env("OUT"), OUT_REPORTS))
    shared = smoke_.SharedSettings()
    names = tuple((env("VARIANTS") or " ".join(shared.variants)).split())
    for name in names:
        if name not in VARIANTS:
            raise HostUsageError(f"VARIANTS: unknown variant '{name}'")
    shared = smoke_.SharedSettings(
        variants=names,
        time_limit=optional_number("TIME_LIMIT", env("TIME_LIMIT"), shared.time_limit) or 0,
        kv_cache_memory_bytes=env("KV_CACHE_MEMORY_BYTES") or shared.kv_cache_memory_bytes,
        gpu_memory_utilization=env("GPU_MEMORY_UTILIZATION") or shared.gpu_memory_utilization,
    )
    layout = layout_of(ctx)
    ctx.exit(smoke_.production_smoke_all(shared, layout, out, patched, stock))


@host_group.command("smoke-pair")
@click.pass_context
def smoke_pair_command(ctx: click.Context) -> None:
    """smoke-pair.sh: tooling smoke --tiny on the patched and the stock install at once."""
    smoke_.smoke_pair(layout_of(ctx))


@host_group.command("acceptance")
@click.pass_context
def acceptance_command(ctx: click.Context) -> None:
    """acceptance.sh: wait for the recipe (WAIT_S, default 420), then measure every engine
    on the trained pair."""
    wait_s = optional_number("WAIT_S", env("WAIT_S"), 420) or 0
    smoke_.acceptance(layout_of(ctx), wait_s)


@host_group.command("train-background")
@click.pass_context
def train_background_command(ctx: click.Context) -> None:
    """train-background.sh: start the trained-drafter recipe in a session of its own."""
    trained_.train_drafter(layout_of(ctx))


@host_group.command("proof")
@click.argument("call", type=click.Choice(proof_.CALLS))
@click.pass_context
def proof_command(ctx: click.Context, call: str) -> None:
    """hybrid-proof.sh: one CALL of the hybrid defects' proof into $OUT (TIME_LIMIT, default
    480 s, bounds each engine)."""
    out = absolute(required("OUT", env("OUT"), OUT_BACK))
    limit = optional_number("TIME_LIMIT", env("TIME_LIMIT"), 480) or 0
    ctx.exit(proof_.proof(call, layout_of(ctx), out, limit))


@host_group.command("fuzz")
@click.argument("engine", type=click.Choice(fuzz_.ENGINES))
@click.argument("pair", type=click.Choice(fuzz_.PAIRS))
@click.pass_context
def fuzz_command(ctx: click.Context, engine: str, pair: str) -> None:
    """gpu-fuzz.sh: tooling fuzz gpu on the ENGINE install and the PAIR into $OUT.

    OUT; TIME_LIMIT (default 1800 s of drawing), NOISE (the seed pair's logprob noise between
    batches: required for seed and seed-full), FUZZ_ARGS (more options of tooling fuzz gpu)."""
    out = absolute(required("OUT", env("OUT"), OUT_REPORTS))
    noise = env("NOISE")
    if pair in fuzz_.NOISY:
        required("NOISE", noise, "the seed pair's logprob noise (--noise of tooling fuzz gpu)")
    settings = fuzz_.FuzzSettings(
        time_limit=optional_number("TIME_LIMIT", env("TIME_LIMIT"), 1800) or 1800,
        noise=noise,
        args=tuple((env("FUZZ_ARGS") or "").split()),
    )
    ctx.exit(fuzz_.fuzz(engine, pair, layout_of(ctx), out, settings))


#: trained-hybrid.sh's steps that take no argument.
TRAINED_STEPS = ("train", "wait", "chain", "collect")


def _trained_words(words: tuple[str, ...]) -> tuple[str, str | None]:
    """trained-hybrid.sh's STEP [ARG], as its usage line allows them."""
    if not words:
        raise HostUsageError("give a step", usage=True)
    step, rest = words[0], words[1:]
    if step in TRAINED_STEPS and rest:
        raise HostUsageError(f"{step} takes no arguments", usage=True)
    if step in ("export-pair", "import-pair") and len(rest) != 1:
        need = "CALL" if step == "export-pair" else "PARTS"
        raise HostUsageError(f"{step} needs {need}", usage=True)
    if step not in (*TRAINED_STEPS, "export-pair", "import-pair"):
        if not (step.isascii() and step.isdigit() and 1 <= len(step) <= 3 and step[0] != "0"):
            raise HostUsageError(f"unknown step '{step}'", usage=True)
        if rest:
            raise HostUsageError("CALL takes no more arguments", usage=True)
    return step, rest[0] if rest else None


def train_settings() -> trained_.TrainSettings:
    """TRAIN_WHEELS (paths, made absolute) and TRAIN_ARGS, for the recipe's start."""
    return trained_.TrainSettings(
        wheels=tuple(absolute(w) for w in (env("TRAIN_WHEELS") or "").split()),
        args=tuple((env("TRAIN_ARGS") or "").split()),
    )


def _calls() -> list[int]:
    given = env("CALLS") or ""
    if len(given) > 99 or any(c not in "0123456789 " for c in given):
        raise HostUsageError(f"CALLS must be call numbers separated by spaces, not '{given}'")
    return [int(word) for word in given.split()]


def _engines() -> str:
    given = env("ENGINES") or ""
    if len(given) > 999 or any(not (c.isalnum() or c in "-_,.") for c in given):
        raise HostUsageError(f"ENGINES must be engine names separated by commas, not '{given}'")
    return given


@host_group.command("trained")
@click.argument("words", nargs=-1)
@click.pass_context
def trained_command(ctx: click.Context, words: tuple[str, ...]) -> None:
    """trained-hybrid.sh: train|wait|CALL|chain|collect|export-pair CALL|import-pair PARTS.

    OUT (for CALL, collect and export-pair); TIME_LIMIT (default 540 s a call), WAIT_S
    (default 540 s; chain 1200 s), CALLS, ENGINES (a call's engines, NAME,...: all when
    unset), TRAIN_WHEELS, TRAIN_ARGS."""
    step, arg = _trained_words(words)
    number = whole_number("CALL", arg) if step == "export-pair" and arg is not None else None
    out = env("OUT")
    if step == "collect" or step == "export-pair" or step.isdigit():
        out = required("OUT", out, OUT_BACK)
    limit = optional_number("TIME_LIMIT", env("TIME_LIMIT"), 540) or 0
    wait_s = optional_number("WAIT_S", env("WAIT_S"))
    calls = _calls()
    layout, where = layout_of(ctx), absolute(out) if out else None
    settings = train_settings()
    code = 0
    if step == "train":
        trained_.train(layout, settings)
    elif step == "wait":
        code = trained_.wait(layout, 540 if wait_s is None else wait_s, where)
    elif step == "chain":
        only = _engines()
        code = trained_.chain(layout, 1200 if wait_s is None else wait_s, calls, limit, only)
    elif step == "collect" and where is not None:
        trained_.collect(layout, where)
    elif step == "export-pair" and number is not None and where is not None:
        trained_.export_pair(number, layout, where)
    elif step == "import-pair" and arg is not None:
        trained_.import_pair(absolute(arg), layout)
    elif where is not None:
        code = trained_.call(int(step), layout, where, limit)
    ctx.exit(code)


def _session_words(words: tuple[str, ...]) -> tuple[str, list[str]]:
    """hybrid-session.sh's COMMAND and its arguments, as its usage line allows them."""
    if not words:
        raise HostUsageError("give a command", usage=True)
    command, rest = words[0], list(words[1:])
    if command in ("start", "background") and not rest:
        raise HostUsageError(f"{command} needs PARTS", usage=True)
    if command == "collect" and rest:
        raise HostUsageError("collect takes no arguments", usage=True)
    if command == "wait" and len(rest) != 1:
        raise HostUsageError("wait needs SECONDS", usage=True)
    if command not in ("start", "background", "collect", "wait"):
        raise HostUsageError(f"unknown command '{command}'", usage=True)
    for step in rest[1:] if command in ("start", "background") else ():
        if step not in session_.STEPS:
            raise HostUsageError(f"unknown step '{step}'", usage=True)
    return command, rest


@host_group.command("session")
@click.argument("words", nargs=-1)
@click.pass_context
def session_command(ctx: click.Context, words: tuple[str, ...]) -> None:
    """hybrid-session.sh: start PARTS [STEP ...] | collect | wait SECONDS.

    OUT (collect, wait); PAIR_PARTS: an earlier session's pair, carried in (start)."""
    command, rest = _session_words(words)
    seconds = whole_number("SECONDS", rest[0]) if command == "wait" else 0
    layout = layout_of(ctx)
    if command in ("start", "background"):
        steps = rest[1:] or list(session_.DEFAULT_STEPS)
        parts = absolute(rest[0])
        if command == "background":
            ctx.exit(session_.background(parts, steps, layout))
        given = env("PAIR_PARTS")
        pair_parts = absolute(given) if given else None
        session_.start(parts, steps, layout, pair_parts, train_settings())
        return
    out = absolute(required("OUT", env("OUT"), OUT_BACK))
    if command == "collect":
        session_.collect(layout, out)
    else:
        session_.wait(layout, seconds, out)


@host_group.command("speed", context_settings={"ignore_unknown_options": True})
@click.argument("step", type=click.Choice(["draw", "start", "run", "wait"]))
@click.argument("words", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def speed_command(ctx: click.Context, step: str, words: tuple[str, ...]) -> None:
    """DFlash against plain vLLM (tooling.trained.speed): draw ARCH DIR [DEVICE] | start PAIR
    [RUN ARGS] | run PAIR [RUN ARGS] (waited for) | wait SECONDS (OUT: where the reports and
    figures go)."""
    layout = layout_of(ctx)
    code = 0
    if step == "draw":
        if len(words) not in (2, 3) or words[0] not in speed_.ARCHES:
            raise HostUsageError(f"draw needs ARCH ({', '.join(speed_.ARCHES)}) and DIR")
        device = words[2] if len(words) == 3 else "cuda"
        if device not in speed_.DEVICES:
            raise HostUsageError(f"draw: DEVICE must be one of {', '.join(speed_.DEVICES)}")
        speed_.draw(layout, words[0], absolute(words[1]), device)
    elif step in ("start", "run"):
        if not words:
            raise HostUsageError(f"{step} needs PAIR")
        from ..trained.speed import pair_problem  # the run's own check, before it starts

        pair = absolute(words[0])
        problem = pair_problem(pair)
        if problem:
            raise HostUsageError(f"{step}: {problem}")
        if step == "start":
            speed_.start(layout, pair, list(words[1:]))
        else:
            code = speed_.run_here(layout, pair, list(words[1:]))
    else:
        if len(words) != 1:
            raise HostUsageError("wait needs SECONDS")
        seconds = whole_number("SECONDS", words[0])
        code = speed_.wait(layout, seconds, absolute(required("OUT", env("OUT"), OUT_BACK)))
    ctx.exit(code)


@host_group.command("make-parts")
@click.argument("out")
@click.argument("size", required=False, default=str(parts_.PART_BYTES))
@click.pass_context
def make_parts_command(ctx: click.Context, out: str, size: str) -> None:
    """make-parts.sh, on the build machine: the parts setup joins, into OUT (a new folder),
    of SIZE bytes each (default 56 MiB). RAY=1 adds Ray; TRAINING=0 leaves train-wheels/
    out; BASE=VERSION carries that pinned vLLM release instead of the series' own."""
    checked = part_size(size)
    base = env("BASE")
    if base is not None:
        settings_of(ctx).catalog().get(base)
    settings = parts_.PartsSettings(
        ray=env("RAY") == "1", training=env("TRAINING") != "0", base=base
    )
    parts_.make_parts(absolute(out), checked, settings_of(ctx).cache.root, settings)


@host_group.command("pair-parts")
@click.argument("words", nargs=-1)
def pair_parts_command(words: tuple[str, ...]) -> None:
    """pair-parts.sh, on the build machine: OUT_DIR [PART_SIZE_BYTES] -- DIR ...: the pair's
    parts brought back in several folders, checked and split again (default 56 MiB)."""
    out, size, folders = parts_.split_words(list(words))
    checked = part_size(size) if size is not None else parts_.PART_BYTES
    parts_.pair_parts(absolute(out), checked, [absolute(f) for f in folders])
