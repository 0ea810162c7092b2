"""The probe cache: verdicts of real probe runs on the real 0.20.1 tree, answered again only
while every file the probes loaded reads the same.

The probe interpreter is started through a wrapper that counts its starts, and the runs
after the first are forked from one ``ProbeHost``, which counts its forks: "answered from the
cache" is asserted as "no run made", not by time.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from tooling.cli.environ import NO_PROBE_CACHE, cache_layout
from tooling.probing import (
    ABSENT,
    UNKNOWN,
    ProbeHost,
    ProbeResult,
    ProbeRun,
    ProbeTarget,
    package,
    start_probes,
)
from tooling.probing import cache as probe_cache

from .counting import counting_python, started

PROBE = ("layer_offset",)
#: A file the layer_offset probe imports: it builds a real SpeculativeConfig.
IMPORTED = Path("vllm/config/speculative.py")


@dataclass(frozen=True)
class Setting:
    trees: list[Path]
    target: Callable[..., ProbeTarget]
    starts: Path
    kept: Path
    answer: ProbeResult
    version: str | None
    host: ProbeHost
    """The module's fork server, for the runs that must probe again."""

    def runs(self) -> int:
        """Probe runs made: interpreters started for one, and runs the host forked."""
        return started(self.starts) - self.host.starts + self.host.forks


@pytest.fixture(scope="module")
def setting(tmp_path_factory, upstream_0201, probe_python, cache):
    """Two copies of the 0.20.1 tree (only ``vllm/``, what the probes import), a cache
    folder of this module's own, a counting probe interpreter, and the verdict of a fresh
    run of it on the first copy."""
    folder = tmp_path_factory.mktemp("probe-cache")
    trees = []
    for name in ("a", "b"):
        shutil.copytree(upstream_0201.source_dir / "vllm", folder / name / "vllm", symlinks=True)
        trees.append(folder / name)
    python, starts = counting_python(folder, probe_python)
    kept = folder / "kept"

    def target(root: Path, interpreter: Path = python) -> ProbeTarget:
        pycache = cache.root / "pycache"
        return ProbeTarget(python=interpreter, root=root, pycache=pycache, cache=kept)

    first = start_probes(target(trees[0]), PROBE)
    assert not first.cached and first.process is not None
    answer = first.wait()[PROBE[0]]
    assert answer.status == ABSENT, answer.evidence
    assert started(starts) == 1
    with ProbeHost(python, cache.root / "pycache") as host:
        yield Setting(trees, target, starts, kept, answer, first.vllm_version, host)


def answer_of(run: ProbeRun):
    return run.wait()[PROBE[0]]


@pytest.mark.slow
def test_an_identical_tree_elsewhere_is_answered_without_an_interpreter(setting):
    s = setting
    run = start_probes(s.target(s.trees[1]), PROBE)
    assert run.cached and run.process is None
    got = answer_of(run)
    assert s.runs() == 1
    assert (got.status, got.evidence, got.details) == (
        s.answer.status,
        s.answer.evidence,
        s.answer.details,
    )
    assert got.cached and not s.answer.cached
    assert run.vllm_version == s.version == "0.20.1"


@pytest.mark.slow
def test_one_byte_of_an_imported_file_makes_it_probe_again(setting, tmp_path):
    s = setting
    tree = shutil.copytree(s.trees[0], tmp_path / "tree", symlinks=True)
    path = tree / IMPORTED
    path.write_bytes(path.read_bytes() + b"#")
    before = s.runs()
    run = start_probes(s.target(tree), PROBE, host=s.host)
    assert not run.cached and run.process is not None
    got = answer_of(run)
    assert s.runs() == before + 1
    assert got.status == s.answer.status and not got.cached
    # That s.answer is s.kept too, for the changed bytes.
    assert start_probes(s.target(tree), PROBE).cached
    assert s.runs() == before + 1


