"""The canary's verdict: newer releases only report, the validated base must apply cleanly."""

from __future__ import annotations

import pytest

from tooling.errors import PatchConflictError
from tooling.patching.apply import SeriesReport
from tooling.patching.series import load_series
from tooling.patching.status import BaseStatus, Canary
from tooling.paths import REPO_DIR


def _report(base: str, ok: bool) -> SeriesReport:
    return SeriesReport.from_json(
        {
            "base": base,
            "source": "sdist",
            "upstream_identity": "x",
            "series_digest": "y",
            "work_dir": "/w",
            "baseline": "b",
            "head": "h",
            "probe_python": None,
            "outcomes": [
                {
                    "patch_id": "p",
                    "patch_file": "p.patch",
                    "sha256": "0" * 64,
                    "message": "",
                    "status": "applied" if ok else "conflict",
                }
            ],
        }
    )


def test_only_the_validated_base_decides() -> None:
    series = load_series(REPO_DIR / "patches" / "series.toml")
    validated = series.validated_base
    newer_conflict = BaseStatus("9.9.9", _report("9.9.9", ok=False))
    good = BaseStatus(validated, _report(validated, ok=True))
    clean = Canary(series, [good, newer_conflict], 1.0)
    assert clean.ok and clean.to_json()["ok"] is True
    clean.raise_unless_ok()
    for broken in (
        BaseStatus(validated, _report(validated, ok=False)),
        BaseStatus(validated, None, error="fetch failed"),
    ):
        canary = Canary(series, [broken, newer_conflict], 1.0)
        assert not canary.ok
        with pytest.raises(PatchConflictError, match=f"validated base {validated}"):
            canary.raise_unless_ok()
    # A run without the validated base (--bases 9.9.9) only reports.
    assert Canary(series, [newer_conflict], 1.0).ok
