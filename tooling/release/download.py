"""The bundle's network side: the resolution with ``uv pip compile`` and the wheels with
``pip download``, both for the target's Python and platform, not this machine's."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from .. import procs
from ..errors import BundleError, CacheMissError, EnvironmentProblem
from ..fsutil import run_scratch
from ..progress import step_bar
from .bundle_plan import BundleConfig, BundlePlan, PlanEntry
from .lock import Resolution, parse_lock

logger = logging.getLogger(__name__)


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


def _uv_available() -> None:
    try:
        import uv  # noqa: F401
    except ImportError:
        raise EnvironmentProblem(
            "uv is not installed in this Python: pip install uv (tooling bundle resolves with it)"
        ) from None


def resolve(config: BundleConfig, scratch: Path | None = None) -> Resolution:
    """Resolve the patched wheel's runtime closure with ``uv pip compile`` (under --offline
    from uv's cache alone). ``scratch``: the run's folder, where uv's temp files go too."""
    if not config.wheel.is_file():
        raise BundleError(f"{config.wheel}: no such wheel")
    _uv_available()
    logger.debug("resolve what %s needs at run time (uv pip compile)", config.wheel.name)
    with run_scratch("bundle", scratch) as tmp:
        req_in = Path(tmp) / "requirements.in"
        req_in.write_text("\n".join([str(config.wheel.resolve()), *config.pins]) + "\n")
        excludes: tuple[str, ...] = ()
        if config.excludes:
            (Path(tmp) / "excludes.txt").write_text("\n".join(config.excludes) + "\n")
            excludes = ("--excludes", str(Path(tmp) / "excludes.txt"))
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
            *excludes,
            *(("--offline",) if config.offline else ()),
        )
        result = procs.run(cmd, env={**os.environ, "TMPDIR": str(tmp)})
        if result.returncode != 0:
            # uv wraps its reason to the terminal's width: the whole of it, on one line, or
            # the package at fault can fall outside the last lines.
            why = " ".join((result.stderr or "").split())[-800:] or f"exit {result.returncode}"
            if config.offline:
                raise CacheMissError(
                    f"--offline: uv could not resolve {config.wheel.name} from its cache: {why}"
                )
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
        # --offline: the wheels an earlier run kept in ``dest``, no index.
        *(("--no-index", "--find-links", str(dest)) if config.offline else ()),
        *(() if config.offline else ("--index-url", config.index_url)),
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


def _pip_env(scratch: Path) -> dict[str, str]:
    # No pip.conf of this machine (constraints, extra indexes): the bundle must
    # not depend on who builds it. The index is passed explicitly. pip's own temp folders
    # (build tracker, downloads, unpacked wheels) go in the run's, which goes however pip
    # ends: a pip stopped by a signal removes none of its own.
    return {
        **os.environ,
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_INPUT": "1",
        "TMPDIR": str(scratch),
    }


def _run_pip(
    cmd: list[str], total: int, label: str, config: BundleConfig, log: Path, scratch: Path
) -> None:
    saved = re.compile(r"^(Saved|File was already downloaded) ")
    with step_bar(total, label, config.progress) as bar, open(log, "a", encoding="utf-8") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        with procs.started(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=_pip_env(scratch),
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
                if saved.match(line):
                    bar.update(1)
            code = proc.wait()
    if code != 0:
        tail = [ln for ln in log.read_text(encoding="utf-8").splitlines() if ln.strip()][-2:]
        if config.offline:
            raise CacheMissError(
                f"--offline: the wheels are not all kept in {log.parent}: {' '.join(tail)} "
                f"(log: {log})"
            )
        raise BundleError(f"pip download failed: {' '.join(tail)} (log: {log})")


def download(
    plan: BundlePlan, config: BundleConfig, dest: Path, scratch: Path | None = None
) -> dict[str, Path]:
    """Download every wheel of ``plan`` (the patched one is copied later); name -> file.

    Resolved wheels are checked against the hashes uv recorded (``--require-hashes``);
    extras have none and are hashed into install.txt after download. Under --offline
    they come from ``dest`` alone, where an earlier run kept them.
    """
    dest.mkdir(parents=True, exist_ok=True)
    log = dest / "pip-download.log"
    wanted = [e for e in plan.include if e.source != "patched"]
    with run_scratch("bundle", scratch) as tmp:
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
            logger.debug(
                "download %d wheels %s into %s (pip's output in %s)",
                len(batch),
                "by their hashes" if hashed else "unhashed",
                dest,
                log,
            )
            _run_pip(cmd, len(batch), "download", config, log, tmp)
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
