"""``gpu-fuzz.sh ENGINE PAIR``: the GPU fuzzer (``tooling fuzz gpu``) on one GPU host, one
engine install (patched or stock) on one pair (the trained hybrid pair, or the seed-shaped
pair of random weights), its findings and report into ``$OUT``.

The campaign runs as ``python3 -m tooling fuzz gpu`` with the engine and the bundle on
PYTHONPATH (the command line needs GitPython, which the bundle brings), and so do the engine
processes it starts: ``--python`` is the host's python3 itself."""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import HostStepError
from ..fuzzing.gpu import SCHEDULER_SIDE
from ..fuzzing.referee import NOISE
from ..trained.hybrid import plain_noise
from .layout import PYTHON, Layout, Modules, run, say, since, tail, written
from .proof import seed_pair
from .speed import ARCHES

logger = logging.getLogger(__name__)

ENGINES = ("patched", "stock")
#: The trained hybrid pair, the seed-shaped pair (hidden size 512) and the seed's pair at full
#: width (hidden size 5120, 54 GB on disk, drawn on the GPU into the campaign's own
#: ``models/``, which the session deletes once the step ends).
PAIRS = ("trained", "seed", "seed-full")
#: The pairs of random weights, fuzzed in noise mode.
NOISY = ("seed", "seed-full")


@dataclass(frozen=True)
class FuzzSettings:
    """What the step is given besides ENGINE and PAIR: TIME_LIMIT (seconds of drawing),
    NOISE (the seed pair's logprob noise: required there) and FUZZ_ARGS (more options of
    ``tooling fuzz gpu``)."""

    time_limit: int
    noise: str | None = None
    args: tuple[str, ...] = ()


def full_width_pair(layout: Layout, out: Path) -> Path:
    """The seed's pair at full width in ``out``'s ``models/``, drawn on the GPU once."""
    pair = out / "models" / "seed-5120"
    if not (pair / "tiny.json").is_file():
        seed_pair(layout, out, pair, ARCHES["seed"], "cuda")
    return pair


def _pair(layout: Layout, which: str, out: Path) -> Path:
    if which == "seed-full":
        return full_width_pair(layout, out)
    if which == "trained":
        if not (layout.pair / "summary.json").is_file():
            raise HostStepError(f"no trained pair in {layout.pair}: train or import one first")
        return layout.pair
    pair = layout.work / "seed-pair"
    if not (pair / "tiny.json").is_file():
        seed_pair(layout, out, pair)
    return pair


def fuzz(engine: str, which: str, layout: Layout, out: Path, settings: FuzzSettings) -> int:
    """The campaign of ``engine`` on the ``which`` pair into ``out``/fuzz-ENGINE-PAIR; its
    exit status (25 when it found something)."""
    logger.debug("step: GPU fuzz of %s on the %s pair", engine, which)
    site = layout.engine(engine)
    if not site.is_dir():
        raise HostStepError(f"no {engine} engine in {site}: run host-setup.sh first")
    python = shutil.which(PYTHON)
    if python is None:
        raise HostStepError(f"no {PYTHON} on PATH")
    pair = _pair(layout, which, out)
    folder = out / f"fuzz-{engine}-{which}"
    cmd = [PYTHON, "-m", Modules.TOOLING, "fuzz", "gpu", "--python", python, "--pair", str(pair)]
    cmd += ["--out", str(folder), "--seconds", str(settings.time_limit)]
    if which in NOISY:
        cmd += ["--mode", "noise", "--noise", settings.noise or ""]
    cmd += list(settings.args)
    start = time.monotonic()
    with written(out / f"fuzz-{engine}-{which}.log") as log:
        code = run(cmd, env=layout.env(f"{site}:{layout.site}"), stdout=log, stderr=log)
    say(f"fuzz {engine} on the {which} pair: exit {code} after {since(start)}s")
    for line in tail(out / f"fuzz-{engine}-{which}.log", 20):
        say(line)
    if which == "trained":
        settle(layout, folder, pair, out / f"referee-{engine}-{which}.txt", f"{site}:{layout.site}")
    return code


def settle(layout: Layout, folder: Path, pair: Path, report: Path, site: str) -> int | None:
    """``tooling fuzz referee`` on the lossless findings in ``folder``, the target in float32 on
    this host's CPU, into ``report``: its exit status (25: a defect), None with no finding."""
    found = sorted(
        f for f in folder.glob("finding-lossless-*.json") if not f.name.endswith(SCHEDULER_SIDE)
    )
    if not found:
        return None
    noise, source = session_noise(layout)
    cmd = [PYTHON, "-m", Modules.TOOLING, "fuzz", "referee", *map(str, found)]
    cmd += ["--target", str(pair / "target"), "--python", shutil.which(PYTHON) or PYTHON]
    cmd += ["--noise", repr(noise)]
    start = time.monotonic()
    with written(report) as log:
        code = run(cmd, env=layout.env(site), stdout=log, stderr=log)
    say(
        f"referee of {len(found)} findings in {folder.name} (noise {noise:g}, {source}): "
        f"exit {code} after {since(start)}s"
    )
    return code


def session_noise(layout: Layout) -> tuple[float, str]:
    """The noise the referee rules with, and where it comes from: the plain engine's own noise
    between its two batch shapes as this host's trained call measured it, where that is more
    than the referee's default. bf16 rounding differs from GPU to GPU, so a default measured
    on another card can call this card's rounding a defect."""
    figures = layout.runs / "plain.out.json"
    try:
        plain = json.loads(figures.read_text())
        measured = plain_noise(plain) if plain.get("ok") else None
    except (OSError, ValueError, AttributeError) as err:
        logger.debug("no plain noise measured on this host (%s): the referee's default", err)
        return NOISE, "the referee's default"
    if measured is None:
        return NOISE, "the referee's default (the trained call's figures tell no noise)"
    if measured <= NOISE:
        return NOISE, "the referee's default, at least what this host's trained call measured"
    return measured, f"plain against itself in {figures}"
