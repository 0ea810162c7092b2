"""``build_requested``: what it refuses before any work (no fetch, no work tree)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tooling.building.request import WheelRequest, build_requested
from tooling.errors import BuildError
from tooling.fetching.bases import load_bases
from tooling.fetching.fetch import FetchOptions
from tooling.fetching.upstream import SourceRequest
from tooling.patching.series import load_series
from tooling.paths import CacheLayout, default_patches_dir


def _request(tmp_path: Path, **changes: object) -> WheelRequest:
    patches = default_patches_dir(os.environ)
    fields: dict = {
        "source": SourceRequest(None, "pypi", None, None, False),
        "catalog": load_bases(patches / "bases.toml"),
        # Offline on an empty cache: any fetch would fail, so a refusal shows it came first.
        "fetch": FetchOptions(cache=CacheLayout(tmp_path / "cache"), offline=True),
        "series": load_series(patches / "series.toml"),
        "dist_dir": tmp_path / "dist",
        "work_dir": tmp_path / "work",
        **changes,
    }
    return WheelRequest(**fields)


def test_precompiled_kernels_outside_source_mode_are_refused_before_any_work(tmp_path):
    request = _request(tmp_path, use_precompiled_kernels=True)
    with pytest.raises(BuildError, match=r"^--use-precompiled-kernels goes with --mode source$"):
        build_requested(request)
    assert not (tmp_path / "work").exists()
    assert not (tmp_path / "cache").exists()


def test_a_dist_that_is_a_file_is_refused_before_any_work(tmp_path):
    (tmp_path / "dist").write_text("")
    with pytest.raises(BuildError, match=r"is a file, not a folder$"):
        build_requested(_request(tmp_path))
    assert not (tmp_path / "work").exists()
