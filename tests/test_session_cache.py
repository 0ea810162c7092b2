"""The session's cache: tests read the user's cache through it and never write there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tooling.paths import CacheLayout, default_cache_dir

from .helpers import link_artifacts, seed_bytecode

pytestmark = pytest.mark.slow


def listing(root: Path) -> dict[str, tuple[bool, int, int]]:
    """Every entry under ``root``, links followed: (folder?, size, mtime in ns)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            st = path.stat()
            out[str(path.relative_to(root))] = (path.is_dir(), st.st_size, st.st_mtime_ns)
    return out


def test_every_process_of_the_session_is_pointed_at_the_session_cache(cache, user_cache):
    assert default_cache_dir(os.environ) == cache.root
    assert os.environ["VLLM_DFLASH_CACHE"] == str(cache.root)
    assert not cache.root.resolve().is_relative_to(user_cache.root.resolve())


def tooling_on(cache: CacheLayout, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tooling", "--no-progress", *args],
        env={**os.environ, "VLLM_DFLASH_CACHE": str(cache.root)},
        capture_output=True,
        text=True,
    )


def test_fetch_and_probes_through_a_session_cache_leave_the_user_cache_as_it_was(
    tmp_path, upstream_0201, user_cache, probe_python
):
    """A stand-in for the user's cache holds the real 0.20.1 artifacts, unpacked source and
    the probe interpreter's compiled modules; a session cache is made from it as conftest
    makes this session's, and `tooling fetch` and `tooling probe` run on it: they write
    (locks, the probed tree's bytecode), all of it into the session's cache."""
    user = CacheLayout(tmp_path / "user")
    for real in (upstream_0201.sdist, upstream_0201.wheel):
        (user.artifacts / real.name).parent.mkdir(parents=True, exist_ok=True)
        (user.artifacts / real.name).symlink_to(real.resolve())
    entry = upstream_0201.source_dir.parent
    (user.sources / entry.name).parent.mkdir(parents=True)
    (user.sources / entry.name).symlink_to(entry.resolve())
    prefix = subprocess.run(
        [str(probe_python), "-c", "import sys; print(sys.prefix)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    mirror = Path(prefix).resolve().relative_to("/")
    if (user_cache.root / "pycache" / mirror).is_dir():
        (user.root / "pycache" / mirror).parent.mkdir(parents=True)
        subprocess.run(
            ["cp", "-al", user_cache.root / "pycache" / mirror, user.root / "pycache" / mirror],
            check=True,
        )
    before = listing(user.root)

    session = CacheLayout(tmp_path / "session")
    link_artifacts(user, session)
    seed_bytecode(user, session)
    fetched = tooling_on(session, "fetch", "--offline", "--json")
    assert fetched.returncode == 0, fetched.stderr
    tree = Path(json.loads(fetched.stdout)["source_dir"])
    assert tree.is_relative_to(session.sources)
    args = ("probe", "--root", str(tree), "--python", str(probe_python), "--probe", "layer_offset")
    probed = tooling_on(session, *args, "--json")
    assert probed.returncode == 0, probed.stderr
    assert [r["status"] for r in json.loads(probed.stdout)["results"]] == ["absent"]
    assert listing(user.root) == before
    # The probes did write: the tree's bytecode went to the session's cache.
    assert any((session.root / "pycache" / tree.resolve().relative_to("/")).rglob("*.pyc"))
