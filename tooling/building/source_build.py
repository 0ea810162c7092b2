"""Source mode: build the patched tree with vLLM's own build (``python -m build --wheel``).

A full CUDA build takes hours, so a preflight names everything that is
missing (nvcc, a CUDA build of the pinned torch, disk) before starting.
``--use-precompiled-kernels`` drives vLLM's own Python-only path
(``VLLM_USE_PRECOMPILED`` with the cached official wheel), which needs a
CUDA torch but no nvcc. The resulting wheel gets the same manifest and SBOM
as a precompiled build.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import git

from .. import procs
from ..errors import BuildError, EnvironmentProblem
from ..fetching.gitsource import export_tree
from ..fetching.upstream import Upstream
from ..fsutil import run_prefix
from ..patching.outcome import SeriesReport
from ..patching.series import Series
from .build import BuildResult, assemble, identity_of, make_manifest
from .identity import VERSION_FILE, plan_identity, runtime_version, version_stamp
from .wheelfile import open_wheel

logger = logging.getLogger(__name__)

#: Free space a build needs in its output/scratch folder.
DISK_FULL_GIB = 30
DISK_PRECOMPILED_GIB = 3
#: Seconds each preflight question to the build interpreter may take (a cold torch import).
PREFLIGHT_TIMEOUT_S = 300

_TORCH_PROBE = (
    "import json, torch; print(json.dumps({'version': torch.__version__, "
    "'cuda': torch.version.cuda}))"
)


@dataclass(frozen=True)
class SourceBuildOptions:
    dist_dir: Path
    use_precompiled_kernels: bool = False
    build_tag: str | None = None
    source_date_epoch: int | None = None
    build_python: Path | None = None
    """Interpreter that runs the build (--no-isolation): it must hold the CUDA torch."""
    max_jobs: int | None = None
    cuda_arch_list: str = "9.0"


def pinned_torch(tree: Path) -> str | None:
    """The ``torch == X`` the tree's pyproject builds against."""
    data = tomllib.loads((tree / "pyproject.toml").read_text())
    for req in data.get("build-system", {}).get("requires", []):
        match = re.fullmatch(r"torch\s*==\s*([\w.+]+)", req.strip())
        if match:
            return match.group(1)
    return None


def find_nvcc() -> Path | None:
    cuda_home = os.environ.get("CUDA_HOME")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").is_file():
        return Path(cuda_home) / "bin" / "nvcc"
    found = shutil.which("nvcc")
    return Path(found) if found else None


def preflight(tree: Path, options: SourceBuildOptions, python: Path) -> list[str]:
    """Everything that would make the build fail or take hours in vain (empty when ready)."""
    problems: list[str] = []
    if not options.use_precompiled_kernels and find_nvcc() is None:
        problems.append("nvcc not found (install the CUDA toolkit or set CUDA_HOME)")
    pinned = pinned_torch(tree)
    try:
        printed = procs.output(
            [str(python), "-c", _TORCH_PROBE],
            what=f"{python} cannot import torch",
            error=EnvironmentProblem,
            timeout_s=PREFLIGHT_TIMEOUT_S,
        )
    except EnvironmentProblem as e:
        problems.append(f"{e} (vLLM builds against torch=={pinned})")
    else:
        torch = json.loads(printed.strip().splitlines()[-1])
        if torch["cuda"] is None:
            problems.append(
                f"torch {torch['version']} in {python} is a CPU build; vLLM's CUDA build, "
                f"even with precompiled kernels, needs a CUDA torch (pinned: {pinned})"
            )
        elif (
            pinned
            and torch["version"].split("+")[0] != pinned
            and not options.use_precompiled_kernels
        ):
            # Only a full build compiles against torch's ABI; the precompiled path
            # copies the official kernels and needs torch only to detect CUDA.
            problems.append(
                f"torch {torch['version']} in {python} is not the pinned torch=={pinned}; "
                "the kernels would not match its ABI"
            )
    try:
        procs.output(
            [str(python), "-c", "import build, setuptools_scm"],
            what=f"{python} lacks the `build` and `setuptools-scm` packages",
            error=EnvironmentProblem,
            timeout_s=PREFLIGHT_TIMEOUT_S,
        )
    except EnvironmentProblem as e:
        problems.append(str(e))
    need = DISK_PRECOMPILED_GIB if options.use_precompiled_kernels else DISK_FULL_GIB
    options.dist_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(options.dist_dir).free / 2**30
    if free < need:
        problems.append(f"{free:.1f} GiB free in {options.dist_dir}, the build needs {need} GiB")
    return problems


