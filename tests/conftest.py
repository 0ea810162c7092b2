"""Shared fixtures: a per-session cache linked to the real pinned artifacts, the probe
interpreter and the reference ``dflash``, and the patched 0.20.1 work tree and wheel, each
made once per session.

Tests never write into the user's cache (``$VLLM_DFLASH_CACHE``, else
``~/.cache/vllm-dflash``). At start-up the session makes a cache of its own in
the temp folder, links the user's artifacts, unpacked sources and compiled
modules into it, and points ``$VLLM_DFLASH_CACHE`` at it, so that every
``tooling`` the tests start, in-process or as a child, reads the real files
and writes only there. An artifact the user's cache lacks is fetched into it
once by the tool itself (what ``tooling fetch`` would do), then linked.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tooling.building.build import BuildOptions, BuildResult, build_precompiled
from tooling.errors import CacheMissError
from tooling.fetching.bases import Base, BaseCatalog, load_bases
from tooling.fetching.fetch import FetchOptions, fetch_pypi
from tooling.fetching.upstream import Upstream, fetch_upstream
from tooling.fsutil import locked
from tooling.patching.apply import apply_series
from tooling.patching.outcome import SeriesReport
from tooling.patching.series import Series, load_series
from tooling.paths import REPO_DIR, CacheLayout, default_cache_dir
from tooling.probing.env import ensure_probe_env, ensure_reference_dflash, probe_python_from

from . import zlibs
from .helpers import PATCHES, apply_options, bytecode_env, link_artifacts, seed_bytecode

#: Names the user's cache for the session's processes (xdist workers included), whose
#: ``$VLLM_DFLASH_CACHE`` names the session's own.
USER_CACHE_VAR = "TOOLING_TESTS_USER_CACHE"


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller made the session cache; its environment came along
    # The torch of a child (the trainer, the tiny models, the reference) computes with one
    # thread per core by default; next to the other workers' children that oversubscribes
    # the cores, and OpenMP's waiting threads spin. Each worker's children get their share of
    # the cores (a value set outside stays).
    workers = getattr(config.option, "numprocesses", None)
    workers = workers if isinstance(workers, int) and workers > 0 else 1
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    user = CacheLayout(default_cache_dir(os.environ))
    session = CacheLayout(Path(tempfile.mkdtemp(prefix="vllm-dflash-test-cache-")))
    config.add_cleanup(lambda: shutil.rmtree(session.root, ignore_errors=True))
    link_artifacts(user, session)
    os.environ[USER_CACHE_VAR] = str(user.root)
    os.environ["VLLM_DFLASH_CACHE"] = str(session.root)


#: Every fixture of the real artifacts or the CPU probe environment goes through ``cache``;
#: ``other_libz`` may build zlib-ng.
NEEDS_SLOW_MARK = frozenset({"cache", "other_libz"})


@pytest.fixture(autouse=True)
def _slow_tests_are_marked(request: pytest.FixtureRequest) -> None:
    """``make check`` leaves out the tests marked ``slow`` where they are written; one that
    reaches these fixtures unmarked would make the fast tier wait on them."""
    reached = NEEDS_SLOW_MARK & set(request.fixturenames)
    if reached and request.node.get_closest_marker("slow") is None:
        pytest.fail(f"uses {', '.join(sorted(reached))}: mark it pytest.mark.slow", pytrace=False)


@pytest.fixture(scope="session")
def user_cache() -> CacheLayout:
    """The user's cache: read through the session's links, filled only by the tool itself."""
    return CacheLayout(Path(os.environ[USER_CACHE_VAR]))


@pytest.fixture(scope="session")
def cache(user_cache: CacheLayout) -> CacheLayout:
    """This session's cache (``$VLLM_DFLASH_CACHE``, set for every process a test starts)."""
    session = CacheLayout(default_cache_dir(os.environ))
    assert session.root != user_cache.root
    seed_bytecode(user_cache, session)
    return session


@pytest.fixture(scope="session")
def catalog() -> BaseCatalog:
    return load_bases(PATCHES / "bases.toml")


@pytest.fixture(scope="session")
def series() -> Series:
    return load_series(PATCHES / "series.toml")


@pytest.fixture(scope="session")
def fetch_options(cache: CacheLayout) -> FetchOptions:
    """Offline: the session's cache only links, ``fetch_release`` fills the user's."""
    return FetchOptions(cache=cache, offline=True, progress=False)


@pytest.fixture(scope="session")
def fetch_release(
    user_cache: CacheLayout, cache: CacheLayout, fetch_options: FetchOptions
) -> Callable[..., Upstream]:
    """``fetch(base, with_wheel=True)``: a pinned release, read from the session's cache."""

    def fetch(base: Base, *, with_wheel: bool = True) -> Upstream:
        try:
            return fetch_upstream(base, fetch_options, with_wheel=with_wheel)
        except CacheMissError:
            # Once per machine, as `tooling fetch` does it: into the user's cache.
            fetch_pypi(base, FetchOptions(cache=user_cache), with_wheel=with_wheel)
            link_artifacts(user_cache, cache)
            return fetch_upstream(base, fetch_options, with_wheel=with_wheel)

    return fetch


