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

import dataclasses
import os
import shutil
import subprocess
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
from tooling.patching.apply import ApplyOptions, SeriesReport, apply_series
from tooling.patching.series import Series, load_series
from tooling.paths import REPO_DIR, CacheLayout, default_cache_dir
from tooling.probe_env import ensure_probe_env, ensure_reference_dflash, probe_python_from_env

from . import zlibs

PATCHES = REPO_DIR / "patches"

#: Names the user's cache for the session's processes (xdist workers included), whose
#: ``$VLLM_DFLASH_CACHE`` names the session's own.
USER_CACHE_VAR = "TOOLING_TESTS_USER_CACHE"


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

    Importing torch and vLLM from source takes a probe run 20 s longer. Python
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
    return {**env, "PYTHONPYCACHEPREFIX": str(default_cache_dir() / "pycache")}


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller made the session cache; its environment came along
    # ``--dist loadscope`` sorts the modules by how many tests each has, which put the
    # longest ones (few tests, minutes of real installs and probe runs) last, on one worker
    # while the other idled. LONGEST_FIRST orders them instead, and this keeps that order.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    # The torch of a child (the trainer, the tiny models, the reference) computes with one
    # thread per core by default; next to the other workers' children that oversubscribes
    # the cores, and OpenMP's waiting threads spin: on this 2-core machine the trainer's
    # smoke recipe took 35 s and 39 CPU-s beside one busy process, 18 s and 17 with one
    # thread. Each worker's children get their share of the cores (a value set outside stays).
    workers = getattr(config.option, "numprocesses", None)
    workers = workers if isinstance(workers, int) and workers > 0 else 1
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    user = CacheLayout(default_cache_dir())
    session = CacheLayout(Path(tempfile.mkdtemp(prefix="vllm-dflash-test-cache-")))
    config.add_cleanup(lambda: shutil.rmtree(session.root, ignore_errors=True))
    link_artifacts(user, session)
    os.environ[USER_CACHE_VAR] = str(user.root)
    os.environ["VLLM_DFLASH_CACHE"] = str(session.root)


@pytest.fixture(scope="session")
def user_cache() -> CacheLayout:
    """The user's cache: read through the session's links, filled only by the tool itself."""
    return CacheLayout(Path(os.environ[USER_CACHE_VAR]))


@pytest.fixture(scope="session")
def cache(user_cache: CacheLayout) -> CacheLayout:
    """This session's cache (``$VLLM_DFLASH_CACHE``, set for every process a test starts)."""
    session = CacheLayout(default_cache_dir())
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

    Through ``cache``, the session's bytecode is seeded before any child of it starts:
    torch and transformers compiled again from source cost a child 20 s.
    """
    return probe_python_from_env() or ensure_probe_env(user_cache)


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


def apply_options(probe_python: Path | None, cache: CacheLayout, **kw) -> ApplyOptions:
    """The session's options; its probe cache starts empty, so each tree's first probe runs."""
    return ApplyOptions(
        probe_python=probe_python,
        pycache=cache.root / "pycache",
        probe_cache=cache.probes,
        baselines=cache.baselines,
        **kw,
    )


@pytest.fixture(scope="session")
def patched_0201(
    tmp_path_factory,
    upstream_0201: Upstream,
    series: Series,
    probe_python: Path,
    cache: CacheLayout,
) -> SeriesReport:
    """The series applied to 0.20.1 with probes before and after (about 30 s)."""
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
    import json

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


#: Fixtures that need the real 244 MB artifacts, the CPU probe environment or both (or, for
#: ``other_libz``, a download and a C build).
HEAVY_FIXTURES = frozenset(
    {
        "cache",
        "fetch_options",
        "fetch_release",
        "probe_python",
        "dflash_path",
        "upstream_0201",
        "upstream_0220",
        "patched_0201",
        "patched_0220",
        "built_wheel",
        "other_libz",
        "smoke_run",
    }
)


#: The modules that keep one worker longest (seconds of tests and fixtures on two workers,
#: measured 2026-12-01), longest first. The scheduler hands modules out in collection order
#: (``pytest_configure`` turns off pytest-xdist's reordering by test count), so these go
#: first, the short ones fill in at the end, and the two workers finish together. Any
#: other module runs after these, in file order: a missing name costs time, never a test.
LONGEST_FIRST = (
    "test_verify_stock",  # 74 s
    "test_reliability",  # 74 s
    "test_verify",  # 65 s
    "test_probe_cache",  # 54 s
    "test_smoke_tiny",  # 52 s
    "test_trainer",  # 45 s
    "test_apply",  # 31 s
    "test_probes",  # 30 s
    "test_smoke_vllm_cpu",  # 29 s
    "test_drafter_refusals",  # 25 s
    "test_session_cache",  # 24 s
    "test_bundle",  # 21 s
    "test_build",  # 16 s
    "test_smoke_runner",  # 13 s
    "test_export",  # 11 s
    "test_probe_host",  # 10 s
    "test_fetch",  # 8 s
    "test_smoke_server",  # 8 s
)


def _module_rank(item: pytest.Item) -> int:
    name = Path(str(item.fspath)).stem
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``slow`` every test that reaches a heavy fixture (``make check`` skips them),
    and put the longest modules first (a stable sort: tests keep their order in a module)."""
    for item in items:
        if HEAVY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    items.sort(key=_module_rank)
