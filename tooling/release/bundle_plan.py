"""What a bundle holds: its settings and the choice of wheels from a resolution (pure)."""

from __future__ import annotations

import datetime as dt
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement
from packaging.requirements import Requirement as PipRequirement
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from ..errors import BundleError
from ..fetching.bases import Base
from ..fetching.fetch import DEFAULT_INDEX_URL
from .lock import ROOT, Requirement

logger = logging.getLogger(__name__)

DEFAULT_PYTHON_VERSION = "3.12"
DEFAULT_PLATFORM = "manylinux_2_35_x86_64"
#: None: each base's wheel pins its own torch (0.20.1: 2.11.0, 0.34.0: 2.14.0), and a pin of
#: one base's made every other base's closure unsolvable.
DEFAULT_PINS: tuple[str, ...] = ()
DEFAULT_EXTRAS = ("dflash==0.1.0",)
# Required by vLLM 0.20.1's metadata but not imported on the Qwen3 + DFlash +
# FLASH_ATTN path (upstream-notes section 4), and large: left out unless asked.
DEFAULT_SKIP = (
    "flashinfer-python",
    "flashinfer-cubin",
    "tilelang",
    "quack-kernels",
    "nvidia-cutlass-dsl",
)
# Kept although only skipped packages require it: apache-tvm-ffi (which vLLM
# imports through xgrammar) loads it when present and otherwise JIT-compiles
# it at import time (tvm_ffi/_optional_torch_c_dlpack.py).
DEFAULT_KEEP = ("torch-c-dlpack-ext",)


@dataclass(frozen=True)
class BundleConfig:
    """One bundle: the patched wheel, where to write, and how to resolve."""

    wheel: Path
    out_dir: Path
    exclude_newer: str
    """uv's cut-off: a date (YYYY-MM-DD) or an RFC 3339 time; see :func:`exclude_newer_for`."""
    python_version: str = DEFAULT_PYTHON_VERSION
    platform: str = DEFAULT_PLATFORM
    pins: tuple[str, ...] = DEFAULT_PINS
    extras: tuple[str, ...] = DEFAULT_EXTRAS
    """Wheels added without their dependencies and outside the date cut."""
    skip: tuple[str, ...] = DEFAULT_SKIP
    keep: tuple[str, ...] = DEFAULT_KEEP
    """Never left out for being needed only by skipped packages."""
    excludes: tuple[str, ...] = ()
    """Left out of the resolution itself (the base's ``bundle_excludes``)."""
    exclude_present: Path | None = None
    split_bytes: int | None = None
    index_url: str = DEFAULT_INDEX_URL
    name: str | None = None
    """Bundle folder name; default ``vllm-<version>-bundle-cp<py>-<platform>``."""
    download_dir: Path | None = None
    """Where wheels are downloaded and kept between runs (default: a temp folder)."""
    progress: bool = True
    offline: bool = False
    """No network: uv resolves from its cache, pip takes the wheels ``download_dir`` kept."""


@dataclass(frozen=True)
class PlanEntry:
    """One wheel the bundle will hold."""

    name: str
    version: str
    source: str
    """``patched`` (the caller's wheel), ``resolved`` (from the lock) or ``extra``."""
    hashes: tuple[str, ...] = ()
    path: str | None = None


@dataclass(frozen=True)
class BundlePlan:
    """What goes in, what stays out and why (pure data, printable as JSON)."""

    include: tuple[PlanEntry, ...]
    present: tuple[tuple[str, str], ...]
    """(name, version) left out because the host already has them."""
    skipped: tuple[tuple[str, str, str], ...]
    """(name, version, reason) left out on request or because only skipped ones need them."""

    def to_json(self) -> dict[str, Any]:
        return {
            "include": [asdict(e) for e in self.include],
            "present": [list(p) for p in self.present],
            "skipped": [list(s) for s in self.skipped],
        }