@pytest.fixture(scope="session")
def probe_python(user_cache: CacheLayout, cache: CacheLayout) -> Path:
    """The CPU interpreter with torch, transformers and vLLM's imports: $TOOLING_PROBE_PYTHON
    (``make test`` sets it), else the one ``tooling probe-env`` makes once in the user's cache.

    Through ``cache``, the session's bytecode is seeded before any child of it starts, so
    that no child compiles torch and transformers again from source.
    """
    return probe_python_from(os.environ) or ensure_probe_env(user_cache)


@pytest.fixture(scope="session")
def dflash_path(user_cache: CacheLayout, probe_python: Path) -> Path:
    """The folder holding the reference ``dflash`` 0.1.0 (for PYTHONPATH):
    $TOOLING_DFLASH_PATH (``make test`` sets it), else the one ``tooling probe-env``
    installs once in the user's cache."""
    value = os.environ.get("TOOLING_DFLASH_PATH")
    return Path(value) if value else ensure_reference_dflash(user_cache, probe_python)


@pytest.fixture(scope="session")
def upstream_0201(catalog: BaseCatalog, fetch_release: Callable[..., Upstream]) -> Upstream:
    return fetch_release(catalog.get("0.20.1"))


@pytest.fixture(scope="session")
def upstream_0220(catalog: BaseCatalog, fetch_release: Callable[..., Upstream]) -> Upstream:
    return fetch_release(catalog.get("0.22.0"))


@pytest.fixture(scope="session")
def patched_0201(
    tmp_path_factory,
    upstream_0201: Upstream,
    series: Series,
    probe_python: Path,
    cache: CacheLayout,
) -> SeriesReport:
    """The series applied to 0.20.1 with probes before and after."""
    work = tmp_path_factory.mktemp("patched") / "vllm-0.20.1"
    return apply_series(upstream_0201, series, work, apply_options(probe_python, cache))


@pytest.fixture(scope="session")
def patched_0220(
    tmp_path_factory,
    upstream_0220: Upstream,
    series: Series,
    probe_python: Path,
    cache: CacheLayout,
) -> SeriesReport:
    """The series on 0.22.0, which already fixed the offset upstream (keep-going)."""
    work = tmp_path_factory.mktemp("patched") / "vllm-0.22.0"
    return apply_series(
        upstream_0220, series, work, apply_options(probe_python, cache, keep_going=True)
    )


@pytest.fixture(scope="session")
def built_wheel(
    tmp_path_factory, upstream_0201: Upstream, series: Series, patched_0201: SeriesReport
) -> BuildResult:
    dist = tmp_path_factory.mktemp("dist")
    return build_precompiled(
        upstream_0201,
        series,
        patched_0201,
        BuildOptions(dist_dir=dist, source_date_epoch=1795910400),
    )


@pytest.fixture(scope="session")
def other_libz(request: pytest.FixtureRequest) -> Path:
    """A folder holding a ``libz.so.1`` other than this Python's: $TOOLING_TEST_LIBZ, else
    zlib-ng built once into pytest's cache (``tests/zlibs.py``)."""
    value = os.environ.get(zlibs.OTHER_LIBZ_VAR)
    if value:
        return Path(value)
    folder = request.config.cache.mkdir("zlib-ng-2.3.3")
    with locked(folder):
        if not (folder / "libz.so.1").exists():
            if missing := zlibs.missing_tools():
                pytest.skip(
                    f"no {' or '.join(missing)} to build zlib-ng with "
                    f"(${zlibs.OTHER_LIBZ_VAR} may name a folder with another libz.so.1)"
                )
            zlibs.build_zlib_ng(folder)
    return folder


@pytest.fixture(scope="session")
def probe_env(probe_python: Path, dflash_path: Path) -> tuple[str, dict[str, str]]:
    """The probe interpreter, and an environment where it imports tooling and dflash."""
    env = bytecode_env()
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_DIR), str(dflash_path), env.get("PYTHONPATH", "")) if p
    )
    env["TOKENIZERS_PARALLELISM"] = "true"
    return str(probe_python), env


@pytest.fixture
def tiny_pair(tmp_path: Path) -> Path:
    """A pair folder the speed run plans from (its manifest only; no weights are read)."""
    pair = tmp_path / "pair"
    pair.mkdir()
    manifest = {
        "target": "/p/target",
        "drafter": "/p/drafter",
        "spec": {"vocab_size": 512, "seed": 3},
    }
    (pair / "tiny.json").write_text(json.dumps(manifest))
    return pair
