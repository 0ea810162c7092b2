"""The GPU session's steps as data (``hybrid-session.sh start PARTS STEP ...``): what kind of
work each is, what it serves, and which ablations the installs need for them."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum

from ..trained.speed_engines import ENGINES
from .speed import LOCATE_ENGINES, SPEED_ENGINES, step_engines
from .trained import trained_ablations

logger = logging.getLogger(__name__)


class Kind(StrEnum):
    SMOKE = "smoke"
    """A production smoke variant."""
    DRAWN = "drawn"
    """The 5120-wide pair drawn once on the GPU, then smoked as a user's own pair."""
    PAIR = "pair"
    """The recipe alone: wait for it to write the pair."""
    TRAINED = "trained"
    """The trained pair's calls, once the recipe has written the pair."""
    SPEED = "speed"
    """The speed run on the trained pair (``host speed run``), once the recipe has written it."""
    SPEED_SHAPE = "speed-shape"
    """The speed run on the recipe's shapes with random weights, drawn on the GPU: each
    engine's step without the recipe's training (every draft rejected)."""
    VERIFY = "verify"
    """``tooling verify`` of the stock and the patched install on this host: each fix by
    behaviour (the probes run on the host's CPU, with the installed release's torch)."""
    KERNEL = "kernel"
    """The series' kernels against what they replace, compiled on this GPU, in the fixed
    engine's interpreter (``python -m tooling.host.kernels``)."""
    FUZZ = "fuzz"
    """The GPU fuzzer (``host fuzz``): the fixed wheel's campaign and stock's side by side,
    on the pair the step's variant names (``fuzz_settings``)."""


#: Call 1's engines that check patches 23 and 24 on the trained pair: plain, the fixed wheel, its
#: budget that verifies no drafts above 8 requests, and that budget without patch 24.
STATE_ENGINES = "plain,patched-k15,patched-k15-budget,no-hybrid-accepted-state-k15-budget"
#: Call 1's check of patch 32's option on the trained pair: plain, the fixed wheel, and the
#: fixed wheel with its Gated DeltaNet verify replayed (prefix caching off), which fit one H100.
REPLAY_ENGINES = "plain,patched-k15,patched-k15-replay"


@dataclass(frozen=True)
class Step:
    """A session step: its name, what kind of work it is and, for a smoke, its variant."""

    name: str
    kind: Kind
    variant: str = ""
    smoke_args: str = ""
    """SMOKE_ARGS the step's smoke gets."""
    calls: str = ""
    """CALLS a trained step runs (empty: every call of the pair's plan)."""
    engines: str = ""
    """ENGINES of its calls a trained step serves (empty: every one)."""


