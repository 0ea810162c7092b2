"""``tooling host speed``: DFlash's speed against plain vLLM on this GPU (``tooling.trained.
speed``), started in a session of its own so that no command of the host's waits on it, then
waited for and its report and figures collected.

- ``draw ARCH DIR [DEVICE]``: a pair with random weights (``tiny``): ``trained-shape`` (the hybrid
  recipe's shapes) or ``seed`` (Qwen3.6-27B's, at full width);
- ``start PAIR [RUN ARGS]``: ``speed run`` on PAIR into ``$WORK/speed/PAIR_NAME`` (engines
  and levels as RUN ARGS say), in the background; ``run`` the same to its end;
- ``wait SECONDS``: until no run or draw is left or SECONDS pass; each pair's report so far and
  one archive of every figure and log into OUT.
"""

from __future__ import annotations

import logging
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import HostStepError
from .layout import PYTHON, Layout, Modules, detached, run, running, say, since, tail

logger = logging.getLogger(__name__)


#: The session's speed step (``host session``): issue 45's bar and plain against stock,
#: measured in turns pass by pass, on batches and with the batch kept full (five engines fit
#: one H200, the last sized for 16 requests). Beside DFlash as shipped: prefix caching off, to
#: tell whether the aligned Gated DeltaNet states are what a step with a prompt joining costs
#: DFlash, and the drafter's full graphs (on by default) off, where a step is CPU time.
def kept_full(engines: tuple[str, ...]) -> tuple[str, ...]:
    """The speed run's options for ``engines`` measured in turns, pass by pass, on batches
    and with the batch kept full, its requests of staggered lengths: with one length for all,
    plain's requests end at the same step and its prompts join in one step of their own,
    where a server's, and DFlash's, join one or two at a time."""
    return ("--engines", ",".join(engines), "--interleave", "--sustained", "--staggered")


SPEED_ENGINES = (
    "plain-stock",
    "plain",
    "dflash",
    "dflash-no-prefix-caching",
    "dflash-no-drafter-graphs",
)
SPEED_ARGS = (
    *kept_full(SPEED_ENGINES),
    *("--levels", "1,16,64"),
    # Steady windows in turns and a profiled sustained window make the bar's run longer than
    # the speed run's default limit, which would cut the profile at 64 first.
    *("--time-limit", "1200"),
)
#: The levels profiled: beside the recipe's training, where the step is CPU time (one
#: request) and where it is the GPU's (64), as a third profile does not fit; on the drawn
#: shapes, with no recipe to wait for, every level of the bar.
TRAINED_PROFILE = ("--profile-levels", "1,64")
SHAPE_PROFILE = ("--profile-levels", "1,16,64")
#: The ``speed-locate`` step: whether drafting off above 8 running requests (patch 23, the
#: state its steps read on this hybrid target fixed by patch 24) keeps DFlash from losing to
#: plain, and where drafting stops paying: below 9 the engine drafts the seed's K, so its
#: ratios at 1 and 8 are DFlash's as shipped. Two engines, so that they fit one H100
#: together (``gpu_fit``); the step at 64 profiled.
LOCATE_ENGINES = ("plain", "dflash-off-above-8")
#: Those two engines measured in turns, with the batch kept full.
LOCATE_RUN = kept_full(LOCATE_ENGINES)
LOCATE_ARGS = (
    *LOCATE_RUN,
    *("--levels", "1,8,16,64", "--passes", "3", "--profile-levels", "64"),
    *("--time-limit", "900"),
)


#: ``speed-shape-off``: the same two engines on the drawn shapes, where drafting is off (16
#: and 64 requests): a step that verifies no drafts costs what it costs whatever the weights,
#: so its ratio to plain there is the bar's without the recipe's training.
SHAPE_OFF_ARGS = (
    *LOCATE_RUN,
    *("--levels", "16,64", "--passes", "5", "--profile-levels", "16"),
    *("--time-limit", "600"),
)
#: ``speed-shape-off-16``: the same at 16 requests alone, three passes, for a session with
#: little device time left.
SHAPE_OFF_16_ARGS = (
    *LOCATE_RUN,
    *("--levels", "16", "--passes", "3", "--profile-levels", "16"),
    *("--time-limit", "360"),
)


