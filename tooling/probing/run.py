"""Running probes: a run in flight (``ProbeRun``), answered from the probe cache, forked by a
``ProbeHost`` or started in an interpreter of its own, and its verdicts.

One probe per fix (``tooling/probes``, one module each). A probe runs vLLM's own code on
crafted configs in a separate interpreter (one that has torch and vLLM's import-time
dependencies) and answers present / absent / unknown with evidence. It never searches text,
so a fix that lives in another file or under another name is still found, and a textual
patch that did not change behaviour is still caught.

The same probes serve ``tooling patch`` (on a source tree), ``tooling build`` and ``tooling
verify`` (on an installed environment). Which probe proves which fix is the ledger's word
(``patches/series.toml``, read by ``tooling.patching.registry``).
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ProbeError
from ..fsutil import read_bounded
from ..paths import CacheLayout
from ..probes.result import UNKNOWN, ProbeResult, ProbeStatus
from ..procs import stop_group
from ..schema import Doc
from . import package
from .cache import Hit, ProbeCache, sources_digest
from .env import resolve_probe_python
from .host import ProbeHost
from .launch import (
    ProbeTarget,
    Process,
    child_env,
    launch_child,
    new_run_folder,
    remove_run_folder,
)

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 900


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
        try:
            data, results = read_answer(out, self.names)
        except ProbeError as e:
            return self._unknown(f"{e} (log: {self.log})")
        self.vllm_version = data.get("vllm_version")
        if self.cache is not None and self.process.returncode == 0:
            self.cache.store(
                data.get("imports"), self.workdir, self.started_ns, results, self.vllm_version
            )
        return results

    def _unknown(self, why: str) -> dict[str, ProbeResult]:
        return {n: ProbeResult(probe=n, status=UNKNOWN, evidence=why) for n in self.names}


#: The largest answer read from a probe interpreter: the probes' is a few kB.
ANSWER_LIMIT = 16 << 20


def read_answer(out: Path, names: tuple[str, ...]) -> tuple[dict, dict[str, ProbeResult]]:
    """The probe interpreter's ``out.json`` and its verdicts, every value checked against its
    type: an answer that is not the probes' (the interpreter is not one that runs them, or
    broke off writing) is a ProbeError naming the file and the key, so the run reads no
    verdict rather than a traceback."""
    raw = read_bounded(out, ANSWER_LIMIT, "the probes' answer", ProbeError)
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise ProbeError(f"{out}: not the probes' answer (not JSON: {e})") from None
    doc = Doc(str(out), ProbeError)
    doc.text(data, "vllm_version", None)
    results = {}
    for i, entry in enumerate(doc.tables(data, "results")):
        row = doc.inner(f": results[{i}]")
        probe, status = row.text(entry, "probe"), row.text(entry, "status")
        if probe not in names:
            row.fail(f"probe {probe!r} was not asked for ({', '.join(names)})")
        if status not in {s.value for s in ProbeStatus}:
            row.fail(f"status {status!r} is none of {', '.join(s.value for s in ProbeStatus)}")
        results[probe] = ProbeResult(
            probe=probe,
            status=ProbeStatus(status),
            evidence=row.text(entry, "evidence"),
            form=row.text(entry, "form", None),
            details=dict(row.table(entry, "details", {})),
        )
    return dict(data), results


def start_probes(
    target: ProbeTarget,
    names: tuple[str, ...],
    *,
    log: Path | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    host: ProbeHost | None = None,
) -> ProbeRun:
    """Start the probes in the background (they take seconds: vLLM imports are slow).

    With ``target.cache``, verdicts an earlier run gave a tree that loads the same bytes
    are answered at once, without an interpreter; the run's ``cached`` says so, as its log
    does. With ``host``, a run it can serve is forked from its interpreter rather than
    starting one (``tooling.probing.host``).
    """
    workdir = new_run_folder("dflash-probes-", target.pycache)
    logger.debug("%d probes of %s in %s", len(names), target.describe(), workdir)
    env = child_env(target, workdir)
    cache = None
    if target.cache is not None:
        cache = ProbeCache.open(
            target.cache,
            sources=sources_digest(package.PACKAGE_DIR),
            python=target.python,
            names=names,
            env=env,
            roots=target.roots,
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
    marker = package.copy_probe_package(workdir)
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
    root: Path | None,
    python: Path | None,
    names: tuple[str, ...],
    cache: CacheLayout,
    configured: Path | None = None,
) -> dict[str, ProbeResult]:
    """``tooling probe``: ``names`` against ``root`` (else the interpreter's own vLLM), asked
    by ``python``, else the ``configured`` probe interpreter (checked), else the cached probe
    environment, else this one; verdicts kept in ``cache``'s probe cache."""
    interpreter = python or resolve_probe_python(configured, cache) or Path(sys.executable)
    target = ProbeTarget(
        python=interpreter, root=root, pycache=cache.root / "pycache", cache=cache.probes
    )
    return run_probes(target, names)
