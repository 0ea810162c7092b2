"""The ledger's `requires`: a patch written on another's lines cannot go in without it."""

from __future__ import annotations

import shutil

import pytest

from tooling.errors import SeriesError
from tooling.patching.series import load_series

from .helpers import PATCHES


def test_skipping_a_patch_another_is_written_on_names_both():
    series = load_series(PATCHES / "series.toml")
    assert series.get("dflash-fp8-kv-cache").requires == ("dflash-swa-config",)
    with pytest.raises(
        SeriesError,
        match="--skip dflash-swa-config: patch dflash-fp8-kv-cache is written on it; "
        "skip dflash-fp8-kv-cache too",
    ):
        series.without(["dflash-swa-config"])
    # Patch 22 is written on patch 5's lines in turn, patches 32 and 40 on patch 22's and 33
    # on 32's.
    with pytest.raises(SeriesError, match="patch gdn-spec-replay is written on it"):
        series.without(["dflash-swa-config", "dflash-fp8-kv-cache", "drafter-full-graphs"])
    four = ["dflash-swa-config", "dflash-fp8-kv-cache", "drafter-full-graphs", "gdn-spec-replay"]
    with pytest.raises(SeriesError, match="patch join-hold is written on it"):
        series.without(four)
    with pytest.raises(SeriesError, match="patch dflash-step-graphs is written on it"):
        series.without([*four, "join-hold"])
    chain = series.without([*four, "join-hold", "dflash-step-graphs"])
    assert "dflash-fp8-kv-cache" not in {p.id for p in chain.patches}


def test_a_requirement_must_be_an_earlier_patch(tmp_path):
    folder = tmp_path / "patches"
    shutil.copytree(PATCHES, folder)
    ledger = folder / "series.toml"
    text = ledger.read_text()
    ledger.write_text(
        text.replace('requires = ["dflash-swa-config"]', 'requires = ["dflash-compile-key"]')
    )
    with pytest.raises(SeriesError, match="requires 'dflash-compile-key', which is not an earlier"):
        load_series(ledger)


def test_on_a_base_that_has_a_fix_already_its_requirement_does_not_hold_a_skip():
    """Patch 33 is written on patch 32's lines on 0.20.1. On 0.34.0, which has patch 33's aim in
    its own form (superseded there), patch 32 can be left out alone: nothing is written on it
    there. On 0.20.1 the same skip is still refused."""
    from tooling.patching.series import load_ledger

    series = load_ledger(PATCHES)
    with pytest.raises(SeriesError, match="patch join-hold is written on it"):
        series.without(["gdn-spec-replay"], "0.20.1")
    undecided = ["piecewise-spec-sizes", "gdn-spec-replay"]
    left = series.without(undecided, "0.34.0")
    assert "join-hold" in {p.id for p in left.patches}
    resolved = left.for_base("0.34.0", strict=True)
    assert resolved.get("join-hold").requires == ()
    assert not resolved.get("join-hold").carried
