"""Shared fixtures: the real pinned artifacts (cached per user), the probe interpreter, and
the patched 0.20.1 work tree and wheel, each made once per session."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tooling.building.build import BuildOptions, BuildResult, build_precompiled
from tooling.fetching.bases import BaseCatalog, load_bases
from tooling.fetching.fetch import FetchOptions
from tooling.fetching.upstream import Upstream, fetch_upstream
from tooling.patching.apply import ApplyOptions, SeriesReport, apply_series
from tooling.patching.series import Series, load_series
from tooling.paths import REPO_DIR, CacheLayout, default_cache_dir
from tooling.probe_env import ensure_probe_env

PATCHES = REPO_DIR / "patches"


@pytest.fixture(scope="session")
def cache() -> CacheLayout:
    """The real per-user cache: vLLM artifacts are downloaded once per machine."""
    return CacheLayout(default_cache_dir())


@pytest.fixture(scope="session")
def catalog() -> BaseCatalog:
    return load_bases(PATCHES / "bases.toml")


@pytest.fixture(scope="session")
def series() -> Series:
    return load_series(PATCHES / "series.toml")


@pytest.fixture(scope="session")
def fetch_options(cache: CacheLayout) -> FetchOptions:
    return FetchOptions(cache=cache, progress=False)


@pytest.fixture(scope="session")
def probe_python(cache: CacheLayout) -> Path:
    """The CPU interpreter with torch and vLLM's imports ($TOOLING_PROBE_PYTHON, else built)."""
    value = os.environ.get("TOOLING_PROBE_PYTHON")
    return Path(value) if value else ensure_probe_env(cache)


@pytest.fixture(scope="session")
def upstream_0201(catalog: BaseCatalog, fetch_options: FetchOptions) -> Upstream:
    return fetch_upstream(catalog.get("0.20.1"), fetch_options)


@pytest.fixture(scope="session")
def upstream_0220(catalog: BaseCatalog, fetch_options: FetchOptions) -> Upstream:
    return fetch_upstream(catalog.get("0.22.0"), fetch_options)


def apply_options(probe_python: Path | None, cache: CacheLayout, **kw) -> ApplyOptions:
    return ApplyOptions(probe_python=probe_python, pycache=cache.root / "pycache", **kw)


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


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


@pytest.fixture(scope="session")
def probe_py() -> Path:
    """The probe interpreter from $TOOLING_PROBE_PYTHON; tests that run vLLM on a CPU
    skip without it (they never build it themselves)."""
    value = os.environ.get("TOOLING_PROBE_PYTHON")
    if not value:
        pytest.skip("TOOLING_PROBE_PYTHON is unset: it names the CPU interpreter with torch")
    return Path(value)


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
        **os.environ,
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


#: Fixtures that need the real 244 MB artifacts, the CPU probe environment or both.
HEAVY_FIXTURES = frozenset(
    {
        "cache",
        "fetch_options",
        "probe_python",
        "probe_py",
        "dflash_path",
        "upstream_0201",
        "upstream_0220",
        "patched_0201",
        "patched_0220",
        "built_wheel",
        "smoke_run",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``slow`` every test that reaches a heavy fixture (``make check`` skips them)."""
    for item in items:
        if HEAVY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