#: ``speed-16``: the trained pair at 16 requests with the batch kept full, where DFlash at
#: K = 15 last lost to plain: DFlash as shipped and drafting 7 tokens, against plain, so that
#: the run says whether a budget that lowers K there pays.
SPEED_16_ENGINES = ("plain", "dflash", "dflash-k7")
SPEED_16_ARGS = (
    *kept_full(SPEED_16_ENGINES),
    *("--levels", "16", "--passes", "3", "--profile-levels", "16"),
    *("--time-limit", "420"),
)

#: ``speed-replay``: patch 32's option against the same engine without it (both with prefix
#: caching off, which the option needs) and plain, at 16 and 32 with the batch kept full, the
#: step at 32 profiled: whether the target's Gated DeltaNet time falls toward plain's. Each
#: drafting engine holds the KV cache of 32 requests (as ``trained-1`` sizes 16), so that the
#: three fit one H100 and measure interleaved; the option's engine first, should the run be cut.
REPLAY_ENGINES = ("plain", "dflash-replay", "dflash-no-prefix-caching")
REPLAY_ARGS = (
    *kept_full(REPLAY_ENGINES),
    *("--levels", "16,32", "--passes", "3", "--profile-levels", "32"),
    *("--drafted-kv-gib", "24", "--time-limit", "600"),
)


#: ``speed-bar``: issue 45's bar alone, DFlash as shipped against plain at 1, 16 and 64 with
#: five passes, the requests of staggered lengths, the step at 64 profiled; two engines, so
#: that they fit one H100 together and measure interleaved (plain against stock is the
#: ``speed`` step's).
BAR_ENGINES = ("plain", "dflash")


def bar_run(
    engines: tuple[str, ...], levels: str = "1,16,64", profiled: str = "64"
) -> tuple[str, ...]:
    """The bar's speed run for ``engines``: five passes at ``levels`` (the bar's unless
    an engine's KV cache holds fewer requests), staggered lengths with the batch kept full,
    the step at ``profiled`` requests profiled ("": none)."""
    return (
        *kept_full(engines),
        *("--levels", levels, "--passes", "5", "--profile-levels", profiled),
        *("--time-limit", "900"),
    )


BAR_ARGS = bar_run(BAR_ENGINES)


#: ``speed-hold``: patch 33's option (prompts wait up to four verify steps to join together)
#: against plain, as ``speed-bar`` measures DFlash as shipped: the ratios of the two runs, each
#: to its own plain, say what the option changes.
HOLD_ENGINES = ("plain", "dflash-hold")
HOLD_ARGS = bar_run(HOLD_ENGINES)
#: ``speed-graphs``: DFlash with patch 22's full graphs of the drafter's uniform pass (on by
#: default) turned off, against plain at the bar's levels its engine's KV cache holds (16
#: requests), as ``speed-hold`` measures its option: the ratio beside ``speed-bar``'s says
#: what the graphs keep of the acceptance and of the bar at one request, where a step is host
#: time, profiled there.
GRAPHS_ENGINES = ("plain", "dflash-no-drafter-graphs")
GRAPHS_ARGS = bar_run(GRAPHS_ENGINES, "1,16", "1")
#: ``speed-stock``: issue 45's other bar, plain on the fixed wheel within 2% of plain on stock
#: 0.20.1 at the bar's levels (the series touches code plain serving runs), judged on steady
#: windows taken in turns (``bench_dflash_speed.py --plain-only``); two small engines that fit
#: any GPU the host lends, no profile.
STOCK_ENGINES = ("plain-stock", "plain")
STOCK_ARGS = bar_run(STOCK_ENGINES, profiled="")
#: ``speed-shape-stock-64``: the same two engines at 64 alone, where the fixed wheel's plain
#: read slower than stock's in two runs, that level profiled: each wheel's kernels and each
#: region's host time, side by side.
STOCK_64_ARGS = bar_run(STOCK_ENGINES, "64", "64")


