"""``trained-hybrid.sh``: the trained hybrid pair on one GPU host (tooling/smoke/
trained_pair.py says what is judged): its recipe started in a session of its own, waited
for, its calls run and reported, and the pair carried to a later session in parts."""

from __future__ import annotations

import importlib
import logging
import re
import shutil
import subprocess
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .. import procs
from ..errors import HostRefusal, HostStepError, HostUsageError
from ..release.split import split_bundle
from .layout import (
    PYTHON,
    Layout,
    Modules,
    detached,
    run,
    running,
    say,
    shown,
    since,
    tail,
    written,
)

#: The recipe, as ``pgrep -f`` finds it running.
RECIPE = f"{Modules.TRAINER} train --arch hybrid"
#: The bundle's wheels the recipe imports from an unpacked folder beside ``$SITE``.
EXTRAS = ("dflash", "flash_linear_attention", "fla_core")
#: A part of the pair one command brings back, and how many a command.
PAIR_PART_BYTES = 15 << 20
PARTS_A_COMMAND = 4

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainSettings:
    """What the recipe is started with: TRAIN_WHEELS (more wheels, each replacing the
    payload's train-wheels/ wheel of its name) and TRAIN_ARGS (more recipe options)."""

    wheels: tuple[Path, ...] = ()
    args: tuple[str, ...] = ()


def trained_ablations() -> list[str]:
    """The patches whose ablations the trained pair's plan runs (its ``no-<patch>`` sites),
    from the plan's module as ``Modules`` names it."""
    sites: tuple[str, ...] = importlib.import_module(Modules.TRAINED_SITES).SITES
    return [site.removeprefix("no-") for site in sites if site.startswith("no-")]


def _project(wheel: Path) -> str:
    return wheel.name.split("-")[0]


def train(layout: Layout, settings: TrainSettings) -> None:
    """Start the recipe (``tooling train --arch hybrid``) in a session of its own, which
    outlives this command, on ``$SITE`` with its extras before it."""
    logger.debug("step: start the hybrid recipe into %s", layout.pair)
    extras = layout.work / "train-extras"
    # A fresh folder: no package of an earlier run's wheels stays beside this run's.
    shutil.rmtree(extras, ignore_errors=True)
    extras.mkdir(parents=True)
    for name in EXTRAS:
        for wheel in sorted((layout.payload / "bundle" / "wheels").glob(f"{name}-*.whl")):
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(extras)
    # Installed with pip, which keeps their programs executable (Triton's ptxas): the
    # payload's train-wheels/ (Triton 3.7.1: flash-linear-attention's gated backward refuses
    # Hopper under older Triton) and TRAIN_WHEELS.
    given = {_project(w) for w in settings.wheels}
    payload = sorted((layout.payload / "train-wheels").glob("*.whl"))
    if not payload:
        say(
            "note: no train-wheels/ in the payload (parts of an older make-parts.sh, or TRAINING=0)"
        )
    wheels = [str(w) for w in payload if _project(w) not in given]
    wheels += [str(w) for w in settings.wheels]
    if wheels:
        cmd = [PYTHON, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--upgrade"]
        if run([*cmd, "--target", str(extras), *wheels], env=layout.env()) != 0:
            raise HostStepError(f"the recipe's wheels did not install into {extras}")
    log = layout.work / "train-hybrid.log"
    env = layout.env(f"{extras}:{layout.site}", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    cmd = [PYTHON, "-m", Modules.TRAINER, "train", "--arch", "hybrid", "--out-dir"]
    cmd += [str(layout.pair), "--export", str(layout.work / "train-out"), *settings.args]
    child = detached(layout, cmd, log=log, env=env)
    say(f"training started (pid {child.pid}), log {log}")


def wait(layout: Layout, wait_s: int, out: Path | None) -> int:
    """Wait for the recipe (at most ``wait_s``), show its log's end, copy its reports into
    ``out``; 1 while there is no trained pair."""
    logger.debug("step: wait for the recipe (at most %ds)", wait_s)
    limit = wait_s
    while running(RECIPE) and limit > 0:
        time.sleep(5)
        limit -= 5
    for line in tail(layout.work / "train-hybrid.log", 25, skip="[transformers]"):
        say(line)
    if out is not None and (layout.work / "train-out").is_dir():
        shutil.copytree(layout.work / "train-out", out / "train-out", dirs_exist_ok=True)
    if not (layout.pair / "summary.json").is_file():
        say("no trained pair (yet)")
        return 1
    say(shown(["du", "-sh", str(layout.pair)], env=layout.env()))
    return 0


def call(number: int, layout: Layout, out: Path, time_limit: int, only: str = "") -> int:
    """One call of the trained pair's engines (or those ``only`` names, NAME,...), then the
    report of every call so far into ``out`` with the runs packed (no compile caches); the
    call's exit status."""
    logger.debug("step: trained pair call %d", number)
    layout.runs.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    cmd = [PYTHON, "-m", Modules.TRAINED_CALL, "run-call", str(layout.pair), str(layout.runs)]
    cmd += [str(number), "--engines-root", str(layout.engines), "--time-limit", str(time_limit)]
    cmd += ["--only", only] if only else []
    report = out / f"trained-report-{number}.txt"
    with written(report) as text:
        code = run(cmd, env=layout.env(str(layout.site)), stdout=text)
    say(f"call {number}: done in {since(start)}s")
    say(report.read_text(errors="replace").rstrip("\n"))
    # A pair carried in from an earlier session has no training output beside it.
    kept = ["trained", *(["train-out"] if (layout.work / "train-out").is_dir() else [])]
    tar = ["tar", "-czf", str(out / f"trained-{number}.tar.gz"), "--exclude=vllm-cache-*"]
    run([*tar, "-C", str(layout.work), *kept], env=layout.env())
    return code


def planned_calls(layout: Layout) -> int:
    """The last call the pair's plan has: one per K the recipe measured, then the speed
    pair's."""
    cmd = [PYTHON, "-m", Modules.TRAINED_PLAN, "plan", str(layout.pair), str(layout.runs)]
    done = procs.run(cmd, env=layout.env(str(layout.site)), timeout_s=600)
    calls = [int(line.split()[2]) for line in done.stdout.splitlines() if len(line.split()) > 2]
    if done.returncode != 0 or not calls:
        raise HostStepError(f"no calls planned on {layout.pair}: {done.stderr.strip()[-300:]}")
    return max(calls)


def chain(layout: Layout, wait_s: int, calls: list[int], time_limit: int, only: str = "") -> int:
    """Wait for the pair, then every call (or ``calls``, of the engines ``only`` names) into
    ``$WORK/results``; a call that failed fails the chain."""
    logger.debug("step: chain of calls %s", calls or "all planned")
    out = layout.work / "results"
    out.mkdir(parents=True, exist_ok=True)
    if wait(layout, wait_s, out) != 0:
        return 1
    code = 0
    for number in calls or range(1, planned_calls(layout) + 1):
        code = call(number, layout, out, time_limit, only) or code
    return code


def export_pair(number: int, layout: Layout, out: Path) -> None:
    """Call ``number``'s four parts of the pair into ``out`` (the first call's with
    SHA256SUMS and join.py too), so a later session carries it in."""
    logger.debug("step: export the pair, call %d", number)
    if not (layout.pair / "summary.json").is_file():
        raise HostStepError(f"no trained pair in {layout.pair}")
    parts = layout.work / "pair-parts"
    if not (parts / "SHA256SUMS").is_file():
        split_bundle(layout.pair, parts, PAIR_PART_BYTES, show_progress=False)
    names = sorted(
        (p.name for p in parts.glob("*.part-*")),
        key=lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)],
    )
    last = (len(names) + PARTS_A_COMMAND - 1) // PARTS_A_COMMAND - 1
    if number > last:
        raise HostRefusal(f"CALL {number} past the last, {last}")
    first = number * PARTS_A_COMMAND
    for name in names[first : first + PARTS_A_COMMAND]:
        shutil.copy(parts / name, out / name)
    if number == 0:
        for name in ("SHA256SUMS", "join.py"):
            shutil.copy(parts / name, out / name)
    say(f"pair parts: {len(names)}, four a command; this was CALL {number} of 0..{last}")