def build_environment(
    version: str, upstream: Upstream, options: SourceBuildOptions, base_env: dict[str, str]
) -> dict[str, str]:
    """The explicit environment of vLLM's build (pure)."""
    env = dict(base_env)
    env.update(
        VLLM_TARGET_DEVICE="cuda",
        MAX_JOBS=str(options.max_jobs or os.cpu_count() or 1),
        TORCH_CUDA_ARCH_LIST=options.cuda_arch_list,
        # The version is ours, not setuptools-scm's guess from the work tree's commits.
        SETUPTOOLS_SCM_PRETEND_VERSION=version,
    )
    nvcc = find_nvcc()
    if nvcc is not None:
        env.setdefault("CUDA_HOME", str(nvcc.parent.parent))
    if options.use_precompiled_kernels:
        if upstream.wheel is None:
            raise BuildError("--use-precompiled-kernels needs the base's official wheel")
        env.update(
            VLLM_USE_PRECOMPILED="1",
            VLLM_PRECOMPILED_WHEEL_LOCATION=str(upstream.wheel),
            VLLM_SKIP_PRECOMPILED_VERSION_SUFFIX="1",
        )
    if options.source_date_epoch is not None:
        env["SOURCE_DATE_EPOCH"] = str(options.source_date_epoch)
    return env


def build_from_source(
    upstream: Upstream, series: Series, report: SeriesReport, options: SourceBuildOptions
) -> BuildResult:
    """Run vLLM's build on the patched work tree and place the wheel in ``dist_dir``."""
    started = time.perf_counter()
    tree = Path(report.work_dir)
    python = options.build_python or Path(shutil.which("python3") or "python3")
    problems = preflight(tree, options, python)
    if problems:
        raise EnvironmentProblem("source build preflight failed: " + "; ".join(problems))
    identity = plan_identity(
        upstream.wheel.name
        if upstream.wheel
        else f"vllm-{upstream.base.version}-cp38-abi3-linux_x86_64.whl",
        series,
        options.build_tag,
    )
    env = build_environment(identity.version, upstream, options, dict(os.environ))
    command = [str(python), "-m", "build", "--wheel", "--no-isolation"]
    if options.use_precompiled_kernels:
        # The pinned torch matters only for compiling; preflight already checked CUDA.
        command.append("--skip-dependency-check")
    with tempfile.TemporaryDirectory(prefix=run_prefix("dflash-sbuild-")) as tmp:
        # Build from an export of the patched commit: vLLM's build writes into its
        # tree (kernels, _version.py), and the work tree must stay as git has it.
        tree_copy = Path(tmp) / "src"
        export_tree(git.Repo(tree), report.head, tree_copy)
        out_dir = Path(tmp) / "out"
        log = options.dist_dir / f".{identity.version}-source-build.log"
        logger.debug("vLLM's own build of %s with %s, its output in %s", tree_copy, python, log)
        # vLLM's build runs its backend, cmake and the compilers as children of its own.
        with (
            open(log, "wb") as out,
            procs.started(
                [*command, "--outdir", str(out_dir), str(tree_copy)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            ) as proc,
        ):
            returncode = proc.wait()
        if returncode != 0:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["?"]
            raise BuildError(f"vLLM's build failed (exit {returncode}, log {log}): {tail[0]}")
        (built,) = out_dir.glob("*.whl")
        identity = identity_of(built.name)
        stamped = runtime_version(upstream.base.version, series)
        target = options.dist_dir / identity.filename
        logger.debug("vLLM's build made %s; stamped, it becomes %s", built.name, target)
        with open_wheel(built) as produced:
            # setuptools-scm wrote the wheel's version; with --build-tag that is the
            # bare base version, so the stamp is applied here as in precompiled mode.
            version_file, stamp_entry = version_stamp(produced, stamped)
            manifest = make_manifest(
                upstream,
                series,
                report,
                identity,
                stamped,
                "source",
                [stamp_entry],
                options.source_date_epoch,
                [f"built by vLLM's own setup.py (log {log.name})"],
            )
            digest = assemble(
                produced,
                identity,
                {VERSION_FILE: version_file},
                manifest,
                options.source_date_epoch,
                target,
            )
    return BuildResult(
        path=target,
        filename=target.name,
        version=identity.version,
        sha256=digest,
        size=target.stat().st_size,
        mode="source",
        seconds=time.perf_counter() - started,
        manifest=manifest,
        notes=manifest.notes,
    )
