"""What several test modules share: the patches folder, the session cache's links, the
environment of child interpreters, options and trees for the patch engine, running a
script on a vLLM tree, and running a GPU host's script (``ci/gpu``) here."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tooling.building.manifest import BuildManifest
from tooling.fetching.upstream import Upstream
from tooling.fsutil import locked
from tooling.patching.apply import ApplyOptions
from tooling.patching.series import Series
from tooling.paths import REPO_DIR, CacheLayout, default_cache_dir

PATCHES = REPO_DIR / "patches"

#: How long a test waits for what must happen before it goes on: a guard against a hang
#: only, so far above what a loaded machine needs that no verdict depends on its speed.
HANG_GUARD_S = 300.0


def link_artifacts(user: CacheLayout, session: CacheLayout) -> None:
    """Symlink the user's artifacts and unpacked sources into ``session`` (once each).

    The tool never writes into either: it moves a bad artifact aside by
    renaming it (the link), and unpacks a source tree only where none is.
    """
    for folder in (user.artifacts, user.sources):
        for entry in sorted(folder.glob("[!.]*")) if folder.is_dir() else ():
            link = session.root / folder.name / entry.name
            if not link.is_symlink():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(entry)


def seed_bytecode(user: CacheLayout, session: CacheLayout) -> None:
    """Hard-link the user's compiled modules (torch's, vLLM's) into the session's cache.

    Compiling torch and vLLM again from source would slow every probe run. Python
    replaces a stale ``.pyc`` by renaming a new file over it, so the user's copy
    is never written. Modules of temp folders (work trees of runs gone) stay out.
    """
    pycache = user.root / "pycache"
    seeded = session.root / "pycache"
    if not pycache.is_dir():
        return
    temp = pycache / Path(tempfile.gettempdir()).resolve().relative_to("/")
    # Once per session: pytest-xdist's workers share the controller's session cache.
    with locked(seeded):
        if seeded.exists():
            return
        shutil.copytree(
            pycache,
            seeded,
            ignore=lambda folder, names: [n for n in names if Path(folder, n) == temp],
            copy_function=_hardlink,
        )


def _hardlink(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system: a copy
        shutil.copy2(src, dst)


def bytecode_env() -> dict[str, str]:
    """Environment for a child interpreter a test starts on vLLM, dflash or the repo: its
    bytecode goes to the session's cache (as the probe harness sends it), never beside the
    sources, some of which are the user's cache."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPYCACHEPREFIX": str(default_cache_dir(os.environ) / "pycache")}


def apply_options(probe_python: Path | None, cache: CacheLayout, **kw) -> ApplyOptions:
    """The session's options; its probe cache starts empty, so each tree's first probe runs."""
    return ApplyOptions(
        probe_python=probe_python,
        pycache=cache.root / "pycache",
        probe_cache=cache.probes,
        baselines=cache.baselines,
        **kw,
    )


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def touched_upstream(
    upstream: Upstream, series: Series, dst: Path, extra: tuple[str, ...] = ()
) -> Upstream:
    """``upstream`` whose source is only the files the series touches (the ledger's
    ``files``) and ``extra``, copied to ``dst``.

    The engine applies, reports and builds file by file, so a conflict, an offset, a
    refusal or a partial build reads as it does on the whole release, without checking
    out its 4,745 files (and deleting them again later).
    """
    for rel in sorted({f for patch in series.patches for f in patch.files} | set(extra)):
        if not (upstream.source_dir / rel).is_file():
            continue  # a module the series adds: its patch creates it
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(upstream.source_dir / rel, dst / rel)
    return dataclasses.replace(upstream, source_dir=dst)


