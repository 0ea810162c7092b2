"""Starting a probe run: which vLLM it questions, the environment and folder it runs in, and
the interpreter of its own it gets when no ``ProbeHost`` forks it."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..fsutil import dead_run_folders, run_prefix
from ..procs import start_group
from .package import probe_command

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProbeTarget:
    """Which vLLM to question: ``python``'s own, or the tree at ``root`` put first on its path."""

    python: Path
    root: Path | None = None
    extra_path: tuple[Path, ...] = ()
    """Further folders after ``root`` (e.g. an installed site-packages for ``--site-packages``)."""
    pycache: Path | None = None
    """Where the probed interpreter may write bytecode (``PYTHONPYCACHEPREFIX``)."""
    cache: Path | None = None
    """Where verdicts are kept by what the probes loaded (``tooling.probing.cache``); None:
    every run probes."""

    def describe(self) -> str:
        return str(self.root) if self.root else f"the vLLM of {self.python}"

    @property
    def roots(self) -> list[Path]:
        """The probed tree's folders, in search-path order."""
        return [*([self.root] if self.root else []), *self.extra_path]


class Process(Protocol):
    """A probe run's process: an interpreter of its own (``subprocess.Popen``) or one a
    ``ProbeHost`` forked."""

    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


@contextlib.contextmanager
def scratch_folder(prefix: str, pycache: Path | None) -> Iterator[Path]:
    """A temp folder for trees or installs the probes import, removed with the bytecode
    their imports left under the prefix (a new folder every time, never read again)."""
    folder = new_run_folder(prefix, pycache)
    try:
        yield folder
    finally:
        remove_run_folder(folder, pycache)


def new_run_folder(prefix: str, pycache: Path | None) -> Path:
    """A new temp folder named for this process (``fsutil.run_prefix``), made after removing
    the folders of runs whose process died before removing its own (SIGKILL), with their
    bytecode under the prefix."""
    temp = Path(tempfile.gettempdir())
    for dead in dead_run_folders(temp):
        remove_run_folder(dead, pycache)
    if pycache is not None:  # the bytecode of a dead run whose folder went another way
        for dead in dead_run_folders(pycache / temp.relative_to(temp.anchor)):
            shutil.rmtree(dead, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=run_prefix(prefix)))


def remove_run_folder(folder: Path, pycache: Path | None) -> None:
    """Remove a run's folder, and its copy's bytecode under the prefix (a new folder
    every run, never read again)."""
    shutil.rmtree(folder, ignore_errors=True)
    if pycache is not None:
        shutil.rmtree(pycache / folder.relative_to(folder.anchor), ignore_errors=True)


def launch_child(
    target: ProbeTarget, env: dict[str, str], workdir: Path, argv: list[str], log: Path
) -> subprocess.Popen[bytes]:
    """A probe run in an interpreter of its own, its output in ``log``, leading a process
    group of its own (``ProbeRun.close`` stops the group)."""
    logger.debug("probe run of %s in an interpreter of its own", target.describe())
    return start_group(
        probe_command(target.python, "child", argv),
        log=log,
        env=env,
        cwd=workdir,
        truncate_log=True,
    )


def child_env(target: ProbeTarget, package_parent: Path) -> dict[str, str]:
    """The probed interpreter's environment: this process's, with the probed tree, the
    probes' copy and the bytecode prefix set, and vLLM kept off the GPU and the network."""
    env = dict(os.environ)
    if target.pycache is not None:
        # Bytecode goes to our cache, never into the probed tree or site-packages
        # (where it would show up as unexpected files), and makes re-probing
        # the same tree faster.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(target.pycache)
    paths = [str(Path(p).resolve()) for p in target.roots]
    paths.append(str(package_parent))
    # A PYTHONPATH already set (an offline host's --target install of vLLM's
    # dependencies) stays, after the probed tree.
    paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(
        # Probes are CPU-only by design; keep a GPU host's driver out of it.
        CUDA_VISIBLE_DEVICES="",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"),
        VLLM_NO_USAGE_STATS="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        OMP_NUM_THREADS="1",
        # The probes' scratch (tiny config folders) lands in the run's own folder,
        # which is removed when the run is collected.
        TMPDIR=str(package_parent),
    )
    return env
