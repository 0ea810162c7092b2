"""Here, on the build machine: the parts a GPU host joins (``make-parts.sh``: the bundle, the
vLLM sdist the ablations are built from, the recipe's train-wheels/), and the trained pair a
host brought back in small parts split again for a later session (``pair-parts.sh``)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import HostStepError, HostUsageError
from ..paths import REPO_DIR
from ..release.split import split_bundle
from .layout import PYTHON, run, say, shown
from .setup import VLLM

#: What the host has, for the bundle to leave out: the host's pip freeze, whose versions say
#: what differs from a base's lock (a bare name would match any version). Every base's
#: bundle is made against it: another base pins another torch and CUDA libraries, and the
#: host's image moves under the default base's lock, whose older versions must then ship.
HOST_FREEZE = REPO_DIR / "ci" / "gpu" / "h200-host-freeze.txt"

#: A part's default size, with room left for the checkout: a call carries its tracked files
#: with the part, within CALL_BYTES.
PART_BYTES = 52 << 20
#: What one call to the GPU host carries, the checkout and the carried part together.
CALL_BYTES = 64 << 20
#: The toolchain's GPU-host extras the bundle carries: the reference dflash, GitPython for
#: the offline builds, flash-linear-attention for the hybrid recipe's training.
EXTRAS = (
    "dflash==0.1.0",
    "GitPython==3.1.45",
    "gitdb==4.0.12",
    "smmap==5.0.2",
    "flash-linear-attention==0.6.0",
    "fla-core==0.6.0",
)
#: Beside the bundle, not in it: vLLM keeps the Triton its torch brings, while
#: flash-linear-attention's gated backward refuses Hopper under Triton < 3.7.1. The hash
#: pins the wheel's bytes.
TRAIN_WHEELS = (
    "triton==3.7.1 --hash=sha256:7e40869937a68206ec70d7f25bb7ec6433cb083f9135e1f36dbd318dc449a728\n"
)
#: pip download of exactly the pinned bytes, for the host's interpreter and platform.
PIP_DOWNLOAD = (
    "download", "--quiet", "--disable-pip-version-check", "--no-deps", "--require-hashes",
    "--only-binary=:all:",
)  # fmt: skip
TRAIN_PLATFORM = (
    "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
    "--platform", "manylinux_2_28_x86_64",
)  # fmt: skip

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartsSettings:
    """RAY=1 adds Ray (the smoke's --distributed-executor-backend ray); TRAINING=0 leaves
    train-wheels/ out, for a session that runs smokes alone; BASE, the pinned vLLM release
    the parts carry (default: the series' own)."""

    ray: bool = False
    training: bool = True
    base: str | None = None

    @property
    def release(self) -> str:
        return f"vllm-{self.base}" if self.base else VLLM

    @property
    def present(self) -> Path:
        return HOST_FREEZE


def _checked_out(out: Path, what: str) -> None:
    if out.exists():
        raise HostUsageError(f"{out} exists{what}")


def make_parts(out: Path, size: int, cache: Path, settings: PartsSettings) -> None:
    """The payload (bundle/, the sdist, train-wheels/) split into parts of ``size`` bytes."""
    logger.debug("step: make the parts into %s", out)
    _checked_out(out, ": give a new folder for the parts")
    release = settings.release
    wheels = sorted((cache / "pypi").glob(f"{release}-*.whl"))
    sdist = cache / "pypi" / f"{release}.tar.gz"
    if len(wheels) != 1 or not sdist.is_file():
        base = release.removeprefix("vllm-")
        raise HostStepError(
            f"{cache}/pypi: no {release} wheel and sdist (tooling fetch --base {base} puts "
            "them there)"
        )
    extras = list(EXTRAS)
    if settings.ray:
        from ..smoke.config import RAY_VERSION

        extras.append(f"ray=={RAY_VERSION}")
    # One folder for everything this run writes, pip's and every child's temp folders too:
    # it goes however the run ends.
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "tmp").mkdir()
        # The build machine's own settings (its cache above all), not the GPU host's.
        env = {**os.environ, "TMPDIR": str(work / "tmp")}
        cmd = [
            sys.executable,
            "-m",
            "tooling",
            "--no-progress",
            "bundle",
            "--wheel",
            str(wheels[0]),
        ]
        cmd += ["--base", release.removeprefix("vllm-"), "--out", str(work / "bundle")]
        cmd += ["--exclude-present", str(settings.present)]
        cmd += [word for extra in extras for word in ("--extra", extra)]
        if run(cmd, env=env) != 0:
            raise HostStepError("the bundle could not be made (tooling bundle says why above)")
        payload = work / "payload"
        payload.mkdir()
        (bundle,) = (work / "bundle").glob("vllm-*-bundle-*")
        bundle.rename(payload / "bundle")
        shutil.copy(sdist, payload)
        if settings.training:
            (work / "train-wheels.txt").write_text(TRAIN_WHEELS)
            pip = [sys.executable, "-m", "pip", *PIP_DOWNLOAD, *TRAIN_PLATFORM]
            pip += ["-r", str(work / "train-wheels.txt"), "-d", str(payload / "train-wheels")]
            if run(pip, env=env) != 0:
                raise HostStepError("the recipe's train-wheels could not be downloaded")
        split_bundle(payload, out, size, show_progress=False)
    say(shown(["ls", "-l", str(out)], env=env))


def split_words(words: list[str]) -> tuple[str, str | None, list[str]]:
    """``OUT_DIR [PART_SIZE_BYTES] -- DIR ...`` as its three parts."""
    if not words:
        raise HostUsageError("give OUT_DIR", usage=True)
    out, rest, size = words[0], words[1:], None
    if rest[:1] != ["--"]:
        if not rest:
            raise HostUsageError("give -- and the folders", usage=True)
        size, rest = rest[0], rest[1:]
    if rest[:1] != ["--"]:
        raise HostUsageError("give -- before the folders", usage=True)
    if not rest[1:]:
        raise HostUsageError("give the folders after --", usage=True)
    return out, size, rest[1:]


def pair_parts(out: Path, size: int, folders: list[Path]) -> None:
    """The pair's parts in ``folders`` (each one command's folder), checked, joined and
    split again into parts of ``size`` bytes in ``out``."""
    logger.debug("step: the pair from %s into %s", folders, out)
    _checked_out(out, "")
    for folder in folders:
        if not folder.is_dir():
            raise HostUsageError(f"{folder} is not a folder")
    with tempfile.TemporaryDirectory() as tmp:
        given = Path(tmp) / "in"
        given.mkdir()
        # A command's folder may hold more than the parts (a report copied beside them):
        # its plain files only, and join.py judges which belong.
        for folder in folders:
            for path in folder.iterdir():
                if path.is_file() and not path.is_symlink():
                    shutil.copy(path, given / path.name)
        if not (given / "join.py").is_file():
            shown_folders = " ".join(str(f) for f in folders)
            raise HostUsageError(
                f"no join.py in {shown_folders} (the first export's folder has it)"
            )
        # join.py checks every part against SHA256SUMS and the whole archive's digest.
        joined = Path(tmp) / "joined"
        join = [PYTHON, str(given / "join.py"), str(joined)]
        if run(join, env={**os.environ}, stdout=subprocess.DEVNULL) != 0:
            raise HostStepError("the pair's parts do not join (join.py says why above)")
        (pair,) = [p for p in joined.iterdir() if p.is_dir()]
        if not (pair / "summary.json").is_file():
            raise HostStepError("no summary.json in the pair")
        split_bundle(pair, out, size, show_progress=False)
    for path in sorted(out.iterdir()):
        say(path.name)
