"""The smoke's report and what feeds it: the acceptance figure, the server's answers, the
config's choices, the table, JSON and plot, and --expect stock as a negative control."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tooling.errors import SmokeError
from tooling.paths import REPO_DIR
from tooling.smoke import checks
from tooling.smoke.checks import PrefixObservation
from tooling.smoke.client import Completion, parse_completion
from tooling.smoke.config import SmokeConfig, drafter_info_from_config
from tooling.smoke.metrics import SpecDecodeStats
from tooling.smoke.report import SmokeReport, StepRecord, format_table

from .smoke_checks_helpers import STOCK_WINDOWS, TINY_DRAFTER_CONFIG


def test_acceptance_is_informational_unless_gated() -> None:
    stats = SpecDecodeStats(6, 18, 7, [4.0, 2.0, 1.0])
    info = checks.check_acceptance(stats, None)
    assert info.status == checks.INFO
    assert "acceptance length 2.167" in info.evidence
    assert checks.check_acceptance(stats, 1.5).status == checks.PASS
    assert checks.check_acceptance(stats, 3.0).status == checks.FAIL
    assert checks.check_acceptance(None, None).status == checks.ERROR
    assert checks.check_acceptance(SpecDecodeStats(0, 0, 0, []), None).status == checks.ERROR


def test_completion_answer_parsing() -> None:
    answer = {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [
            {
                "index": 0,
                "text": " lazy",
                "finish_reason": "length",
                "token_ids": [11, 12],
                "prompt_token_ids": None,
            }
        ],
        "usage": {
            "prompt_tokens": 200,
            "completion_tokens": 2,
            "total_tokens": 202,
            "prompt_tokens_details": {"cached_tokens": 192},
        },
    }
    parsed = parse_completion(answer)
    assert parsed == Completion(" lazy", (11, 12), 200, 192, "length")
    no_details = {**answer, "usage": {"prompt_tokens": 3}}
    assert parse_completion(no_details).cached_tokens is None
    with pytest.raises(SmokeError, match="unexpected"):
        parse_completion({"error": "bad"})


def test_config_rejects_contradictory_model_choices(tmp_path: Path) -> None:
    with pytest.raises(SmokeError, match="--tiny"):
        SmokeConfig(workdir=tmp_path, tiny=True, target="t", drafter="d").validate()
    with pytest.raises(SmokeError, match="both --target and --drafter"):
        SmokeConfig(workdir=tmp_path, target="t").validate()
    SmokeConfig(workdir=tmp_path, tiny=True).validate()


def _report(tmp_path: Path, results: list[checks.CheckResult]) -> SmokeReport:
    return SmokeReport(
        checks=results,
        steps=[StepRecord("serve with DFlash", 61.2, True), StepRecord("reference", 9.0, False)],
        workdir=tmp_path,
        models={"target": "t", "drafter": "d", "tiny": True},
        engine={"num_speculative_tokens": 3},
        vllm={"version": "0.20.1", "location": "/opt/bundle/vllm"},
    )


def test_report_table_and_json(tmp_path: Path) -> None:
    results = [
        checks.CheckResult(checks.LOSSLESS, checks.PASS, "6/6 identical"),
        checks.check_aux_layers((1, 3, 5), (2, 4, 6), "serve.log"),
        checks.CheckResult(checks.ACCEPTANCE, checks.INFO, "acceptance length 1.000"),
    ]
    report = _report(tmp_path, results)
    assert not report.passed
    assert report.summary_line().startswith("smoke failed: 2 aux_layers (fail)")
    table = format_table(report)
    assert "vLLM 0.20.1 at /opt/bundle/vllm" in table
    assert " 2  fix 1: aux layers = target_layer_ids + 1" in table
    assert "FAIL" in table and "reference 9s FAILED" in table
    path = report.write_json()
    data = json.loads(path.read_text())
    assert data["passed"] is False
    assert [c["number"] for c in data["checks"]] == [1, 2, 6]
    assert data["checks"][1]["details"]["observed"] == [1, 3, 5]
    assert not list(tmp_path.glob(".*.part"))  # nothing half-written left


def test_report_passes_with_info_and_skips(tmp_path: Path) -> None:
    results = [
        checks.CheckResult(checks.LOSSLESS, checks.PASS, "ok"),
        checks.skipped(checks.FIDELITY, "skipped (--no-fidelity)"),
        checks.CheckResult(checks.ACCEPTANCE, checks.INFO, "length 1.0"),
    ]
    report = _report(tmp_path, results)
    assert report.passed
    assert "skipped 5" in report.summary_line()


def test_acceptance_plot_is_a_png(tmp_path: Path) -> None:
    out = tmp_path / "acceptance.png"
    code = (
        "import sys; from pathlib import Path; from tooling.smoke.report import plot_acceptance; "
        "print(plot_acceptance([0.31, 0.089, 0.015], Path(sys.argv[1]), 'DFlash'))"
    )
    # matplotlib is a dev dependency: the toolchain plots when it is installed.
    env = {**os.environ, "PYTHONPATH": str(REPO_DIR)}
    result = subprocess.run(
        [sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 2000


def _stock_like() -> list[checks.CheckResult]:
    expected = drafter_info_from_config(TINY_DRAFTER_CONFIG)
    plain = PrefixObservation(prompt_tokens=200, hits=192, queries=200, cached_tokens=192)
    stock = PrefixObservation(prompt_tokens=200, hits=176, queries=200, cached_tokens=176)
    return [
        checks.CheckResult(checks.LOSSLESS, checks.PASS, "6/6 identical"),
        checks.check_aux_layers((1, 3, 5), expected.expected_aux_layers(), "log"),
        checks.check_windows(STOCK_WINDOWS, expected.expected_windows()),
        checks.check_prefix_cache(stock, plain, block_size=16),
        checks.check_fidelity({"agreement": 0.492, "compared_tokens": 480}, 0.99),
        checks.CheckResult(checks.ACCEPTANCE, checks.INFO, "length 1.0"),
    ]


def test_expect_stock_is_a_negative_control(tmp_path: Path) -> None:
    stock = _report(tmp_path, _stock_like())
    assert not stock.passed  # as a fixed build it fails ...
    stock.expect = "stock"
    assert stock.passed  # ... and it is exactly what stock vLLM does
    line = stock.summary_line()
    assert line.startswith("smoke behaved as stock vLLM: failed 2 aux_layers, 3 drafter_windows,")
    assert "; output lossless" in line
    # A quick run on a hybrid target: lossless skipped, the K+1 first tokens wrong. The line
    # names those failures and claims nothing of the lossless check that did not run.
    quick = [c for c in _stock_like() if c.id != checks.LOSSLESS]
    quick.append(checks.CheckResult(checks.LOSSLESS, checks.SKIP, "not in --quick"))
    quick.append(checks.CheckResult(checks.FIRST_TOKENS, checks.FAIL, "3 of 4 prompts off"))
    hybrid = _report(tmp_path, quick)
    hybrid.models["target_info"] = {"hybrid": True}
    hybrid.expect = "stock"
    assert hybrid.passed
    assert "10 first_tokens" in hybrid.summary_line()
    assert "output lossless" not in hybrid.summary_line()
    fixed_like = _stock_like()
    fixed_like[1] = checks.check_aux_layers((2, 4, 6), (2, 4, 6), "log")
    mixed = _report(tmp_path, fixed_like)
    mixed.expect = "stock"
    assert not mixed.passed
    assert "2 aux_layers (pass)" in mixed.summary_line()
    with pytest.raises(SmokeError, match="--expect"):
        SmokeConfig(workdir=tmp_path, tiny=True, expect="patched").validate()