def exclude_newer_for(base: Base) -> str:
    """The resolution cut-off for ``base``: two days after its release date.

    The pinned wheel of a release can be a rebuild uploaded a day later (0.20.1's
    build-tag wheel was), and uv reads a bare date as its first instant; two days
    cover the rebuild's whole upload day. For 0.20.1 this gives 2026-05-06, the
    cut-off ``vllm-0.20.1-runtime-lock.txt`` was resolved with.
    """
    day = dt.date.fromisoformat(base.release_date) + dt.timedelta(days=2)
    return day.isoformat()


def parse_size(text: str) -> int:
    """Bytes in ``60M``, ``1G``, ``512K`` (binary units) or a plain byte count."""
    match = re.fullmatch(r"\s*(\d{1,15})\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match or int(match.group(1)) == 0:
        raise BundleError(f"--split {text!r}: give a size such as 60M, 1G or 512K")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[match.group(2).upper()]
    return int(match.group(1)) * scale


def _version_or_none(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def parse_present(text: str) -> dict[str, str | None]:
    """What a host has, from ``pip freeze``, ``pip list``, wheel file names or bare names.

    Returns canonical name -> version, or None where the line names no version
    (a bare name or a direct URL): such a package counts as present in any version.
    """
    present: dict[str, str | None] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-") or set(line) <= {"-", " "}:
            continue
        if " @ " in line:
            present[canonicalize_name(line.split(" @ ", 1)[0].strip())] = None
        elif line.endswith(".whl"):
            try:
                wheel_name, wheel_version, _, _ = parse_wheel_filename(Path(line).name)
            except InvalidWheelFilename:
                raise BundleError(f"exclude-present list: {line!r} is no wheel name") from None
            present[canonicalize_name(wheel_name)] = str(wheel_version)
        elif "==" in line:
            pinned, _, version = line.partition("==")
            present[canonicalize_name(pinned.strip())] = version.strip().split(";")[0].strip()
        else:
            parts = line.split()
            if [p.lower() for p in parts] == ["package", "version"]:
                continue  # the header of `pip list`
            if len(parts) == 2 and _version_or_none(parts[1]) is not None:
                present[canonicalize_name(parts[0])] = parts[1]
            elif len(parts) == 1 and re.fullmatch(r"[A-Za-z0-9._-]+", parts[0]):
                present[canonicalize_name(parts[0])] = None
            else:
                raise BundleError(f"exclude-present list: cannot read the line {raw.strip()!r}")
    return present


def is_present(name: str, version: str, present: dict[str, str | None]) -> bool:
    """True when the host's package satisfies ``name==version``.

    A listed version matches on its public part, so the host's ``torch
    2.11.0+cu130`` counts as ``torch==2.11.0``; another version does not (the
    bundle then carries the release's one, as it did transformers 5.8.0 over a
    host's 5.17.0). A bare name matches any version.
    """
    if name not in present:
        return False
    have = present[name]
    if have is None:
        return True
    a, b = _version_or_none(have), _version_or_none(version)
    if a is None or b is None:
        return have == version
    return a.public == b.public


def skip_closure(
    requirements: Sequence[Requirement], skip: Iterable[str], keep: Iterable[str] = DEFAULT_KEEP
) -> dict[str, str]:
    """Names left out -> why: the ones asked for, and those only they need.

    A package stays when anything kept (or the input itself) still needs it,
    and a ``keep`` one stays unless asked for by name.
    """
    dropped: dict[str, str] = {canonicalize_name(s): "asked to skip" for s in skip}
    kept = {canonicalize_name(k) for k in keep}
    by_name = {r.name: r for r in requirements}
    changed = True
    while changed:
        changed = False
        for req in requirements:
            if req.name in dropped or req.name in kept or not req.via or ROOT in req.via:
                continue
            parents = [parent for parent in req.via if parent in by_name]
            # Unknown parents (outside this resolution) keep a package, as the input does.
            if parents and all(parent in dropped for parent in parents):
                dropped[req.name] = "only needed by " + ", ".join(sorted(req.via))
                changed = True
    return {name: why for name, why in dropped.items() if name in by_name}


def plan_bundle(
    requirements: Sequence[Requirement],
    *,
    wheel: Path,
    present: dict[str, str | None] | None = None,
    skip: Iterable[str] = DEFAULT_SKIP,
    keep: Iterable[str] = DEFAULT_KEEP,
    extras: Iterable[str] = DEFAULT_EXTRAS,
) -> BundlePlan:
    """Choose the bundle's wheels from a resolution (pure).

    The patched ``wheel`` replaces vLLM's resolved entry and is always carried;
    skipped packages and what only they need are left out; so is what ``present``
    already satisfies; ``extras`` (``name==version``) are added unless present.
    """
    present = present or {}
    wheel_name, wheel_version, _, _ = parse_wheel_filename(wheel.name)
    patched = canonicalize_name(wheel_name)
    dropped = skip_closure(requirements, skip, keep)
    include = [PlanEntry(patched, str(wheel_version), "patched", path=str(wheel))]
    kept_present: list[tuple[str, str]] = []
    skipped: list[tuple[str, str, str]] = []
    for req in sorted(requirements, key=lambda r: r.name):
        if req.name == patched:
            continue
        if req.name in dropped:
            skipped.append((req.name, req.version, dropped[req.name]))
        elif is_present(req.name, req.version, present):
            kept_present.append((req.name, req.version))
        else:
            include.append(PlanEntry(req.name, req.version, "resolved", req.hashes))
    for name, version in pinned_extras(extras):
        resolved = next((e for e in include if e.name == name), None)
        if resolved is not None:
            # A pin is honoured exactly or refused: the bundle carries one version of a
            # package, and one the resolution needs stays (it shipped in the pin's place).
            if Version(resolved.version) != Version(version):
                raise BundleError(
                    f"--extra {name}=={version}: the resolution needs {name} "
                    f"{resolved.version}, and a bundle carries one version of a package "
                    f"(pin {resolved.version}, or leave {name} out of --extra)"
                )
        elif is_present(name, version, present):
            kept_present.append((name, version))
        else:
            include.append(PlanEntry(name, version, "extra"))
    logger.debug(
        "plan: %d wheels to carry, %d present already, %d skipped",
        len(include),
        len(kept_present),
        len(skipped),
    )
    return BundlePlan(tuple(include), tuple(kept_present), tuple(skipped))


def pinned_extras(extras: Iterable[str]) -> list[tuple[str, str]]:
    """Each ``--extra`` as (canonical name, version): exactly ``name==version``, a valid
    name and version and nothing else (no range, no wildcard, no marker, no URL), each
    package once; anything else is a BundleError naming it."""
    pins: dict[str, str] = {}
    for extra in extras:
        try:
            requirement = PipRequirement(extra)
        except InvalidRequirement:
            requirement = None
        specifiers = list(requirement.specifier) if requirement else []
        exact = (
            requirement is not None
            and not requirement.extras
            and requirement.marker is None
            and requirement.url is None
            and len(specifiers) == 1
            and specifiers[0].operator == "=="
            and "*" not in specifiers[0].version
        )
        if not exact or requirement is None:
            raise BundleError(f"--extra {extra!r}: give it as name==version (one exact version)")
        name, version = canonicalize_name(requirement.name), specifiers[0].version
        if name in pins and Version(pins[name]) != Version(version):
            raise BundleError(f"--extra {name}: pinned twice, to {pins[name]} and {version}")
        pins[name] = version
    return list(pins.items())


def default_bundle_name(config: BundleConfig) -> str:
    name, version, _, _ = parse_wheel_filename(config.wheel.name)
    py = config.python_version.replace(".", "")
    return f"{canonicalize_name(name)}-{version}-bundle-cp{py}-{config.platform}"