STEPS = {
    s.name: s
    for s in (
        Step("seed", Kind.SMOKE, "seed"),
        # Its first tokens of K+1-token prompts must be wrong (--expect stock).
        Step(
            "seed-stock",
            Kind.SMOKE,
            "stock",
            "--tiny-arch seed --num-speculative-tokens 15 --quick",
        ),
        Step("tiny", Kind.SMOKE, "default"),
        # Patch 22's option set false through the production smoke: fidelity, lossless, slot
        # audit, load, as a user who turns the drafter's full graphs off is served.
        Step("tiny-no-graphs", Kind.SMOKE, "no-drafter-graphs"),
        Step("seed-no-graphs", Kind.SMOKE, "seed-no-graphs"),
        # Patch 40's option (off by default) through the production smoke: whether a decode
        # step replayed as one graph drafts what the reference drafter drafts.
        Step("tiny-step-graphs", Kind.SMOKE, "step-graphs"),
        Step("seed-step-graphs", Kind.SMOKE, "seed-step-graphs"),
        Step("ray", Kind.SMOKE, "ray"),
        Step("ray-tp2", Kind.SMOKE, "ray-tp2"),
        Step("seed-full", Kind.SMOKE, "seed-full"),
        Step("seed-full-quick", Kind.SMOKE, "seed-full", "--quick"),
        Step("seed-full-pair", Kind.DRAWN, "pair"),
        Step("seed-full-pair-quick", Kind.DRAWN, "pair", "--quick"),
        Step("pair", Kind.PAIR),
        Step("trained", Kind.TRAINED),
        # The K = 15 call alone: lossless and acceptance with the ablations, after `speed`.
        Step("trained-1", Kind.TRAINED, calls="1"),
        # Call 1's checks of patches 23 and 24 alone, which fit one H100 in one turn.
        Step("trained-1-state", Kind.TRAINED, calls="1", engines=STATE_ENGINES),
        Step("trained-1-replay", Kind.TRAINED, calls="1", engines=REPLAY_ENGINES),
        Step("speed", Kind.SPEED),
        # Where a step with a prompt joining goes, first: fewer engines and levels than the bar.
        Step("speed-locate", Kind.SPEED, "locate"),
        Step("speed-16", Kind.SPEED, "trained-16"),
        Step("speed-replay", Kind.SPEED, "replay"),
        Step("speed-bar", Kind.SPEED, "bar"),
        Step("speed-hold", Kind.SPEED, "hold"),
        Step("speed-graphs", Kind.SPEED, "graphs"),
        Step("speed-stock", Kind.SPEED, "stock"),
        Step("speed-shape", Kind.SPEED_SHAPE),
        # Drafting off above 8 against plain at 16 and 64 on the drawn shapes: no training.
        Step("speed-shape-off", Kind.SPEED_SHAPE, "shape-off"),
        Step("speed-shape-off-16", Kind.SPEED_SHAPE, "shape-off-16"),
        # Plain on stock and on the fixed wheel, on the drawn shapes: plain's step costs what
        # it costs whatever the weights, so the 2% bar needs no training.
        Step("speed-shape-stock", Kind.SPEED_SHAPE, "stock"),
        # The two at 64 alone, profiled: where plain on the fixed wheel read slower.
        Step("speed-shape-stock-64", Kind.SPEED_SHAPE, "stock-64"),
        # Patch 34 against the same wheel without it, on the drawn shapes.
        Step("speed-inputs", Kind.SPEED_SHAPE, "inputs"),
        # Patch 35 against the same wheel without it, on the drawn shapes.
        Step("speed-greedy", Kind.SPEED_SHAPE, "greedy"),
        # Patch 37 against the same wheel without it, on the drawn shapes.
        Step("speed-context", Kind.SPEED_SHAPE, "context"),
        # Patch 39 against the same wheel without it, on the drawn shapes.
        Step("speed-align", Kind.SPEED_SHAPE, "align"),
        # Patch 40's option against DFlash as shipped, on the drawn shapes.
        Step("speed-step", Kind.SPEED_SHAPE, "step"),
        # Patches 37 and 38, and patch 22's graphs off, in one engine start.
        Step("speed-host", Kind.SPEED_SHAPE, "host"),
        # DFlash against plain at one request alone, profiled there: where its host time goes.
        Step("speed-one", Kind.SPEED_SHAPE, "one"),
        # The same with DFlash without patch 22's drafter graphs (its default) beside them.
        Step("speed-one-graphs", Kind.SPEED_SHAPE, "one-graphs"),
        # The seed's full width drawn: issue 45's seed-scale table, on a GPU of an H200's size.
        Step("speed-seed", Kind.SPEED_SHAPE, "seed"),
        Step("verify", Kind.VERIFY),
        # Patches 36 and 37's kernels against what they replace: no engine started.
        Step("kernels", Kind.KERNEL),
        # Beside the training, on the seed-shaped pair.
        Step("fuzz-seed", Kind.FUZZ, "seed"),
        # The seed's pair at full width, the fixed wheel alone, on a GPU of an H200's size.
        Step("fuzz-seed-full", Kind.FUZZ, "seed-full"),
        # Once the recipe has written the pair: lossless, against its reference acceptance.
        Step("fuzz-trained", Kind.FUZZ, "trained"),
        # The kept GPU cases (tests/data/gpu-fuzz) again: stock fails them, the fixed wheel not.
        Step("fuzz-replay", Kind.FUZZ, "replay"),
    )
}


def _served(step: Step) -> list[str]:
    """The trained pair's ablations a trained step serves: those its engines name, else all."""
    ablated = trained_ablations()
    if not step.engines:
        return ablated
    names = step.engines.split(",")
    return [a for a in ablated if any(n.startswith(f"no-{a}-") for n in names)]


def session_ablations(steps: list[str]) -> list[str]:
    """The patches left out of the installs the steps serve beside the fixed wheel and
    stock: the trained pair's calls' ablations and the speed run's ``no-<patch>`` engines."""
    ablated = [a for s in steps if STEPS[s].kind is Kind.TRAINED for a in _served(STEPS[s])]
    speed = [STEPS[s] for s in steps if STEPS[s].kind in (Kind.SPEED, Kind.SPEED_SHAPE)]
    if speed:
        engines = [*SPEED_ENGINES, *LOCATE_ENGINES]
        engines += [e for step in speed for e in step_engines(step.variant)]
        sites = [ENGINES[e].site for e in engines]
        ablated += [site.removeprefix("no-") for site in sites if site.startswith("no-")]
    logger.debug("the installs for %s leave out: %s", " ".join(steps), ablated or "nothing")
    return list(dict.fromkeys(ablated))