@pytest.mark.slow
def test_a_newer_list_of_other_imports_does_not_hide_the_one_that_matches(setting):
    """Lists are tried newest first; what one of them hashed must not leak into the next."""
    s = setting
    listed = max(s.kept.glob("*/lists/*.json"), key=lambda p: p.stat().st_mtime_ns)
    other = json.loads(listed.read_text())
    other["top_level"] = [*other["top_level"], "dflash_other_module"]
    newer = listed.with_name("0" * 64 + ".json")
    newer.write_text(json.dumps(other))
    later = listed.stat().st_mtime_ns + 10**9
    os.utime(newer, ns=(later, later))
    before = s.runs()
    try:
        assert start_probes(s.target(s.trees[1]), PROBE).cached
        assert s.runs() == before
    finally:
        newer.unlink()


@pytest.mark.slow
def test_a_module_added_to_an_imported_package_makes_it_probe_again(setting, tmp_path):
    """A new file could be what an import now finds (or what one that failed finds)."""
    s = setting
    tree = shutil.copytree(s.trees[0], tmp_path / "tree", symlinks=True)
    (tree / IMPORTED).with_name("dflash_extra.py").write_text("")
    with start_probes(s.target(tree), PROBE) as run:
        assert not run.cached and run.process is not None


@pytest.mark.slow
def test_a_changed_probe_source_makes_it_probe_again(setting, tmp_path, monkeypatch):
    s = setting
    probes = shutil.copytree(
        package.PACKAGE_DIR,
        tmp_path / "probes",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    source = probes / f"{PROBE[0]}.py"
    source.write_text(source.read_text() + "# one more line\n")
    monkeypatch.setattr(package, "PACKAGE_DIR", probes)
    with start_probes(s.target(s.trees[0]), PROBE) as run:
        assert not run.cached and run.process is not None


@pytest.mark.slow
def test_the_bypass_variable_probes_again(setting, tmp_path):
    """The command line reads the variable into a cache whose probe verdicts are unused."""
    s = setting
    layout = cache_layout(None, {NO_PROBE_CACHE: "1", "VLLM_DFLASH_CACHE": str(tmp_path)})
    assert layout.root == tmp_path and layout.probes is None
    with start_probes(replace(s.target(s.trees[0]), cache=layout.probes), PROBE) as run:
        assert not run.cached and run.process is not None


@pytest.mark.slow
def test_a_corrupt_cache_is_ignored_and_replaced(setting, tmp_path):
    s = setting
    kept = [*s.kept.glob("*/verdicts/*.json"), *s.kept.glob("*/lists/*.json")]
    assert len(kept) >= 2 and (s.kept / "stat-memo.json").is_file()
    for path in [*kept, s.kept / "stat-memo.json"]:
        path.write_text('{"schema": 1, "results": [')  # cut short, as a crash would leave it
    before = s.runs()
    run = start_probes(s.target(s.trees[0]), PROBE, host=s.host)
    assert not run.cached
    assert answer_of(run).status == s.answer.status
    assert s.runs() == before + 1
    # The run wrote its entry over the broken one: the other copy is answered from it.
    assert start_probes(s.target(s.trees[1]), PROBE).cached
    assert s.runs() == before + 1
    json.loads((s.kept / "stat-memo.json").read_text())


@pytest.mark.slow
def test_unknown_verdicts_are_never_kept(setting, tmp_path):
    """The toolchain's interpreter has no torch: vLLM does not import, the probe reads
    unknown; a run past its time limit (an interpreter that never finishes) reads unknown
    too. Neither is kept."""
    s = setting
    kept_before = sorted(s.kept.glob("*/verdicts/*.json"))
    python, starts = counting_python(tmp_path, Path(sys.executable))
    for _ in range(2):
        (result,) = start_probes(s.target(s.trees[0], python), PROBE).wait().values()
        assert result.status == UNKNOWN and not result.cached
    assert started(starts) == 2
    tree = shutil.copytree(s.trees[0], tmp_path / "tree", symlinks=True)
    (tree / IMPORTED).write_bytes((tree / IMPORTED).read_bytes() + b"\n")
    hangs = tmp_path / "hangs"
    hangs.write_text("#!/bin/sh\nexec sleep 300\n")
    hangs.chmod(0o755)
    (result,) = start_probes(s.target(tree, hangs), PROBE, timeout_s=0.5).wait().values()
    assert result.status == UNKNOWN and "timed out" in result.evidence
    assert sorted(s.kept.glob("*/verdicts/*.json")) == kept_before


def test_the_first_level_key_follows_the_environment_vllm_reads(tmp_path):
    """A VLLM_* variable can switch vLLM's code path; the run's own folder and the probed
    tree's place cannot change the answer."""

    def folder(env: dict[str, str], root: str, scratch: str) -> Path:
        return probe_cache.ProbeCache.open(
            tmp_path,
            sources="s",
            python=Path("/p/python"),
            names=PROBE,
            env={"PYTHONPATH": f"{root}:{scratch}", "HOME": scratch, **env},
            roots=[Path(root)],
            scratch=Path(scratch),
        ).folder

    plain = folder({}, "/trees/a", "/tmp/run1")
    assert folder({}, "/trees/b", "/tmp/run2") == plain
    assert folder({"VLLM_USE_V2_MODEL_RUNNER": "1"}, "/trees/a", "/tmp/run1") != plain


@pytest.mark.slow
def test_a_forked_run_keeps_verdicts_a_fresh_run_finds(setting, tmp_path):
    """A run a ``ProbeHost`` forked reports the imports of a fresh interpreter: its verdicts
    answer a fresh run on a copy of the tree, and they are the fresh run's own."""
    s = setting
    kept = tmp_path / "kept"
    target = replace(s.target(s.trees[0]), cache=kept)
    before, forks = s.runs(), s.host.forks
    forked = start_probes(target, PROBE, host=s.host)
    assert not forked.cached and s.host.forks == forks + 1
    got = answer_of(forked)
    assert s.runs() == before + 1
    assert (got.status, got.evidence, got.details) == (
        s.answer.status,
        s.answer.evidence,
        s.answer.details,
    )
    fresh = start_probes(replace(s.target(s.trees[1]), cache=kept), PROBE)
    assert fresh.cached and s.runs() == before + 1


def test_bytecode_read_from_outside_the_given_prefix_is_keyed_by_content(tmp_path):
    """A ``.pth`` of the probed environment can point ``sys.pycache_prefix`` elsewhere: the
    bytecode the run read there is what ran, so other code under it must probe again. The
    bytecode under the prefix the toolchain gave is its own compile of the keyed sources."""
    own, elsewhere = tmp_path / "own", tmp_path / "pfx"
    source = tmp_path / "tree" / "mod.py"
    own_pyc, other_pyc = own / "mod.cpython-311.pyc", elsewhere / "mod.cpython-311.pyc"
    for path in (source, own_pyc, other_pyc):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"compiled from the source")
    past = time.time_ns() - 10 * 10**9
    for path in (source, own_pyc, other_pyc):
        os.utime(path, ns=(past, past))
    kept = probe_cache.ProbeCache.open(
        tmp_path / "kept",
        sources="s",
        python=Path("/p/python"),
        names=PROBE,
        env={"PYTHONPYCACHEPREFIX": str(own)},
        roots=[],
        scratch=tmp_path / "run",
    )
    imports = {
        "files": [str(source)],
        "bytecode": [str(own_pyc), str(other_pyc)],
        "packages": [],
        "sys_path": [],
        "top_level": ["mod"],
    }
    answer = {PROBE[0]: ProbeResult(probe=PROBE[0], status=ABSENT, evidence="e")}
    assert kept.store(imports, tmp_path / "run", time.time_ns(), answer, "0.20.1")
    assert kept.lookup() is not None
    own_pyc.write_bytes(b"the toolchain's own compile, again")
    assert kept.lookup() is not None
    other_pyc.write_bytes(b"other code under a matching header")
    assert kept.lookup() is None
