"""``tooling bundle``: an offline wheelhouse for air-gapped GPU hosts.

Three stages, each returning plain data the CLI can print as JSON:

1. :func:`resolve` runs ``uv pip compile`` (``python -m uv``) on the patched
   wheel plus pins (``torch==2.11.0``), for CPython 3.12 on
   ``manylinux_2_35_x86_64``, with ``--exclude-newer`` at the base's release, so
   every dependency has the version vLLM was released against.
2. :func:`plan_bundle` (pure) leaves out what the caller asked to skip (and
   what only those need), what the host already has (``--exclude-present``),
   puts the patched wheel in vLLM's place and adds extra wheels (the reference
   ``dflash`` package the smoke compares against).
3. :func:`download` (``pip download --no-deps --only-binary=:all:`` with the
   target's tags, hash-checked) and :func:`write_bundle` write the folder:
   ``wheels/``, ``requirements.lock`` (the full resolution), ``install.txt``
   (what is in ``wheels/``, with sha256), ``install.sh``, ``SHA256SUMS``,
   ``bundle.json``; optionally split into parts no larger than N bytes, with
   ``join.py`` (python3, stdlib only) that checks every sha256 and unpacks.

Every folder is written beside its final place and renamed into it, so an
interrupted run leaves nothing that looks like a bundle.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, BinaryIO

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from .. import procs
from ..errors import BundleError, EnvironmentProblem
from ..fetching.bases import Base
from ..fetching.fetch import DEFAULT_INDEX_URL
from ..fsutil import atomic_write_text, sha256_file, staging_dir
from ..progress import progress_bar, step_bar

DEFAULT_PYTHON_VERSION = "3.12"
DEFAULT_PLATFORM = "manylinux_2_35_x86_64"
DEFAULT_PINS = ("torch==2.11.0",)
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
# it at import time (tvm_ffi/_optional_torch_c_dlpack.py); the 2026-11-29 host
# needed it carried.
DEFAULT_KEEP = ("torch-c-dlpack-ext",)
ROOT = "-r"
"""The ``via`` marker of a requirement the input asked for directly."""


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
    exclude_present: Path | None = None
    split_bytes: int | None = None
    index_url: str = DEFAULT_INDEX_URL
    name: str | None = None
    """Bundle folder name; default ``vllm-<version>-bundle-cp<py>-<platform>``."""
    download_dir: Path | None = None
    """Where wheels are downloaded and kept between runs (default: a temp folder)."""
    progress: bool = True


@dataclass(frozen=True)
class Requirement:
    """One line of the resolution: a pinned distribution and why it is there."""

    name: str
    """Canonical (PEP 503) name."""
    version: str
    hashes: tuple[str, ...] = ()
    """sha256 digests the index lists for this version (any file of it)."""
    via: tuple[str, ...] = ()
    """Canonical names of the requirements that pulled it in; ``-r`` for a direct one."""
    path: str | None = None
    """A local wheel the input named by path (the patched vLLM)."""


@dataclass(frozen=True)
class Resolution:
    """The output of ``uv pip compile``, parsed, and the command that made it."""

    requirements: tuple[Requirement, ...]
    lock_text: str
    command: tuple[str, ...]


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


@dataclass(frozen=True)
class BundleFile:
    path: str
    """Relative to the bundle (or parts) folder."""
    size: int
    sha256: str


@dataclass
class BundleResult:
    """What :func:`write_bundle` wrote."""

    bundle_dir: Path
    files: list[BundleFile]
    total_bytes: int
    parts_dir: Path | None = None
    parts: list[BundleFile] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "bundle_dir": str(self.bundle_dir),
            "total_bytes": self.total_bytes,
            "files": [asdict(f) for f in self.files],
            "parts_dir": str(self.parts_dir) if self.parts_dir else None,
            "parts": [asdict(p) for p in self.parts],
        }


# ---------------------------------------------------------------------------
# Small pure helpers


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
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match or int(match.group(1)) == 0:
        raise BundleError(f"--split {text!r}: give a size such as 60M, 1G or 512K")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[match.group(2).upper()]
    return int(match.group(1)) * scale


def uv_platform(platform: str) -> str:
    """uv's ``--python-platform`` for a wheel platform tag.

    ``manylinux_2_35_x86_64`` becomes ``x86_64-manylinux_2_35``.
    """
    match = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", platform)
    if not match:
        raise BundleError(f"platform {platform!r}: expected a tag like manylinux_2_35_x86_64")
    major, minor, arch = match.groups()
    return f"{arch}-manylinux_{major}_{minor}"


def platform_tags(platform: str) -> list[str]:
    """Every manylinux tag a host of ``platform`` accepts, newest first.

    pip download matches platform tags exactly, so a glibc 2.35 host must be
    offered 2.35 down to 2.5 and the legacy aliases (manylinux2014 = 2.17,
    manylinux2010 = 2.12, manylinux1 = 2.5).
    """
    match = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", platform)
    if not match:
        raise BundleError(f"platform {platform!r}: expected a tag like manylinux_2_35_x86_64")
    major, minor, arch = int(match.group(1)), int(match.group(2)), match.group(3)
    if major != 2:
        raise BundleError(f"platform {platform!r}: only glibc 2.x manylinux tags are known")
    tags = [f"manylinux_2_{m}_{arch}" for m in range(minor, 4, -1)]
    aliases = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags += [f"{alias}_{arch}" for m, alias in aliases.items() if m <= minor]
    return tags


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


_REQ_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")


def parse_lock(text: str) -> list[Requirement]:
    """The requirements of a ``uv pip compile`` output (with or without hashes).

    Reads ``name==version`` lines, their ``--hash`` continuations, their
    ``# via`` blocks, and a direct wheel named by path or ``name @ file://``.
    """
    entries: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    in_via = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if raw[0] not in " \t#":
            in_via = False
            current = _requirement_start(line)
            entries.append(current)
        elif current is None:
            continue
        elif line.startswith("--hash=sha256:"):
            current["hashes"].append(line.removeprefix("--hash=sha256:").rstrip(" \\"))
        elif line.startswith("# via"):
            rest = line.removeprefix("# via").strip()
            in_via = not rest
            if rest:
                current["via"].append(rest)
        elif in_via and line.startswith("#"):
            current["via"].append(line.lstrip("#").strip())
    return [
        Requirement(
            name=e["name"],
            version=e["version"],
            hashes=tuple(e["hashes"]),
            via=tuple(_via_name(v) for v in e["via"]),
            path=e["path"],
        )
        for e in entries
    ]


def _requirement_start(line: str) -> dict[str, Any]:
    line = line.rstrip(" \\")
    entry: dict[str, Any] = {"hashes": [], "via": [], "path": None}
    for token in line.split()[1:]:
        if token.startswith("--hash=sha256:"):
            entry["hashes"].append(token.removeprefix("--hash=sha256:"))
    head = line.split()[0]
    match = _REQ_LINE.match(line)
    if match:
        entry.update(name=canonicalize_name(match.group(1)), version=match.group(2))
        return entry
    location = line.split(" @ ", 1)[1].split()[0] if " @ " in line else head
    location = location.removeprefix("file://")
    if not location.endswith(".whl"):
        raise BundleError(f"resolution: cannot read the requirement {line!r}")
    name, version, _, _ = parse_wheel_filename(Path(location).name)
    entry.update(name=canonicalize_name(name), version=str(version), path=location)
    return entry


def _via_name(text: str) -> str:
    # "-r requirements.in" (a direct requirement) or a package name.
    return ROOT if text.startswith("-r") else canonicalize_name(text.split()[0])


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
    for extra in extras:
        name, sep, version = extra.partition("==")
        if not sep or not version:
            raise BundleError(f"extra wheel {extra!r}: give it as name==version")
        name = canonicalize_name(name.strip())
        if is_present(name, version.strip(), present):
            kept_present.append((name, version.strip()))
        elif all(e.name != name for e in include):
            include.append(PlanEntry(name, version.strip(), "extra"))
    return BundlePlan(tuple(include), tuple(kept_present), tuple(skipped))


def default_bundle_name(config: BundleConfig) -> str:
    name, version, _, _ = parse_wheel_filename(config.wheel.name)
    py = config.python_version.replace(".", "")
    return f"{canonicalize_name(name)}-{version}-bundle-cp{py}-{config.platform}"


# ---------------------------------------------------------------------------
# Effects: uv, pip, files


def _uv_available() -> None:
    try:
        import uv  # noqa: F401
    except ImportError:
        raise EnvironmentProblem(
            "uv is not installed in this Python: pip install uv (tooling bundle resolves with it)"
        ) from None


def resolve(config: BundleConfig) -> Resolution:
    """Resolve the patched wheel's runtime closure with ``uv pip compile``."""
    if not config.wheel.is_file():
        raise BundleError(f"{config.wheel}: no such wheel")
    _uv_available()
    with tempfile.TemporaryDirectory(prefix="bundle-resolve-") as tmp:
        req_in = Path(tmp) / "requirements.in"
        req_in.write_text("\n".join([str(config.wheel.resolve()), *config.pins]) + "\n")
        out = Path(tmp) / "requirements.txt"
        cmd = (
            sys.executable,
            "-m",
            "uv",
            "pip",
            "compile",
            str(req_in),
            "--output-file",
            str(out),
            "--python-version",
            config.python_version,
            "--python-platform",
            uv_platform(config.platform),
            "--exclude-newer",
            config.exclude_newer,
            "--index-url",
            config.index_url,
            # Reproducible: no uv.toml or pyproject settings of whoever runs it.
            "--no-config",
            "--generate-hashes",
            "--no-header",
            "--quiet",
        )
        result = procs.run(cmd)
        if result.returncode != 0:
            lines = [ln for ln in (result.stderr or "").splitlines() if ln.strip()]
            why = " ".join(lines[-3:]) if lines else f"exit {result.returncode}"
            raise BundleError(f"uv could not resolve {config.wheel.name}: {why}")
        text = out.read_text(encoding="utf-8")
        requirements = tuple(parse_lock(text))
        # The lock names the input file and the wheel by temporary/local paths;
        # in the bundle they are requirements.in and wheels/<file>.
        text = text.replace(str(req_in), "requirements.in")
        text = text.replace(str(config.wheel.resolve()), f"./wheels/{config.wheel.name}")
    return Resolution(requirements, text, cmd)