def check_pair_parts(parts: Path) -> None:
    if not (parts / "join.py").is_file():
        raise HostUsageError(f"{parts}/join.py: no such file (PARTS holds the pair's parts)")


def provide_pair(layout: Layout, pair_parts: Path | None, settings: TrainSettings) -> None:
    """The trained pair for a session's steps: the one already in place (an earlier
    session's, carried in or trained), else carried in from ``pair_parts``, else trained.
    A second session on one machine finds the pair in place; training again beside its
    steps would take the GPU from them and rewrite the pair they read."""
    if (layout.pair / "summary.json").is_file():
        say(f"trained pair: already in {layout.pair}")
    elif pair_parts is not None:
        import_pair(pair_parts, layout)
    else:
        train(layout, settings)


def import_pair(parts: Path, layout: Layout) -> None:
    """Join and check carried parts into the pair's folder."""
    logger.debug("step: import the pair from %s", parts)
    check_pair_parts(parts)
    if layout.pair.exists():
        raise HostStepError(f"{layout.pair} is there already")
    # A fresh folder: nothing of an earlier, stopped import joins this one.
    joined = layout.work / "pair-import"
    shutil.rmtree(joined, ignore_errors=True)
    join = [PYTHON, str(parts / "join.py"), str(joined)]
    code = run(join, env=layout.env(), stdout=subprocess.DEVNULL)
    if code != 0:
        raise HostStepError(f"{parts}: the pair's parts do not join (join.py says why above)")
    (joined / layout.pair.name).rename(layout.pair)
    shutil.rmtree(joined)
    size = shown(["du", "-sh", str(layout.pair)], env=layout.env()).split("\t")[0]
    say(f"trained pair carried in: {size}")


def collect(layout: Layout, out: Path) -> None:
    """What the chain has written so far, into ``out``."""
    logger.debug("step: collect the chain into %s", out)
    results = layout.work / "results"
    for source in [*sorted(results.glob("trained-*")), results / "train-out"]:
        if source.is_dir():
            shutil.copytree(source, out / source.name, dirs_exist_ok=True)
        elif source.is_file():
            shutil.copy(source, out / source.name)
    for line in tail(layout.work / "train-hybrid.log", 5):
        say(line)
    say(shown(["ls", "-la", str(out)], env=layout.env()))


def train_drafter(layout: Layout) -> None:
    """``train-background.sh``: the trained-drafter recipe in a session of its own, with the
    host's own transformers (the reference package's cached loop needs it): only dflash
    comes from the bundle."""
    logger.debug("step: start the drafter recipe")
    wheels = sorted((layout.payload / "bundle" / "wheels").glob("dflash-*.whl"))
    if len(wheels) != 1:
        raise HostStepError(
            f"{layout.payload}/bundle/wheels: no dflash wheel (parts of make-parts.sh)"
        )
    only = layout.work / "dflash-only"
    with zipfile.ZipFile(wheels[0]) as archive:
        archive.extractall(only)
    log = layout.work / "train.log"
    cmd = [PYTHON, "-m", Modules.TRAINER, "train", "--export", str(layout.work / "train-out")]
    child = detached(layout, cmd, log=log, env=layout.env(str(only)))
    say(f"training started (pid {child.pid}), log {log}")
