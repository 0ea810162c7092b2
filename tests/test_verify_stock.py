"""verify on stock installs (0.20.1, 0.22.0), a partial build, and pip --target's layout.

Apart from tests/test_verify.py (our wheel's install) so the two halves, each of long real
installs and probe runs, can go to different pytest-xdist workers. Stock 0.20.1 is
installed once, with ``pip install --target`` as offline GPU hosts install it, and verified
by its site-packages; the others into virtualenvs as ``verify --wheel`` makes its scratch
one, and verified by their interpreter. None has bytecode: what they check is the files
and the fixes (test_verify.py checks pip's bytecode on our wheel's install).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tooling.building.build import BuildOptions, build_precompiled
from tooling.errors import VerifyFixMissingError
from tooling.patching.apply import apply_series
from tooling.probing import ProbeTarget
from tooling.verifying.install import pip_install
from tooling.verifying.verify import (
    check_files,
    install_into_fresh_env,
    locate_in_site,
    locate_with_python,
    verify,
)

from .helpers import apply_options, touched_upstream
from .verify_helpers import ALL, by_number, run_cli, states

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target_install(tmp_path_factory, upstream_0201) -> Path:
    """The stock 0.20.1 wheel as `pip install --target` lays it out, as offline GPU hosts
    install it (no bytecode: what these tests check is the files and the fixes)."""
    site = tmp_path_factory.mktemp("target") / "site"
    failure = pip_install(upstream_0201.wheel, target=site, compile_bytecode=False)
    assert failure is None, failure
    return site


def test_stock_0201_has_none_of_the_fixes(target_install, probe_python):
    result = run_cli(
        "verify",
        "--site-packages",
        str(target_install),
        "--probe-python",
        str(probe_python),
        "--json",
    )
    assert result.returncode == VerifyFixMissingError.exit_code, result.stderr
    data = json.loads(result.stdout)
    assert data["integrity"]["ok"] and not data["built_by_us"]
    assert [f["state"] for f in data["fixes"]] == ["absent"] * len(ALL)
    assert data["identity"]["runtime"] == "0.20.1" and data["identity"]["stamped"] is None
    assert "(1, 16, 31, 46, 61)" in data["fixes"][0]["evidence"]
    assert "attention only: 176 with DFlash" in data["fixes"][2]["evidence"]
    assert 'attention + Mamba ("align"): 176 with DFlash' in data["fixes"][2]["evidence"]
    assert "first prefill K=3 (32-token prompt): 4 of 4 outside" in data["fixes"][3]["evidence"]


def test_stock_0220_has_fix_1_in_upstream_form(tmp_path, upstream_0220, probe_python, cache):
    python = install_into_fresh_env(
        upstream_0220.wheel, probe_python, tmp_path / "venv", compile_bytecode=False
    )
    report = verify(
        locate_with_python(python), ProbeTarget(python=python, pycache=cache.root / "pycache"), ALL
    )
    assert report.integrity_ok
    expected = {
        1: "present (upstream form)",
        2: "absent",
        3: "absent",
        4: "absent",
        5: "present (upstream form)",
        6: "absent",
        7: "absent",
        8: "absent",
        9: "absent",
        10: "absent",
        11: "absent",
        12: "absent",
        13: "absent",
        14: "absent",
        15: "absent",
        16: "absent",
        17: "absent",
        18: "absent",
        19: "absent",
        20: "absent",
        21: "absent",
        22: "absent",
        23: "absent",
        24: "absent",
        25: "absent",
        26: "absent",
        27: "absent",
        28: "absent",
        29: "absent",
        30: "absent",
        31: "absent",
        32: "absent",
        33: "absent",
        34: "absent",
        35: "absent",
        36: "absent",
        37: "absent",
        38: "absent",
        # 0.22.0 makes the align copy on the GPU, with no read back.
        39: "present (upstream form)",
        40: "absent",
    }
    assert by_number(states(report)) == expected
    assert [f.number for f in report.missing_fixes] == [
        n for n, s in expected.items() if s == "absent"
    ]
    assert dataclasses.replace(report, required=[1]).missing_fixes == []


def test_a_build_without_a_patch_reports_that_fix_absent(
    tmp_path, upstream_0201, series, probe_python, cache
):
    # Patch 13 is written on patch 3's scheduler lines: it goes too.
    partial = series.without(["eagle-cache-drop", "mamba-chunk-liveness"])
    upstream = touched_upstream(upstream_0201, series, tmp_path / "base")
    report = apply_series(upstream, partial, tmp_path / "w", apply_options(None, cache))
    wheel = build_precompiled(upstream, partial, report, BuildOptions(dist_dir=tmp_path))
    python = install_into_fresh_env(
        wheel.path, probe_python, tmp_path / "venv", compile_bytecode=False
    )
    result = verify(
        locate_with_python(python), ProbeTarget(python=python, pycache=cache.root / "pycache"), ALL
    )
    skipped = "absent (skipped in build)"
    expected = {n: "present" for n in ALL} | {3: skipped, 13: skipped}
    assert by_number(states(result)) == expected
    assert [f.number for f in result.missing_fixes] == [3, 13]


def test_pip_target_layout_checks_clean(target_install):
    """`pip install --target` moves console scripts to <target>/bin while RECORD still says
    ../../bin; integrity must follow them."""
    dist = locate_in_site(target_install)
    checked, problems = check_files(dist)
    assert problems == [] and checked > 3000
    script = target_install / "bin" / "vllm"
    original = script.read_bytes()
    script.write_text("#!/bin/sh\necho tampered\n")
    try:
        _, problems = check_files(dist)
    finally:
        script.write_bytes(original)
    assert [(p.kind, p.path) for p in problems] == [("modified", "../../bin/vllm")]
