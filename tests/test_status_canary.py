"""The canary's verdict: newer releases only report, the validated base must apply cleanly."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

from tooling.cli import main
from tooling.errors import PatchConflictError, ProbeError
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


def _status(tmp_path, monkeypatch, *args: str):
    """``patch status`` on an empty cache, offline, with no probe interpreter anywhere."""
    monkeypatch.setenv("TOOLING_PROBE_PYTHON", "")
    cache = ("--offline", "--cache-dir", str(tmp_path / "cache"))
    return CliRunner().invoke(main, ["--no-progress", *cache, "patch", "status", *args])


@pytest.mark.parametrize("json_flag", [(), ("--json",)])
def test_status_without_a_probe_interpreter_is_refused_before_any_release(
    tmp_path, monkeypatch, json_flag
):
    """Without the probes a patch upstream superseded reads as a conflict (0.22.0's offset
    and fp8 fixes): a verdict the canary could not reach is not given."""
    result = _status(tmp_path, monkeypatch, "--bases", "0.22.0", *json_flag)
    message = (
        "no probe interpreter: run `tooling probe-env`, set TOOLING_PROBE_PYTHON or pass "
        "--probe-python (or --no-probes)"
    )
    assert result.exit_code == ProbeError.exit_code, result.output
    assert result.stderr == f"error: {message}\n"
    if json_flag:
        assert json.loads(result.stdout)["error"] == message
    assert not (tmp_path / "cache" / "sources").exists()  # no release was looked at


def test_status_with_no_probes_says_it_did_not_probe(tmp_path, monkeypatch):
    result = _status(tmp_path, monkeypatch, "--bases", "0.22.0", "--no-probes")
    assert result.exit_code == 0, result.output
    assert "\nnot probed (--no-probes): text only;" in result.stdout
    result = _status(tmp_path, monkeypatch, "--bases", "0.22.0", "--no-probes", "--json")
    assert json.loads(result.stdout)["probed"] is False


def test_status_refuses_a_probe_interpreter_with_no_probes(tmp_path, monkeypatch):
    args = ("--probe-python", sys.executable, "status", "--no-probes")
    monkeypatch.setenv("TOOLING_PROBE_PYTHON", "")
    result = CliRunner().invoke(main, ["--cache-dir", str(tmp_path), "patch", *args])
    assert result.exit_code == 2
    assert "--probe-python and --no-probes contradict each other" in result.stderr