#: ``speed-inputs``: patch 34 (a verify step's inputs in one upload) against the same wheel
#: without it and plain, at 1 and 16 requests with the batch kept full, on the drawn shapes: a
#: uniform verify step costs the host what it costs whatever the weights. Three small engines
#: that fit one H100 together, measured in turns; nothing profiled, so its regions are not
#: timed either (the speed run times them only at a profiled level).
INPUTS_ENGINES = ("plain", "dflash-16", "dflash-no-inputs-upload")
INPUTS_ARGS = bar_run(INPUTS_ENGINES, "1,16", "")
#: ``speed-greedy``: patch 35 (an all-greedy verify step's one argmax) against the same wheel
#: without it and plain, at 1 and 16 requests with the batch kept full, on the drawn shapes;
#: the step at one request profiled, so that the rejection sampler's region is timed too.
GREEDY_ENGINES = ("plain", "dflash-16", "dflash-no-greedy-verify")
GREEDY_ARGS = bar_run(GREEDY_ENGINES, "1,16", "1")
#: ``speed-context``: patch 37 the same way (the drafter's context K/V in one launch), the
#: step at one request profiled so that the drafter's context region is timed.
CONTEXT_ENGINES = ("plain", "dflash-16", "dflash-no-context-kv")
CONTEXT_ARGS = bar_run(CONTEXT_ENGINES, "1,16", "1")
#: ``speed-align``: patch 39 the same way (with prefix caching, a verify step in which no
#: block can complete does not wait for its accepted counts), one request profiled, so that
#: the region of the counts is timed.
ALIGN_ENGINES = ("plain", "dflash-16", "dflash-no-align-deferred")
ALIGN_ARGS = bar_run(ALIGN_ENGINES, "1,16", "1")
#: ``speed-step``: patch 40's option (a decode step's drafter replayed as one graph, off by
#: default) against DFlash as shipped and plain, at one request, where a step is host time
#: and the bar is short, profiled so that the drafter's host regions show what the graph
#: took off; one level, so that it fits a session that lost time to starts.
STEP_ENGINES = ("plain", "dflash-16", "dflash-step-graphs")
STEP_ARGS = bar_run(STEP_ENGINES, "1", "1")
#: ``speed-host``: one engine start for what the host's time a step at one request is made
#: of: patches 37 and 38 each against the fixed wheel without it, and without patch 22's full
#: graphs of the drafter's forward (its default), at one request, profiled: the level where
#: the bar is short and a step is host time, alone, so that the step fits what a session has
#: left after a few starts that found no machine. The steps it joins (``speed-context``,
#: ``speed-one-graphs``) each start their engines anew.
HOST_ENGINES = (
    "plain",
    "dflash-16",
    "dflash-no-metadata-reuse",
    "dflash-no-context-kv",
    "dflash-no-drafter-graphs",
)
HOST_ARGS = bar_run(HOST_ENGINES, "1", "1")
#: ``speed-one``: DFlash as shipped against plain at one request alone, where the bar asks
#: most (2.5x) and the step is host time: five passes in turns, the step profiled, since the
#: speed run times its regions (the runner's inputs in parts) only at a profiled level, in a
#: window of its own with no profiler.
ONE_ARGS = bar_run(BAR_ENGINES, "1", "1")
#: ``speed-one-graphs``: the same with DFlash without patch 22's full graphs of the drafter's
#: forward (its default) beside them: what the graphs take of the query pass's launches, the
#: largest part of the drafter's host time at one request that no region names.
ONE_GRAPHS_ENGINES = (*BAR_ENGINES, "dflash-no-drafter-graphs")
ONE_GRAPHS_ARGS = bar_run(ONE_GRAPHS_ENGINES, "1", "1")
#: ``speed-seed``: issue 45's table at the seed's scale (Qwen3.6-27B's full width, random
#: weights): plain and DFlash at K = 15, each alone on the GPU (two 27B-sized engines do not
#: fit one together), at 1, 8 and 32 running requests; DFlash measured again with its LM heads
#: zeroed, so that every draft is accepted. The engine step is what the table projects from,
#: so nothing is profiled. Its DFlash engine holds 32 requests only on a GPU of an H200's size.
SEED_ENGINES = ("seed-plain", "seed-dflash")
SEED_ARGS = (
    *("--engines", ",".join(SEED_ENGINES), "--one-at-a-time"),
    *("--levels", "1,8,32", "--passes", "3", "--profile-levels", ""),
    *("--time-limit", "900"),
)
#: The least GPU memory, GiB, that holds what a step at the seed's full width asks at once:
#: ``speed-seed``'s DFlash engine with 32 requests, ``fuzz-seed-full``'s two engines (an
#: H200 has 140).
WIDE_GPU_GIB = 125
#: The least that holds one engine of the seed's width alone, GiB: 53 GiB of weights, a
#: small KV cache, activations and graphs (an H100 has 79).
ONE_WIDE_GPU_GIB = 70
#: ``speed-seed`` on a GPU under WIDE_GPU_GIB: beside the weights, a KV cache of
#: SEED_SMALL_KV_GIB holds 8 requests at K = 15 (1.51 GiB each at this width), so the
#: table's 1 and 8 are measured there, and 32 is not.
SEED_SMALL_KV_GIB = 13
SEED_SMALL_ARGS = (
    *("--engines", ",".join(SEED_ENGINES), "--one-at-a-time"),
    *("--levels", "1,8", "--passes", "3", "--profile-levels", ""),
    *("--drafted-kv-gib", str(SEED_SMALL_KV_GIB), "--time-limit", "900"),
)


