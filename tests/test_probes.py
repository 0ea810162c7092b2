"""Probes on real upstream releases: each reads absent where the release has the bug and
present where upstream fixed it its own way (0.20.1, stock and patched: test_apply)."""

from __future__ import annotations

import pytest

from tooling.probing import ABSENT, PRESENT, ProbeHost, ProbeResult, ProbeTarget, run_probes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def probe_release(catalog, fetch_release, probe_python, cache):
    """Probe a release's tree; the module's runs are forked from one probe interpreter, as
    the runs of one release are in ``tooling patch`` (each answers as a fresh run would:
    tests/test_probe_host.py)."""
    pycache = cache.root / "pycache"
    with ProbeHost(probe_python, pycache) as host:

        def run(version: str, *names: str) -> dict[str, ProbeResult]:
            upstream = fetch_release(catalog.get(version), with_wheel=False)
            target = ProbeTarget(python=probe_python, root=upstream.source_dir, pycache=pycache)
            return run_probes(target, names, host=host)

        yield run


def test_lookahead_slots_absent_on_0220(probe_release):
    (result,) = probe_release("0.22.0", "lookahead_slots").values()
    assert result.status == ABSENT, result.evidence
    assert result.details["outside"] == {
        "first prefill K=3": 4,
        "first prefill K=15": 16,
        "decode all-accepted K=3": 1,
    }


def test_lookahead_slots_present_on_0230(probe_release):
    (result,) = probe_release("0.23.0", "lookahead_slots").values()
    assert result.status == PRESENT, result.evidence
    assert set(result.details["outside"].values()) == {0}


def test_0330_keeps_every_block_and_reserves_every_slot(probe_release):
    results = probe_release("0.33.0", "eagle_cache_drop", "lookahead_slots")
    cache_drop = results["eagle_cache_drop"]
    assert cache_drop.status == PRESENT, cache_drop.evidence
    assert cache_drop.form == "needs_eagle_block_drop() -> False"
    assert cache_drop.details["hybrid_cached_dflash"] == cache_drop.details["hybrid_cached_no_spec"]
    assert cache_drop.details["hybrid_cached_dflash"] == 192
    assert results["lookahead_slots"].status == PRESENT, results["lookahead_slots"].evidence


def test_swa_windows_absent_on_0240_whose_v2_runner_gives_every_layer_one_causality(
    probe_release,
):
    """0.24's V2 runner has no per-layer causality (``get_draft_attn_causal`` came in 0.26):
    every drafter layer gets the config's one flag, and no window reaches FlashAttention."""
    (result,) = probe_release("0.24.0", "swa_windows").values()
    assert result.status == ABSENT, result.evidence
    assert result.details["runner"] == "v2 runner"
    assert result.details["masks"] == [[-1, -1]] * 3
