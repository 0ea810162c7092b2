"""The scheduler fuzzer on vLLM 0.20.1's real Scheduler, run as a user runs it (``tooling fuzz
scheduler``): a bounded seeded campaign fails stock and passes the patched tree, and every
regression case under tests/data/sched-fuzz fails stock with the oracle it was kept for and
passes the patched tree (slow: the probe interpreter and both trees)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tooling.fuzzing.cases import read_case_file
from tooling.patching.apply import ApplyOptions, apply_series
from tooling.patching.outcome import APPLIED
from tooling.patching.series import load_series
from tooling.paths import REPO_DIR

from .helpers import PATCHES, run_tooling

pytestmark = pytest.mark.slow

CASES = sorted((REPO_DIR / "tests" / "data" / "sched-fuzz").glob("*.json"))
#: Workloads served with a speculation budget (patch 17's num_speculative_tokens_per_batch_size):
#: kept as controls, each passing every oracle on the patched tree.
BUDGET_CASES = sorted((REPO_DIR / "tests" / "data" / "spec-budget").glob("*.json"))
#: One campaign for both trees: stock fails within its first 30 cases (a stall among them,
#: the hang the outside look found); the patched tree passes 150.
SEED = 3
STOCK_CASES = 30
PATCHED_CASES = 150


def fuzz(probe_python: Path, tree: Path, out: Path, *args: str) -> tuple[int, dict, str]:
    """``tooling fuzz scheduler --json`` on ``tree``: exit status, its JSON, its stderr."""
    result = run_tooling(
        "fuzz",
        "scheduler",
        "--root",
        str(tree),
        "--out",
        str(out),
        "--jobs",
        "1",
        "--json",
        *args,
        env={"TOOLING_PROBE_PYTHON": str(probe_python)},
    )
    return result.returncode, json.loads(result.stdout), result.stderr


def test_the_regression_cases_are_cases_of_every_oracle_kept() -> None:
    kinds = {read_case_file(p).kind for p in CASES}
    assert {"stall", "starve", "slot", "late-refusal", "mamba-state", "stale-drafts"} <= kinds


def test_stock_fails_each_regression_case_with_its_oracle(probe_python, upstream_0201, tmp_path):
    args = [a for p in CASES for a in ("--replay", str(p))]
    code, data, err = fuzz(probe_python, upstream_0201.source_dir, tmp_path, *args)
    assert code == 25, err
    got = [r["outcome"] for r in data["replayed"]]
    assert got == [read_case_file(p).kind for p in CASES], data["replayed"]
    # Each finding is saved again as a case a later run replays.
    saved = sorted(tmp_path.glob("finding-*.json"))
    assert len(saved) == len(CASES)
    assert all(read_case_file(p).found_on == str(upstream_0201.source_dir) for p in saved)


def test_patched_serves_every_regression_case(probe_python, patched_0201, tmp_path):
    args = [a for p in CASES for a in ("--replay", str(p))]
    code, data, err = fuzz(probe_python, Path(patched_0201.work_dir), tmp_path, *args)
    assert code == 0, err
    assert [r["outcome"] for r in data["replayed"]] == ["pass"] * len(CASES)


def test_a_speculation_budget_serves_its_workloads_and_stock_refuses_it(
    probe_python, patched_0201, upstream_0201, tmp_path
):
    assert {read_case_file(p).kind for p in BUDGET_CASES} == {"pass"}
    args = [a for p in BUDGET_CASES for a in ("--replay", str(p))]
    code, data, err = fuzz(probe_python, Path(patched_0201.work_dir), tmp_path / "p", *args)
    assert code == 0, err
    assert [r["outcome"] for r in data["replayed"]] == ["pass"] * len(BUDGET_CASES)
    # 0.20.1 has no such option: the setting is refused while its config is built.
    code, data, err = fuzz(probe_python, upstream_0201.source_dir, tmp_path / "s", *args)
    assert [r["outcome"] for r in data["replayed"]] == ["refused"] * len(BUDGET_CASES), err


def test_a_budget_that_verifies_no_drafts_is_served_on_the_hybrid_target(
    probe_python, patched_0201, tmp_path
):
    """Patches 23 and 24: the seed's hybrid target serves a budget that verifies no drafts
    (K = 0) above a number of requests, every oracle passing (patch 24 starts each such step
    from the Gated DeltaNet state the step before accepted, where patch 23 once refused it)."""
    case = json.loads(BUDGET_CASES[0].read_text())
    ranges = case["case"]["settings"]["spec_tokens_by_batch"]
    case["case"]["settings"]["spec_tokens_by_batch"] = [
        [*r[:2], 0] if r[2] < 15 else r for r in ranges
    ]
    assert any(r[2] == 0 for r in case["case"]["settings"]["spec_tokens_by_batch"])
    path = tmp_path / "none-above.json"
    path.write_text(json.dumps(case))
    code, data, err = fuzz(
        probe_python, Path(patched_0201.work_dir), tmp_path / "p", "--replay", str(path)
    )
    assert code == 0, err
    assert [r["outcome"] for r in data["replayed"]] == ["pass"], data["replayed"]


def test_a_seeded_campaign_fails_stock_with_the_hang(probe_python, upstream_0201, tmp_path):
    code, data, err = fuzz(
        probe_python,
        upstream_0201.source_dir,
        tmp_path,
        "--seed",
        str(SEED),
        "--cases",
        str(STOCK_CASES),
        "--no-shrink",
    )
    assert code == 25, err
    assert data["cases"] == STOCK_CASES
    assert data["outcomes"].get("stall", 0) >= 1, data["outcomes"]
    assert "failing case(s)" in err and str(tmp_path) in err


def test_the_same_campaign_passes_the_patched_tree(probe_python, patched_0201, tmp_path):
    code, data, err = fuzz(
        probe_python,
        Path(patched_0201.work_dir),
        tmp_path,
        "--seed",
        str(SEED),
        "--cases",
        str(PATCHED_CASES),
    )
    assert code == 0, err
    assert data["cases"] == PATCHED_CASES and data["ok"], data
    # Every case either ran to its end or was refused while the config was built.
    assert set(data["outcomes"]) <= {"pass", "refused"}
    assert data["outcomes"]["pass"] > PATCHED_CASES // 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["cases"] == PATCHED_CASES


#: Findings of the fuzzer on stock 0.34.0 (issue 48), kept for the ports: each fails there and
#: passes the patched 0.20.1 tree and 0.34.0 with its ports.
CASES_0340 = sorted((REPO_DIR / "tests" / "data" / "sched-fuzz-0.34.0").glob("*.json"))


def test_0340_findings_fail_stock_0340_and_pass_the_patched_0201_and_ported_0340_trees(
    probe_python, catalog, fetch_release, patched_0201, tmp_path
):
    upstream = fetch_release(catalog.get("0.34.0"), with_wheel=False)
    args = [a for p in CASES_0340 for a in ("--replay", str(p))]
    code, data, err = fuzz(probe_python, upstream.source_dir, tmp_path / "stock", *args)
    assert code == 25, err
    assert [r["outcome"] for r in data["replayed"]] == ["starve"] * len(CASES_0340)
    code, data, err = fuzz(probe_python, Path(patched_0201.work_dir), tmp_path / "patched", *args)
    assert code == 0, err
    assert [r["outcome"] for r in data["replayed"]] == ["pass"] * len(CASES_0340)
    # The ledger's code for 0.34.0 (its ports; the fixes it does not decide there conflict).
    ported = apply_series(
        upstream, load_series(PATCHES / "series.toml"), tmp_path / "vllm-0.34.0",
        ApplyOptions(probe_python=None, log_dir=tmp_path / "logs", keep_going=True),
    )  # fmt: skip
    assert ported.outcome("mamba-chunk-liveness").status == APPLIED
    assert ported.outcome("mamba-chunk-liveness").patch_file.startswith("0.34.0/")
    code, data, err = fuzz(probe_python, tmp_path / "vllm-0.34.0", tmp_path / "ported", *args)
    assert code == 0, err
    assert [r["outcome"] for r in data["replayed"]] == ["pass"] * len(CASES_0340)