def wide_gpu(gib: float | None, step: str) -> bool:
    """Whether a GPU of ``gib`` holds what ``step`` at the seed's full width asks at once
    (True also where its memory is not known), or one engine of that width alone (False);
    HostStepError, one line naming ``step``, on a smaller one, before anything is drawn."""
    if gib is None or gib >= WIDE_GPU_GIB:
        return True
    if gib >= ONE_WIDE_GPU_GIB:
        return False
    raise HostStepError(
        f"{step} needs a GPU of {ONE_WIDE_GPU_GIB} GiB or more for one engine of the seed's "
        f"width; this one has {gib:.0f} GiB (an H100 has 79)"
    )


def seed_args(gib: float | None) -> tuple[str, ...]:
    """``speed-seed``'s options on a GPU of ``gib``: the table's three levels where its
    DFlash engine holds 32 requests, 1 and 8 where it holds one engine of the seed's width
    (``wide_gpu``)."""
    return SEED_ARGS if wide_gpu(gib, "speed-seed") else SEED_SMALL_ARGS


#: A session step's variant and the speed run's options for it; any other variant runs the
#: bar's engines, profiled as ``speed_args`` says.
VARIANT_ARGS = {
    "locate": LOCATE_ARGS,
    "shape-off": SHAPE_OFF_ARGS,
    "shape-off-16": SHAPE_OFF_16_ARGS,
    "trained-16": SPEED_16_ARGS,
    "replay": REPLAY_ARGS,
    "bar": BAR_ARGS,
    "hold": HOLD_ARGS,
    "graphs": GRAPHS_ARGS,
    "stock": STOCK_ARGS,
    "seed": SEED_ARGS,
    "inputs": INPUTS_ARGS,
    "one": ONE_ARGS,
    "one-graphs": ONE_GRAPHS_ARGS,
    "greedy": GREEDY_ARGS,
    "context": CONTEXT_ARGS,
    "align": ALIGN_ARGS,
    "step": STEP_ARGS,
    "host": HOST_ARGS,
    "stock-64": STOCK_64_ARGS,
}


def speed_args(variant: str) -> tuple[str, ...]:
    """The speed run's options for a session step's variant: ``VARIANT_ARGS``' (``locate``,
    ``shape-off`` drafting off on the drawn shapes, ``shape-off-16`` its 16 alone,
    ``trained-16`` the trained pair at 16 with K lowered beside K = 15, ``replay`` patch 32's
    option against its control), else the bar's, on the drawn shapes (``shape``) or the
    trained pair."""
    if variant in VARIANT_ARGS:
        return VARIANT_ARGS[variant]
    return (*SPEED_ARGS, *(SHAPE_PROFILE if variant == "shape" else TRAINED_PROFILE))


#: What ``draw`` can make, with the tiny module's arguments.
ARCHES = {
    "trained-shape": ["--arch", "trained-shape"],
    "seed": ["--arch", "seed", "--hidden-size", "5120"],
}
DEVICES = ("cuda", "cpu")


def step_engines(variant: str) -> tuple[str, ...]:
    """The engines the speed run of a session step's variant serves (its ``--engines``)."""
    args = speed_args(variant)
    return tuple(args[args.index("--engines") + 1].split(","))


def drawn_arch(variant: str) -> str:
    """The pair a drawn-shapes step (``speed-shape*``, ``speed-seed``) draws for ``variant``:
    the seed's for ``seed``, else the recipe's shapes."""
    return "seed" if variant == "seed" else "trained-shape"


#: What ``wait`` packs of a run's folder: its figures, reports and logs (not the compile caches
#: nor the profiler's traces).
KEPT = ("*.json", "*.md", "*.log")
ARCHIVE = "speed-figures.tar.gz"


def _work(layout: Layout) -> Path:
    return layout.work / "speed"