def _pip_download_cmd(config: BundleConfig, dest: Path, req_file: Path, hashed: bool) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        config.python_version,
        "--implementation",
        "cp",
        "--abi",
        f"cp{config.python_version.replace('.', '')}",
        "--abi",
        "abi3",
        "--abi",
        "none",
        "--index-url",
        config.index_url,
        "--dest",
        str(dest),
        "--progress-bar",
        "off",
        "--disable-pip-version-check",
        "--no-input",
        "-r",
        str(req_file),
    ]
    for tag in platform_tags(config.platform):
        cmd += ["--platform", tag]
    if hashed:
        cmd.append("--require-hashes")
    return cmd


def _pip_env() -> dict[str, str]:
    # No pip.conf of this machine (constraints, extra indexes): the bundle must
    # not depend on who builds it. The index is passed explicitly.
    return {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INPUT": "1"}


def _run_pip(cmd: list[str], total: int, label: str, show: bool, log: Path) -> None:
    saved = re.compile(r"^(Saved|File was already downloaded) ")
    with step_bar(total, label, show) as bar, open(log, "a", encoding="utf-8") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        with procs.started(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=_pip_env(),
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
                if saved.match(line):
                    bar.update(1)
            code = proc.wait()
    if code != 0:
        tail = [ln for ln in log.read_text(encoding="utf-8").splitlines() if ln.strip()][-2:]
        raise BundleError(f"pip download failed: {' '.join(tail)} (log: {log})")


def download(plan: BundlePlan, config: BundleConfig, dest: Path) -> dict[str, Path]:
    """Download every wheel of ``plan`` (the patched one is copied later); name -> file.

    Resolved wheels are checked against the hashes uv recorded (``--require-hashes``);
    extras have none and are hashed into install.txt after download.
    """
    dest.mkdir(parents=True, exist_ok=True)
    log = dest / "pip-download.log"
    wanted = [e for e in plan.include if e.source != "patched"]
    with tempfile.TemporaryDirectory(prefix="bundle-download-") as tmp:
        for hashed in (True, False):
            batch = [e for e in wanted if bool(e.hashes) == hashed]
            if not batch:
                continue
            req_file = Path(tmp) / f"requirements-{'hashed' if hashed else 'plain'}.txt"
            lines = []
            for e in batch:
                hashes = "".join(f" --hash=sha256:{h}" for h in e.hashes)
                lines.append(f"{e.name}=={e.version}{hashes}")
            req_file.write_text("\n".join(lines) + "\n")
            cmd = _pip_download_cmd(config, dest, req_file, hashed)
            _run_pip(cmd, len(batch), "download", config.progress, log)
    return _match_wheels(wanted, dest)


def _match_wheels(entries: Sequence[PlanEntry], folder: Path) -> dict[str, Path]:
    found: dict[tuple[str, Version], Path] = {}
    for path in sorted(folder.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(path.name)
        found[(canonicalize_name(name), version)] = path
    result = {}
    for e in entries:
        match = found.get((e.name, Version(e.version)))
        if match is None:
            raise BundleError(f"{e.name}=={e.version}: no wheel in {folder} after download")
        result[e.name] = match
    return result


def _bundle_file(name: str) -> str:
    """A script the bundle carries, from ``tooling/release/bundle_files`` (package data: the
    files are linted and tested as themselves, shellcheck included)."""
    return (
        resources.files("tooling.release")
        .joinpath("bundle_files", name)
        .read_text(encoding="utf-8")
    )


def _sums_text(files: Iterable[BundleFile]) -> str:
    # The format of sha256sum(1): `sha256sum -c SHA256SUMS` checks it too.
    return "".join(f"{f.sha256}  {f.path}\n" for f in files)


def _describe(root: Path) -> list[BundleFile]:
    files = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        files.append(BundleFile(rel, path.stat().st_size, sha256_file(path)))
    return files


def write_bundle(
    plan: BundlePlan,
    wheels: dict[str, Path],
    config: BundleConfig,
    resolution: Resolution | None = None,
) -> BundleResult:
    """Write the bundle folder (and its parts when ``config.split_bytes`` is set).

    ``wheels`` maps every non-patched plan entry to its downloaded file.
    """
    name = config.name or default_bundle_name(config)
    final = config.out_dir / name
    sources: list[tuple[PlanEntry, Path]] = []
    for entry in plan.include:
        path = config.wheel if entry.source == "patched" else wheels.get(entry.name)
        if path is None or not path.is_file():
            raise BundleError(f"{entry.name}=={entry.version}: its wheel was not downloaded")
        sources.append((entry, path))
    total = sum(p.stat().st_size for _, p in sources)
    with staging_dir(final) as tmp:
        (tmp / "wheels").mkdir()
        install_lines = []
        with progress_bar(total, "bundle", config.progress) as bar:
            for entry, path in sources:
                target = tmp / "wheels" / path.name
                shutil.copyfile(path, target)
                bar.update(target.stat().st_size)
                digest = sha256_file(target)
                if entry.hashes and digest not in entry.hashes:
                    raise BundleError(
                        f"{path.name}: sha256 {digest} is none of the index's for "
                        f"{entry.name}=={entry.version}"
                    )
                install_lines.append(f"{entry.name}=={entry.version} --hash=sha256:{digest}")
        header = (
            f"# vLLM runtime closure for CPython {config.python_version} on {config.platform},\n"
            f"# resolved with --exclude-newer {config.exclude_newer} (uv pip compile).\n"
        )
        if resolution is not None:
            (tmp / "requirements.lock").write_text(header + resolution.lock_text)
        (tmp / "install.txt").write_text("\n".join(sorted(install_lines)) + "\n")
        (tmp / "install.sh").write_text(_bundle_file("install.sh"))
        (tmp / "install.sh").chmod(0o755)
        manifest = {
            "name": name,
            "wheel": config.wheel.name,
            "python_version": config.python_version,
            "platform": config.platform,
            "exclude_newer": config.exclude_newer,
            "resolve_command": list(resolution.command) if resolution else None,
            "plan": plan.to_json(),
        }
        (tmp / "bundle.json").write_text(json.dumps(manifest, indent=2) + "\n")
        files = _describe(tmp)
        (tmp / "SHA256SUMS").write_text(_sums_text(files))
    result = BundleResult(bundle_dir=final, files=files, total_bytes=sum(f.size for f in files))
    if config.split_bytes:
        result.parts_dir, result.parts = split_bundle(
            final, config.out_dir / f"{name}-parts", config.split_bytes, config.progress
        )
    return result


class _PartWriter:
    """A write-only stream that fills numbered files of at most ``limit`` bytes."""

    def __init__(self, folder: Path, stem: str, limit: int) -> None:
        self.folder, self.stem, self.limit = folder, stem, limit
        self.parts: list[Path] = []
        self.whole = hashlib.sha256()
        self._file: BinaryIO | None = None
        self._used = 0

    def _next(self) -> BinaryIO:
        if self._file is not None:
            self._file.close()
        path = self.folder / f"{self.stem}.part-{len(self.parts):03d}"
        self.parts.append(path)
        self._file = open(path, "wb")  # noqa: SIM115 (closed by _next/close)
        self._used = 0
        return self._file

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        self.whole.update(view)
        while view:
            out = self._file
            if out is None or self._used >= self.limit:
                out = self._next()
            room = self.limit - self._used
            out.write(view[:room])
            self._used += min(room, len(view))
            view = view[room:]
        return len(data)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _tar_filter(info: tarfile.TarInfo) -> tarfile.TarInfo:
    # Same bytes for the same bundle: no owners, no times.
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    return info


def split_bundle(
    bundle_dir: Path, parts_dir: Path, limit: int, show_progress: bool = True
) -> tuple[Path, list[BundleFile]]:
    """Tar ``bundle_dir`` into parts of at most ``limit`` bytes, with SHA256SUMS and join.py."""
    if limit < 1:
        raise BundleError(f"split size {limit} is not positive")
    stem = f"{bundle_dir.name}.tar"
    total = sum(p.stat().st_size for p in bundle_dir.rglob("*") if p.is_file())
    with staging_dir(parts_dir) as tmp:
        writer = _PartWriter(tmp, stem, limit)
        try:
            with (
                progress_bar(total, "split", show_progress) as bar,
                tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar,  # type: ignore[call-overload]
            ):
                for path in [bundle_dir, *sorted(bundle_dir.rglob("*"))]:
                    arcname = Path(bundle_dir.name) / path.relative_to(bundle_dir)
                    info = _tar_filter(tar.gettarinfo(path, arcname.as_posix()))
                    if path.is_file():
                        with open(path, "rb") as f:
                            tar.addfile(info, f)
                        bar.update(info.size)
                    else:
                        tar.addfile(info)
        finally:
            writer.close()
        parts = [BundleFile(p.name, p.stat().st_size, sha256_file(p)) for p in writer.parts]
        whole = BundleFile(stem, sum(p.size for p in parts), writer.whole.hexdigest())
        (tmp / "SHA256SUMS").write_text(_sums_text([whole, *parts]))
        (tmp / "join.py").write_text(_bundle_file("join.py"))
        (tmp / "join.py").chmod(0o755)
    return parts_dir, parts


def read_present(path: Path) -> dict[str, str | None]:
    """:func:`parse_present` over a file."""
    try:
        return parse_present(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise BundleError(f"{path}: cannot read the exclude-present list ({e.strerror})") from None


def resolve_and_plan(config: BundleConfig) -> tuple[Resolution, BundlePlan]:
    """resolve -> plan, without downloading anything (``--lock-only`` stops here)."""
    resolution = resolve(config)
    present = read_present(config.exclude_present) if config.exclude_present else {}
    plan = plan_bundle(
        resolution.requirements,
        wheel=config.wheel,
        present=present,
        skip=config.skip,
        keep=config.keep,
        extras=config.extras,
    )
    return resolution, plan


def make_bundle(config: BundleConfig) -> tuple[BundlePlan, BundleResult]:
    """resolve -> plan -> download -> write, as ``tooling bundle`` does."""
    resolution, plan = resolve_and_plan(config)
    if config.download_dir is not None:
        wheels = download(plan, config, config.download_dir)
        return plan, write_bundle(plan, wheels, config, resolution)
    config.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".bundle-wheels-", dir=config.out_dir) as tmp:
        wheels = download(plan, config, Path(tmp))
        return plan, write_bundle(plan, wheels, config, resolution)


def write_lock(resolution: Resolution, path: Path) -> None:
    """Save a resolution's lock text atomically (for ``--lock-only``)."""
    atomic_write_text(path, resolution.lock_text)


def lock_bundle(config: BundleConfig, path: Path) -> BundlePlan:
    """resolve -> plan, and the lock written to ``path``; nothing downloaded (``--lock-only``)."""
    resolution, plan = resolve_and_plan(config)
    write_lock(resolution, path)
    return plan


__all__ = [
    "DEFAULT_EXTRAS",
    "DEFAULT_KEEP",
    "DEFAULT_PINS",
    "DEFAULT_SKIP",
    "BundleConfig",
    "BundlePlan",
    "BundleResult",
    "PlanEntry",
    "Requirement",
    "Resolution",
    "download",
    "exclude_newer_for",
    "lock_bundle",
    "make_bundle",
    "parse_lock",
    "parse_present",
    "parse_size",
    "plan_bundle",
    "platform_tags",
    "read_present",
    "resolve",
    "resolve_and_plan",
    "skip_closure",
    "split_bundle",
    "write_bundle",
    "write_lock",
]
