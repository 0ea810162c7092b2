"""Saved fuzz cases and campaign plans, without vLLM: a file that is not a case is refused
naming the file and the key (exit 26), and a campaign's case numbers do not depend on how
many jobs run them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tooling.errors import FuzzCaseError
from tooling.fuzzing.cases import FORMAT, MAX_BYTES, read_case_file
from tooling.fuzzing.scheduler import CampaignPlan
from tooling.paths import REPO_DIR

from .helpers import run_tooling

CASES = sorted((REPO_DIR / "tests" / "data" / "sched-fuzz").glob("*.json"))


def _case_file(tmp_path: Path, **changes) -> Path:
    data = json.loads(CASES[0].read_text())
    for key, value in changes.items():
        node = data
        *parents, last = key.split(".")
        for p in parents:
            node = node[int(p)] if p.isdigit() else node[p]
        node[last] = value
    path = tmp_path / "case.json"
    path.write_text(json.dumps(data))
    return path


def test_every_kept_case_reads(tmp_path):
    assert CASES
    for path in CASES:
        case = read_case_file(path)
        assert case.case["requests"] and case.detail and case.found_on


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"format": "x"}, "'format' is not"),
        ({"kind": "bogus"}, "'kind' must be one of"),
        ({"case.settings.k": "15"}, "'k' must be"),
        ({"case.settings.k": True}, "'k' must be"),
        ({"case.settings.prefix_caching": 1}, "'prefix_caching' must be"),
        ({"case.settings.kv_memory_factor": "big"}, "'kv_memory_factor' must be"),
        ({"case.settings.warp": 9}, "unknown key 'warp'"),
        ({"case.requests.0.prompt_len": 1.5}, "requests[0]: 'prompt_len' must be"),
        ({"case.requests": "x"}, "'requests' must be a list"),
        ({"case.seed": "0"}, "'seed' must be an integer"),
        ({"detail": 7}, "'detail' must be a string"),
    ],
)
def test_a_malformed_case_names_its_file_and_key(tmp_path, change, said):
    path = _case_file(tmp_path, **change)
    with pytest.raises(FuzzCaseError) as err:
        read_case_file(path)
    assert str(path) in str(err.value) and said in str(err.value)


def test_a_missing_key_and_foreign_files_are_refused(tmp_path):
    data = json.loads(CASES[0].read_text())
    del data["case"]["settings"]["k"]
    missing = tmp_path / "missing.json"
    missing.write_text(json.dumps(data))
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (MAX_BYTES + 1))
    for path, said in [
        (missing, "missing key 'k'"),
        (big, "larger than"),
        (tmp_path / "absent.json", "cannot read"),
        (Path("/dev/zero"), "larger than"),
    ]:
        with pytest.raises(FuzzCaseError, match=said):
            read_case_file(path)
    text = tmp_path / "text.json"
    text.write_text("not json")
    with pytest.raises(FuzzCaseError, match="not JSON"):
        read_case_file(text)
    assert FORMAT.startswith("dflash-schedfuzz-case/")


def test_replaying_a_file_that_is_not_a_case_is_one_line_exit_26(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    result = run_tooling(
        "fuzz",
        "scheduler",
        "--root",
        str(tmp_path),
        "--replay",
        str(bad),
        "--out",
        str(tmp_path / "out"),
        timeout=60,
    )
    assert result.returncode == 26
    assert result.stderr.strip().count("\n") == 0 and str(bad) in result.stderr
    assert not (tmp_path / "out").exists()  # refused before anything ran


@pytest.mark.parametrize("cases", [1, 7, 100, 1001])
def test_a_campaign_is_the_same_cases_whatever_its_jobs(cases):
    for jobs in (1, 2, 3, 8, 64):
        numbers = []
        for job in CampaignPlan(seed=5, cases=cases, jobs=jobs).job_files():
            assert job["seed"] == 5
            numbers += range(job["first"], job["first"] + job["cases"])
        assert numbers == list(range(cases))