def run_on_tree(
    python: Path,
    tree: Path,
    tmp: Path,
    script: str,
    argument: str,
    *,
    timeout: float,
    unset: tuple[str, ...] = (),
) -> dict:
    """Run ``script`` in ``python`` with ``tree``'s vLLM first on its path (CPU only).

    The script gets ``argument`` and the path of the JSON file it must write,
    which is returned parsed; ``unset`` names environment variables it must not see.
    """
    assert (tree / "vllm").is_dir(), tree
    script_path, out = tmp / "script.py", tmp / "out.json"
    script_path.write_text(script)
    env = {
        **bytecode_env(),
        "PYTHONPATH": os.pathsep.join([str(tree), str(REPO_DIR)]),
        "CUDA_VISIBLE_DEVICES": "",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "OMP_NUM_THREADS": "1",
        # The probe harness's scratch folders go to the test's tmp, not /tmp.
        "TMPDIR": str(tmp),
    }
    for name in unset:
        env.pop(name, None)
    result = subprocess.run(
        [str(python), str(script_path), argument, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return json.loads(out.read_text())


def run_draws(python: Path, patched: Any, tmp: Path, script: str, seeds: list[int]) -> dict:
    """A slow test's drawn schedules: ``script`` over ``seeds`` on the patched tree (a
    successful ``patched_0201``), its JSON once every draw ran (it lists the faults of any
    that did not, with their seeds, under ``errors``)."""
    assert patched.ok
    out = run_on_tree(python, Path(patched.work_dir), tmp, script, json.dumps(seeds), timeout=900)
    assert out["errors"] == []
    return out


def wait_until(
    predicate: Callable[[], object], what: str, *, alive: subprocess.Popen | None = None
) -> None:
    """Poll until ``predicate`` holds. Fails naming ``what`` when ``alive``, the process
    that must bring it about, exits first (with what it wrote, where piped), or on a hang."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not predicate():
        if alive is not None and alive.poll() is not None:
            pytest.fail(f"{what}: never happened, exit {alive.returncode}: {alive.communicate()}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: never happened (a hang)")
        time.sleep(0.05)


def run_gpu_script(
    script: str,
    *args: str,
    work: Path,
    out: Path | None = None,
    cwd: Path | None = None,
    **more: str,
) -> subprocess.CompletedProcess[str]:
    """``bash ci/gpu/SCRIPT ARGS`` with ``WORK`` (and ``OUT``, and the variables ``more``
    names) set, as on the GPU host, where the host's python3 runs the toolchain: here this
    interpreter, first on PATH; started in ``cwd`` (default: this process's folder)."""
    env = {
        **os.environ,
        **more,
        "WORK": str(work),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    if out is not None:
        env["OUT"] = str(out)
    return subprocess.run(
        ["bash", str(REPO_DIR / "ci" / "gpu" / script), *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )


#: A stand-in probe interpreter: it writes the file $PAYLOAD names where the probes' answer
#: goes, and nothing else.
ANSWERING_INTERPRETER = """#!/bin/sh
for word in "$@"; do case $word in */out.json) out=$word ;; esac; done
cat "$PAYLOAD" > "$out"
"""


def answering_interpreter(folder: Path, payload: str) -> tuple[Path, dict[str, str]]:
    """A probe interpreter that answers ``payload``, and the environment it reads it by
    (the probe cache off, so every run asks it)."""
    python = folder / "python"
    python.write_text(ANSWERING_INTERPRETER)
    python.chmod(0o755)
    (folder / "answer.json").write_text(payload)
    env = {"PAYLOAD": str(folder / "answer.json"), "TOOLING_NO_PROBE_CACHE": "1"}
    return python, env


def run_tooling(
    *args: str, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """A real ``tooling`` process (``python -m tooling --no-progress ARGS``) run to its end,
    its output captured; ``env`` adds to this process's environment."""
    return subprocess.run(
        [sys.executable, "-m", "tooling", "--no-progress", *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_module(
    module: str, *args: str | Path, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGS`` run from the repository's root to its end, its output captured:
    the page generators (``tooling.canary_doc``, ``tooling.cli.reference``) as make runs them."""
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        cwd=REPO_DIR,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def plain_manifest(version: str, **fields: Any) -> BuildManifest:
    """The build manifest of a wheel of ``version`` that carries no patch, as test wheels
    stamp it; ``fields`` set the rest (a build tag)."""
    return BuildManifest(
        version=version,
        base_version="0.20.1",
        mode="precompiled",
        source="pypi",
        upstream=[],
        series_digest="0" * 64,
        validated_base="0.20.1",
        patches=[],
        skipped=[],
        files=[],
        toolchain={},
        **fields,
    )


def mutated_tree(work: Path, tmp_path: Path, path: str, old: str, new: str, anchor: str) -> Path:
    """A copy of ``work``'s ``vllm/`` with the first ``old`` after ``anchor`` in ``path``
    replaced by ``new``: a tree that carries a fix's option but gets one line of it wrong."""
    root = tmp_path / "tree"
    shutil.copytree(work / "vllm", root / "vllm")
    text = (root / path).read_text(encoding="utf-8")
    at = text.index(old, text.index(anchor))
    (root / path).write_text(text[:at] + new + text[at + len(old) :], encoding="utf-8")
    return root


def probe_tree(root: Path, probe_python: Path, cache: CacheLayout, name: str) -> Any:
    """The probe ``name``'s result on the tree at ``root``."""
    from tooling.probing import ProbeTarget, run_probes

    target = ProbeTarget(python=probe_python, root=root, pycache=cache.root / "pycache")
    return run_probes(target, (name,))[name]
