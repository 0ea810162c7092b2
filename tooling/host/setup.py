"""``host-setup.sh``: join the carried parts, install vLLM's dependencies into ``$SITE``, then
build and install every engine variant (stock, patched and the ablations) under ``$ENGINES``.

The parts carry one vLLM release (``make-parts.sh``, ``BASE``): its sdist's name says which,
and every build is for it. The ablations come from the series (``tooling.patching.series``):
one per patch asked for, without it and every patch written on it. On a ported base each
build also leaves out the fixes that name no code there (the candidate wheel)."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from ..errors import HostStepError, HostUsageError
from ..patching.series import Series
from .layout import PYTHON, Layout, Modules, run, say, shown, tail, written

logger = logging.getLogger(__name__)

#: The vLLM the engines are unless the parts say otherwise: its official wheel is stock, its
#: sdist the builds' source.
VLLM = "vllm-0.20.1"


class SetupStep(StrEnum):
    """How far ``setup`` goes: ``install`` stops once vLLM's dependencies are in ``$SITE``
    (enough for the recipe, which can train while ``build`` makes the engines)."""

    ALL = "all"
    INSTALL = "install"
    BUILD = "build"


@dataclass(frozen=True)
class Ablation:
    """An engine without ``patch`` and the patches written on it (series.toml ``requires``)."""

    patch: str
    dependents: tuple[str, ...]

    @property
    def engine(self) -> str:
        return f"no-{self.patch}"

    @property
    def skipped(self) -> tuple[str, ...]:
        return (self.patch, *self.dependents)


def ablations(series: Series, asked: list[str] | None) -> list[Ablation]:
    """One ablation per patch id in ``asked`` (a comma-joined group counts by its first id;
    None: every patch of the series)."""
    known = [p.id for p in series.patches]
    ids = known if asked is None else [word.split(",")[0] for word in asked]
    for patch in ids:
        if patch not in known:
            raise HostUsageError(f"ABLATIONS: {patch} is not a patch of the series")
    return [Ablation(patch, _written_on(series, patch)) for patch in ids]


def _written_on(series: Series, patch: str) -> tuple[str, ...]:
    """The patches written on ``patch``, and on those in turn, in series order: an install
    without ``patch`` leaves them all out (``Series.without`` refuses any fewer)."""
    left_out = {patch}
    for q in series.patches:  # a patch requires only earlier ones
        if left_out & set(q.requires):
            left_out.add(q.id)
    return tuple(q.id for q in series.patches if q.id in left_out - {patch})


def check_parts(parts: Path, step: SetupStep) -> None:
    if step is not SetupStep.BUILD and not (parts / "join.py").is_file():
        raise HostUsageError(
            f"{parts}/join.py: no such file (PARTS_DIR holds the parts make-parts.sh made)"
        )


def payload_release(payload: Path) -> str:
    """``vllm-VERSION``: the release the joined parts carry, named by its one sdist."""
    found = sorted(payload.glob("vllm-*.tar.gz"))
    if not (payload / "bundle" / "install.sh").is_file() or len(found) != 1:
        raise HostUsageError(
            f"{payload}: expected bundle/install.sh and one vllm-VERSION.tar.gz "
            "(parts made by make-parts.sh)"
        )
    return found[0].name.removesuffix(".tar.gz")


def install(parts: Path, layout: Layout) -> None:
    """Join the parts into ``$WORK/joined`` and install the bundle into ``$SITE``."""
    logger.debug("step: join %s, install the bundle into %s", parts, layout.site)
    env = layout.env()
    if run([PYTHON, str(parts / "join.py"), str(layout.work / "joined")], env=env) != 0:
        raise HostStepError(f"{parts}: the parts do not join (join.py says why above)")
    payload = layout.payload
    payload_release(payload)
    log = layout.work / "install.log"
    with written(log) as out:
        code = run(
            ["sh", str(payload / "bundle" / "install.sh"), "--target", str(layout.site)],
            env=env,
            stdout=out,
            stderr=out,
        )
    if code != 0:
        for line in tail(log, 20):
            say(line)
        raise HostStepError(f"the bundle did not install (exit {code}): {log}")


def _one_wheel(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    if len(found) != 1:
        raise HostStepError(f"{folder}: {len(found)} files {pattern}, expected one")
    return found[0]


def _pip_install(layout: Layout, engine: str, wheel: Path) -> None:
    cmd = [PYTHON, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"]
    cmd += ["--target", str(layout.engine(engine)), str(wheel)]
    if run(cmd, env=layout.env(str(layout.site))) != 0:
        raise HostStepError(f"{wheel.name}: pip could not install it into {layout.engine(engine)}")


def _build(layout: Layout, dist: Path, options: list[str], record: Path) -> Path:
    """``tooling build`` into ``dist`` (offline, on ``$SITE``), its JSON in ``record``."""
    cmd = [PYTHON, "-m", Modules.TOOLING, "--offline", "--no-progress", "build"]
    cmd += ["--dist", str(dist), *options, "--json"]
    with written(record) as out:
        code = run(cmd, env=layout.env(str(layout.site)), stdout=out)
    if code != 0:
        raise HostStepError(f"tooling build {' '.join(options)} failed (exit {code}): {record}")
    return _one_wheel(dist, "vllm-*.whl")


def build_engines(
    layout: Layout, chosen: list[Ablation], probe_python: str | None, series: Series | None
) -> None:
    """The patched wheel (probed by ``probe_python``, or not at all: None), stock and the
    ablations, each pip-installed into its own folder under ``$ENGINES``."""
    logger.debug("step: build the engines into %s (%d ablations)", layout.engines, len(chosen))
    payload = layout.payload
    release = payload_release(payload)
    base = release.removeprefix("vllm-")
    official = _one_wheel(payload / "bundle" / "wheels", f"{release}-*.whl")
    pypi = layout.cache / "pypi"
    for source in (official, payload / f"{release}.tar.gz"):
        shutil.copy(source, pypi / source.name)
    # A ported base's fixes with no code there are left out of every build, by name.
    absent = series.without_code_on(base) if series is not None else ()
    if absent:
        say(f"base {base}: every build leaves out {', '.join(absent)} (no code there)")
    on_base = ["--base", base, *[word for pid in absent for word in ("--skip", pid)]]
    probes = ["--no-probes"] if probe_python is None else ["--probe-python", probe_python]
    patched = _build(
        layout, layout.work / "dist", [*on_base, *probes], layout.work / "build-patched.json"
    )
    _pip_install(layout, "stock", official)
    _pip_install(layout, "patched", patched)
    for ablation in chosen:
        logger.debug("ablation %s: without %s", ablation.engine, ", ".join(ablation.skipped))
        skipped = [pid for pid in ablation.skipped if pid not in absent]
        skips = [word for pid in skipped for word in ("--skip", pid)]
        wheel = _build(
            layout,
            layout.work / f"dist-{ablation.patch}",
            [*on_base, *skips, "--no-probes"],
            layout.work / f"build-no-{ablation.patch}.json",
        )
        _pip_install(layout, ablation.engine, wheel)
    wheels = sorted(str(p) for p in layout.work.glob("dist*/vllm-*.whl"))
    say(shown(["sha256sum", *wheels], env=layout.env()))
    built = json.loads((layout.work / "build-patched.json").read_text())
    statuses = [(p["id"], p["status"], p["probe"]) for p in built["patches"]]
    say(f"patched: {built['filename']} {built['sha256']} {statuses}")


def setup(
    parts: Path,
    step: SetupStep,
    layout: Layout,
    chosen: list[Ablation],
    probe_python: str | None,
    series: Series | None = None,
) -> None:
    """The whole of ``host-setup.sh``: ``step`` says how much of it."""
    check_parts(parts, step)
    for folder in (layout.work, layout.engines, layout.cache / "pypi"):
        folder.mkdir(parents=True, exist_ok=True)
    if step is not SetupStep.BUILD:
        install(parts, layout)
    if step is not SetupStep.INSTALL:
        build_engines(layout, chosen, probe_python, series)