def _busy() -> bool:
    """Whether a speed run, a pair's draw or a line of ``run`` steps is under way."""
    patterns = (f"{Modules.SPEED} run", f"{Modules.TINY} ", "host speed run")
    return any(running(pattern) for pattern in patterns)


def draw(layout: Layout, arch: str, folder: Path, device: str) -> None:
    """A random-weight pair of ``arch`` in ``folder``, drawn in bf16 on ``device`` (the CPU
    leaves the GPU to a run beside it); made again when its manifest is absent."""
    logger.debug("step: draw the %s pair into %s", arch, folder)
    if (folder / "tiny.json").is_file():
        say(f"{arch} pair: already in {folder}")
        return
    start = time.monotonic()
    cmd = [PYTHON, "-m", Modules.TINY, str(folder), *ARCHES[arch], "--device", device]
    if run(cmd, env=layout.env(str(layout.site))) != 0:
        raise HostStepError(f"the {arch} pair was not drawn into {folder}")
    say(f"{arch} pair: drawn in {since(start)}s into {folder}")


def _run_cmd(layout: Layout, pair: Path, args: list[str]) -> tuple[list[str], Path]:
    """The run's command line and log; refused while another run measures on this GPU."""
    if running(f"{Modules.SPEED} run"):
        raise HostStepError("a speed run is already running")
    work = _work(layout) / pair.name
    work.mkdir(parents=True, exist_ok=True)
    cmd = [PYTHON, "-m", Modules.SPEED, "run", str(pair), str(work)]
    return [*cmd, "--engines-root", str(layout.engines), *args], work / "run.log"


def start(layout: Layout, pair: Path, args: list[str]) -> None:
    """``speed run PAIR $WORK/speed/PAIR_NAME --engines-root $ENGINES ARGS`` in a session of
    its own."""
    logger.debug("step: start the speed run on %s (%s)", pair, " ".join(args))
    cmd, log = _run_cmd(layout, pair, args)
    env = layout.env(str(layout.site), VLLM_LOGGING_LEVEL="WARNING")
    child = detached(layout, cmd, log=log, env=env)
    say(f"speed run started (pid {child.pid}), log {log}")


def run_here(layout: Layout, pair: Path, args: list[str]) -> int:
    """The same run as ``start``, waited for (a queue of runs is a line of ``run`` steps); 1
    when an engine returned no figures."""
    logger.debug("step: run the speed run on %s (%s)", pair, " ".join(args))
    cmd, log = _run_cmd(layout, pair, args)
    start_s = time.monotonic()
    with open(log, "wb") as out:
        code = run(cmd, env=layout.env(str(layout.site), VLLM_LOGGING_LEVEL="WARNING"), stdout=out)
    say(f"speed run on {pair.name}: exit {code} after {since(start_s)}s, log {log}")
    if code not in (0, 1):
        raise HostStepError(f"the speed run on {pair} exited {code} (its log: {log})")
    return code


def wait(layout: Layout, wait_s: int, out: Path, busy: Callable[[], bool] = _busy) -> int:
    """Wait while a run or a draw is under way (``busy``: on the host, any such process; at
    most ``wait_s``), then write each pair's report (complete or so far) and one archive of
    every run folder's figures and logs into ``out``; 1 while one still runs."""
    logger.debug("step: wait for the speed runs (at most %ds)", wait_s)
    limit = wait_s
    while busy() and limit > 0:
        time.sleep(5)
        limit -= 5
    out.mkdir(parents=True, exist_ok=True)
    works = sorted(d for d in _work(layout).glob("*") if (d / "engines.json").is_file())
    with tarfile.open(out / ARCHIVE, "w:gz") as archive:
        for work in works:
            # A session's earlier runs on this pair, set aside by a later one that measured
            # an engine again: each its own report and folder.
            for run_dir in [*sorted(work.glob("earlier-*")), work]:
                name = work.name if run_dir == work else f"{work.name}/{run_dir.name}"
                with open(out / f"{name.replace('/', '-')}-report.md", "wb") as text:
                    cmd = [PYTHON, "-m", Modules.SPEED, "report", str(run_dir)]
                    run(cmd, env=layout.env(), stdout=text)
                for pattern in KEPT:
                    for found in sorted(run_dir.glob(pattern)):
                        archive.add(found, arcname=f"{name}/{found.name}")
            for line in tail(work / "run.log", 8):
                say(f"{work.name}: {line}")
    still = busy()
    say(f"speed runs: {'running' if still else 'ended'}")
    return 1 if still else 0
