"""Behavioural probes: does a vLLM tree or environment behave as fixed?

One probe per fix. A probe runs vLLM's own code on crafted configs in a
separate interpreter (one that has torch and vLLM's import-time dependencies)
and answers present / absent / unknown with evidence. It never searches text,
so a fix that lives in another file or under another name is still found, and
a textual patch that did not change behaviour is still caught.

The same probes serve ``tooling patch`` (on a source tree), ``tooling build``
and ``tooling verify`` (on an installed environment). Which probe proves which
fix is the ledger's word (``patches/series.toml``, read by ``tooling.registry``):
this package only says which probes exist, one module each.
"""

from __future__ import annotations

import contextlib
import json
import os
import pkgutil
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..fsutil import dead_run_folders, run_prefix
from ..paths import CacheLayout
from ..procs import stop_group
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

if TYPE_CHECKING:  # tooling.probe_cache and tooling.probe_host use this package's types
    from ..probe_cache import Hit, ProbeCache
    from ..probe_host import ProbeHost

__all__ = [
    "ABSENT",
    "PRESENT",
    "UNKNOWN",
    "ProbeResult",
    "ProbeRun",
    "ProbeTarget",
    "probe_modules",
    "probe_requested",
    "run_probes",
    "scratch_folder",
    "start_probes",
]

_PACKAGE_DIR = Path(__file__).resolve().parent
#: This package's modules that run the probes rather than being one.
_MACHINERY = frozenset({"child", "forkserver", "result"})
_CHILD_PACKAGE = "dflash_probes"
DEFAULT_TIMEOUT_S = 900


def probe_modules() -> tuple[str, ...]:
    """The probes that exist: every public module of this package but the machinery, sorted.

    Found by listing, not importing: a probe is for the probed interpreter to import.
    """
    names = (m.name for m in pkgutil.iter_modules([str(_PACKAGE_DIR)]))
    return tuple(sorted(n for n in names if not n.startswith("_") and n not in _MACHINERY))


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
    """Where verdicts are kept by what the probes loaded (``tooling.probe_cache``); None:
    every run probes."""

    def describe(self) -> str:
        return str(self.root) if self.root else f"the vLLM of {self.python}"


class Process(Protocol):
    """A probe run's process: an interpreter of its own (``subprocess.Popen``) or one a
    ``ProbeHost`` forked."""

    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


@dataclass
class ProbeRun:
    """A probe subprocess in flight; ``wait()`` turns it into verdicts."""

    target: ProbeTarget
    names: tuple[str, ...]
    process: Process | None
    workdir: Path | None
    """The run's own folder (the probes' copy, their scratch); None when nothing runs."""
    log: Path
    timeout_s: float
    error: str | None = None
    vllm_version: str | None = field(default=None, init=False)
    cache: ProbeCache | None = None
    """Where a finished run's verdicts go."""
    started_ns: int = 0
    """The run's start on the file system's clock: what changed since cannot be cached."""
    hit: Hit | None = None
    """Verdicts from the cache: no interpreter was started."""

    @property
    def cached(self) -> bool:
        return self.hit is not None

    def wait(self) -> dict[str, ProbeResult]:
        try:
            return self._collect()
        finally:
            self.close()

    def close(self) -> None:
        """Stop the child if it still runs and remove its folder; safe to call again.

        Callers that do other work between ``start_probes`` and ``wait`` hold the
        run in a ``with`` block, so a failure (or Ctrl-C) there does not leave a
        probe interpreter importing vLLM in the background.
        """
        if isinstance(self.process, subprocess.Popen):
            stop_group(self.process, grace_s=0)  # what the probed code started goes too
        elif self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self.workdir is not None:
            remove_run_folder(self.workdir, self.target.pycache)

    def __enter__(self) -> ProbeRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _collect(self) -> dict[str, ProbeResult]:
        if self.hit is not None:
            self.vllm_version = self.hit.vllm_version
            return dict(self.hit.results)
        if self.process is None or self.workdir is None:
            return self._unknown(self.error or "probe interpreter did not start")
        try:
            self.process.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            # close() (from wait) kills it.
            return self._unknown(f"probes timed out after {self.timeout_s:.0f}s (log: {self.log})")
        out = self.workdir / "out.json"
        if not out.is_file():
            tail = self.log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            return self._unknown(f"probe interpreter exited {self.process.returncode}: {tail[0]}")
        data = json.loads(out.read_text())
        self.vllm_version = data.get("vllm_version")
        results = {r["probe"]: ProbeResult.from_json(r) for r in data["results"]}
        if self.cache is not None and self.process.returncode == 0:
            self.cache.store(
                data.get("imports"), self.workdir, self.started_ns, results, self.vllm_version
            )
        return results

    def _unknown(self, why: str) -> dict[str, ProbeResult]:
        return {n: ProbeResult(probe=n, status=UNKNOWN, evidence=why) for n in self.names}


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


