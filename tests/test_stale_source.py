"""The unpacked sdist in the cache, changed after it was unpacked (slow: the real pinned
0.20.1 artifacts). Every later build failed (exit 13), blaming "the official wheel's copy",
until the work folder was deleted by hand. A change its listing sees is moved aside and the
tree unpacked again from the verified sdist; one it does not see is named by the build,
the tree moved aside, and the next run builds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tooling.errors import IntegrityError
from tooling.paths import default_cache_dir

from .helpers import HANG_GUARD_S

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("upstream_0201")]

ARTIFACTS = ("vllm-0.20.1.tar.gz", "vllm-0.20.1-1-cp38-abi3-manylinux_2_35_x86_64.whl")
#: A file patch 1 and others change: the build compares it with the official wheel's.
TOUCHED = "vllm/envs.py"


def _cache(tmp_path: Path) -> Path:
    """A cache of its own: links to the session's pinned artifacts, its sources its own."""
    cache = tmp_path / "cache"
    (cache / "pypi").mkdir(parents=True)
    for name in ARTIFACTS:
        (cache / "pypi" / name).symlink_to(default_cache_dir(os.environ) / "pypi" / name)
    return cache


def _tooling(tmp_path: Path, cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VLLM_DFLASH_CACHE": str(cache), "TOOLING_PROBE_PYTHON": ""}
    return subprocess.run(
        [sys.executable, "-m", "tooling", "--no-progress", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )


def _build(tmp_path: Path, cache: Path, work: str, dist: str) -> subprocess.CompletedProcess[str]:
    args = ("build", "--offline", "--no-probes", "--work-dir", work, "--dist", dist)
    return _tooling(tmp_path, cache, *args)


def _unpacked(cache: Path) -> Path:
    (tree,) = (cache / "sources").glob("sdist-*/vllm-0.20.1")
    return tree


def test_a_changed_unpacked_source_is_unpacked_again(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    assert _tooling(tmp_path, cache, "fetch", "--offline", "--no-wheel").returncode == 0
    tree = _unpacked(cache)
    with open(tree / TOUCHED, "a") as f:
        f.write("# an edit in the cache\n")
    done = _build(tmp_path, cache, "w", "dist")
    assert done.returncode == 0, done.stderr
    (aside,) = (cache / "sources" / "rejected").iterdir()
    assert (
        f"{tree.parent}: changed since it was unpacked from the pinned sdist; moved aside to "
        in (done.stderr)
    )
    assert (aside / "vllm-0.20.1" / TOUCHED).read_text().endswith("# an edit in the cache\n")
    assert not (tree / TOUCHED).read_text().endswith("# an edit in the cache\n")


def test_a_change_the_listing_misses_is_named_and_the_next_build_passes(tmp_path: Path) -> None:
    """An edit keeping the file's size and time: the build's comparison with the official
    wheel finds it, and the cache, not the wheel, is named."""
    cache = _cache(tmp_path)
    assert _tooling(tmp_path, cache, "fetch", "--offline", "--no-wheel").returncode == 0
    path = _unpacked(cache) / TOUCHED
    stat, text = path.stat(), path.read_text()
    changed = text.replace("import", "IMPORT", 1)
    assert changed != text and len(changed) == len(text)
    path.write_text(changed)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    done = _build(tmp_path, cache, "w", "dist")
    assert done.returncode == IntegrityError.exit_code, done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        f"error: {path}: not the pinned sdist's copy: the unpacked source in the cache was "
        "changed; it was moved aside to "
    )
    again = _build(tmp_path, cache, "w", "dist")
    assert again.returncode == 0, again.stderr
    assert not list((tmp_path / "dist").glob(".*"))
