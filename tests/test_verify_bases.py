"""verify on a ported base: a fix the ledger says is not needed there is shown so, with its
probe's reading, and not required; every other fix is required as on the validated base."""

from __future__ import annotations

import json

import pytest

from tooling.errors import VerifyFixMissingError
from tooling.patching.registry import registry
from tooling.patching.series import load_ledger
from tooling.probing import ABSENT, PRESENT, ProbeResult
from tooling.verifying.install import pip_install
from tooling.verifying.verify import FixState, base_release, fix_status

from .helpers import PATCHES
from .verify_helpers import run_cli


def _fix(patch_id: str):
    return next(f for f in registry().fixes if f.patch_id == patch_id)


def _result(fix, status: str) -> ProbeResult:
    return ProbeResult(probe=fix.probe, status=status, evidence="what the probe saw")


def test_the_installed_release_is_the_version_less_our_label():
    assert base_release("0.34.0+dflash.22.e6e4e27c") == "0.34.0"
    assert base_release("0.34.0") == "0.34.0"
    assert base_release("0.20.1+dflash.22.0123abcd") == "0.20.1"


def test_a_fix_not_needed_on_the_installed_base_is_satisfied_whatever_its_probe_reads():
    fix = _fix("drafter-full-graphs")  # not needed on 0.34.0 (series.toml)
    status = fix_status(fix, _result(fix, ABSENT), None, "0.34.0")
    assert status.state is FixState.NOT_NEEDED and status.state.satisfied
    assert not status.state.present
    assert status.evidence.endswith("(probe: absent: what the probe saw)")
    assert "V1 proposer" in status.evidence  # the ledger's why comes first
    # On the validated base the same fix is required, and absent is absent.
    status = fix_status(fix, _result(fix, ABSENT), None, "0.20.1")
    assert status.state is FixState.ABSENT and not status.state.satisfied


def test_a_superseded_or_ported_fix_on_a_ported_base_is_still_decided_by_its_probe():
    superseded = _fix("dflash-layer-id-offset")
    assert fix_status(superseded, _result(superseded, PRESENT), None, "0.34.0").state is (
        FixState.PRESENT_UPSTREAM
    )
    assert fix_status(superseded, _result(superseded, ABSENT), None, "0.34.0").state is (
        FixState.ABSENT
    )
    ported = _fix("mamba-chunk-liveness")
    assert fix_status(ported, _result(ported, ABSENT), None, "0.34.0").state is FixState.ABSENT


@pytest.mark.slow
def test_stock_0340_lacks_its_ports_and_the_undecided_fixes(
    tmp_path, catalog, fetch_release, probe_python
):
    """Stock 0.34.0 from its official wheel, as `pip install --target` lays it out: every
    fix the ledger says is superseded there reads present in upstream's form, the ones it says
    are not needed read so, and the ports and the undecided fixes are what it lacks."""
    upstream = fetch_release(catalog.get("0.34.0"))
    site = tmp_path / "site"
    assert pip_install(upstream.wheel, target=site, compile_bytecode=False) is None
    result = run_cli(
        "verify", "--site-packages", str(site), "--probe-python", str(probe_python), "--json"
    )
    assert result.returncode == VerifyFixMissingError.exit_code, result.stderr
    data = json.loads(result.stdout)
    assert data["integrity"]["ok"] and not data["built_by_us"]
    states = {f["number"]: f["state"] for f in data["fixes"]}
    codes = {f.number: f.on.get("0.34.0") for f in registry().fixes}
    for number, code in codes.items():
        if code is None:
            expected = {"unknown", "absent"}
        elif code.state == "not-needed":
            expected = {"not needed on this base"}
        elif code.state == "superseded":
            expected = {"present (upstream form)"}
        else:
            expected = {"absent"}
        assert states[number] in expected, (number, states[number], data["fixes"][number - 1])
    missing = [n for n, c in codes.items() if c is None or c.state == "port"]
    assert f"required fix not present: {missing[0]} " in result.stderr
    assert sorted(n for n, s in states.items() if s in ("absent", "unknown")) == missing


@pytest.mark.slow
def test_the_candidate_0340_wheel_lacks_only_the_fix_it_leaves_out(
    tmp_path, catalog, fetch_release, probe_python, cache
):
    """The 0.34.0 build that leaves out by name the fixes with no code there yet (as the GPU
    session builds it: fixes 9 and 32, undecided) carries every port, each read present by
    its probe, and verify names those fixes alone."""
    fetch_release(catalog.get("0.34.0"))
    dist = tmp_path / "dist"
    left_out = load_ledger(PATCHES).without_code_on("0.34.0")
    assert left_out == ("piecewise-spec-sizes", "gdn-spec-replay")
    skips = [arg for fix in left_out for arg in ("--skip", fix)]
    built = run_cli(
        "build",
        "--offline",
        "--cache-dir",
        str(cache.root),
        "--base",
        "0.34.0",
        *skips,
        "--dist",
        str(dist),
        "--work-dir",
        str(tmp_path / "work"),
        "--probe-python",
        str(probe_python),
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = dist.glob("*.whl")
    # The series less the fixes it leaves out.
    assert wheel.name.startswith(f"vllm-0.34.0+dflash.{len(registry().fixes) - len(left_out)}.")
    assert ".skip.gdnspecreplay.piecewisespecsizes-" in wheel.name
    site = tmp_path / "site"
    assert pip_install(wheel, target=site, compile_bytecode=False) is None
    result = run_cli(
        "verify", "--site-packages", str(site), "--probe-python", str(probe_python), "--json"
    )
    assert result.returncode == VerifyFixMissingError.exit_code, result.stderr
    data = json.loads(result.stdout)
    assert data["integrity"]["ok"] and data["built_by_us"]
    states = {f["number"]: f["state"] for f in data["fixes"]}
    ports = [f.number for f in registry().fixes if (c := f.on.get("0.34.0")) and c.state == "port"]
    assert ports and all(states[n] == "present" for n in ports), states
    met = ("present", "present (upstream form)", "not needed on this base")
    assert [n for n, s in states.items() if s not in met] == [9, 32]
