"""The canary's verdict: newer releases only report, the validated base must apply cleanly."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

from tooling.cli import main
from tooling.errors import CacheMissError, PatchConflictError, ProbeError
from tooling.patching.outcome import SeriesReport
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
    broken = Canary(
        series, [BaseStatus(validated, _report(validated, ok=False)), newer_conflict], 1
    )
    assert not broken.ok
    with pytest.raises(PatchConflictError, match=f"validated base {validated}"):
        broken.raise_unless_ok()
    # A run without the validated base (--bases 9.9.9) only reports.
    assert Canary(series, [newer_conflict], 1.0).ok


def test_a_release_that_reached_no_status_is_no_pass() -> None:
    """A conflict on a newer release is an answer; a release that could not be fetched or
    patched is none, on the validated base or any other, and the canary says so with that
    error's own exit code."""
    series = load_series(REPO_DIR / "patches" / "series.toml")
    validated = series.validated_base
    good = BaseStatus(validated, _report(validated, ok=True))
    for where in (validated, "9.9.9"):
        missing = BaseStatus(where, None, error="--offline: not in the cache", exit_code=9)
        canary = Canary(series, [missing] if where == validated else [good, missing], 1.0)
        assert not canary.ok and canary.to_json()["ok"] is False
        with pytest.raises(CacheMissError) as e:
            canary.raise_unless_ok()
        total = len(canary.results)
        assert str(e.value) == (
            f"1 of {total} releases reached no status; {where}: --offline: not in the cache"
        )


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
    # The empty cache has no 0.22.0: the release reached no status, which is no pass (it
    # was exit 0), and the table still says what was not done.
    result = _status(tmp_path, monkeypatch, "--bases", "0.22.0", "--no-probes")
    assert result.exit_code == CacheMissError.exit_code, result.output
    assert "\nnot probed (--no-probes): text only;" in result.stdout
    last = result.stderr.splitlines()[-1]
    assert last.startswith("error: 1 of 1 releases reached no status; 0.22.0: --offline")
    result = _status(tmp_path, monkeypatch, "--bases", "0.22.0", "--no-probes", "--json")
    document = json.loads(result.stdout)
    assert document["probed"] is False and document["ok"] is False


def test_status_refuses_a_probe_interpreter_with_no_probes(tmp_path, monkeypatch):
    args = ("--probe-python", sys.executable, "status", "--no-probes")
    monkeypatch.setenv("TOOLING_PROBE_PYTHON", "")
    result = CliRunner().invoke(main, ["--cache-dir", str(tmp_path), "patch", *args])
    assert result.exit_code == 2
    assert "--probe-python and --no-probes contradict each other" in result.stderr