def copy_probe_package(folder: Path) -> Path:
    """Copy the probes into ``folder`` under a neutral package name, so the probed
    interpreter sees neither the toolchain nor its dependencies; returns the package's
    marker file."""
    shutil.copytree(
        _PACKAGE_DIR,
        folder / _CHILD_PACKAGE,
        ignore=shutil.ignore_patterns("__pycache__", "__init__.py"),
    )
    marker = folder / _CHILD_PACKAGE / "__init__.py"
    marker.write_text("")
    return marker


def probe_command(python: Path, module: str, args: list[str]) -> list[str]:
    """The command line that runs one of the copied package's entry points."""
    return [str(python), "-m", f"{_CHILD_PACKAGE}.{module}", *args]


def launch_child(
    target: ProbeTarget, env: dict[str, str], workdir: Path, argv: list[str], log: Path
) -> subprocess.Popen[bytes]:
    """A probe run in an interpreter of its own, its output in ``log``, leading a process
    group of its own (``ProbeRun.close`` stops the group)."""
    with open(log, "wb") as log_file:
        return subprocess.Popen(
            probe_command(target.python, "child", argv),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=workdir,
            start_new_session=True,
        )


def child_env(target: ProbeTarget, package_parent: Path) -> dict[str, str]:
    env = dict(os.environ)
    if target.pycache is not None:
        # Bytecode goes to our cache, never into the probed tree or site-packages
        # (where it would show up as unexpected files), and makes re-probing
        # the same tree several times faster.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(target.pycache)
    roots = ([target.root] if target.root else []) + list(target.extra_path)
    paths = [str(Path(p).resolve()) for p in roots]
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


def start_probes(
    target: ProbeTarget,
    names: tuple[str, ...],
    *,
    log: Path | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    host: ProbeHost | None = None,
) -> ProbeRun:
    """Start the probes in the background (they take seconds: vLLM imports are slow).

    With ``target.cache`` (and ``$TOOLING_NO_PROBE_CACHE`` unset), verdicts an
    earlier run gave a tree that loads the same bytes are answered at once,
    without an interpreter; the run's ``cached`` says so, as its log does. With
    ``host``, a run it can serve is forked from its interpreter rather than
    starting one (``tooling.probe_host``).
    """
    from .. import probe_cache

    workdir = new_run_folder("dflash-probes-", target.pycache)
    env = child_env(target, workdir)
    cache = None
    if target.cache is not None and probe_cache.enabled():
        cache = probe_cache.ProbeCache.open(
            target.cache,
            sources=probe_cache.sources_digest(_PACKAGE_DIR),
            python=target.python,
            names=names,
            env=env,
            roots=[*([target.root] if target.root else []), *target.extra_path],
            scratch=workdir,
        )
        hit = cache.lookup()
        if hit is not None:
            shutil.rmtree(workdir, ignore_errors=True)
            if log is not None:
                log.parent.mkdir(parents=True, exist_ok=True)
                log.write_text(f"answered from the probe cache: {hit.entry}\n")
            run = ProbeRun(target, names, None, None, log or hit.entry, timeout_s)
            run.hit = hit
            return run
    marker = copy_probe_package(workdir)
    # The file system's own clock (coarser than time.time_ns()), which stamps the tree.
    started_ns = marker.stat().st_mtime_ns
    log = log or workdir / "probes.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    argv = [str(workdir / "out.json"), *names]
    try:
        process: Process | None = host.start(target, env, workdir, argv, log) if host else None
        process = process or launch_child(target, env, workdir, argv, log)
    except BaseException as e:
        if not isinstance(e, OSError):  # nothing runs yet to take the copy away with it
            remove_run_folder(workdir, target.pycache)
            raise
        return ProbeRun(
            target,
            names,
            None,
            workdir,
            log,
            timeout_s,
            error=f"cannot start {target.python}: {e.strerror}",
        )
    return ProbeRun(
        target, names, process, workdir, log, timeout_s, cache=cache, started_ns=started_ns
    )


def run_probes(
    target: ProbeTarget,
    names: tuple[str, ...],
    *,
    log: Path | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    host: ProbeHost | None = None,
) -> dict[str, ProbeResult]:
    """Run the named probes against ``target`` and return their verdicts by name."""
    return start_probes(target, names, log=log, timeout_s=timeout_s, host=host).wait()


def probe_requested(
    root: Path | None, python: Path | None, names: tuple[str, ...], cache: CacheLayout
) -> dict[str, ProbeResult]:
    """``tooling probe``: ``names`` against ``root`` (else the interpreter's own vLLM), asked
    by ``python``, else the configured probe interpreter, else this one; verdicts kept in
    ``cache``'s probe cache."""
    import sys

    from ..probe_env import resolve_probe_python

    interpreter = python or resolve_probe_python(None, cache) or Path(sys.executable)
    target = ProbeTarget(
        python=interpreter, root=root, pycache=cache.root / "pycache", cache=cache.probes
    )
    return run_probes(target, names)
