"""The lossless oracle's evidence: each token difference carried from the oracle to the saved
finding and read back."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tooling.errors import FuzzCaseError
from tooling.fuzzing.gpu import Campaign, GpuPlan
from tooling.fuzzing.gpu_case import (
    EngineFigures,
    GpuCase,
    GpuCaseFile,
    GpuReq,
    GpuSettings,
    draw_workload,
    prompt_ids,
    read_gpu_case_file,
    workload_number,
    write_gpu_case_file,
)
from tooling.fuzzing.gpu_oracles import (
    MARGIN,
    Evidence,
    Mode,
    RequestRun,
    WorkloadRun,
    judge_workload,
)
from tooling.fuzzing.gpu_pair import PairRun, judge_pair
from tooling.paths import REPO_DIR

#: A saved finding of the first GPU campaign on the trained pair, from before findings kept
#: their evidence.
OLD_FINDING = (
    REPO_DIR / "docs" / "notebook" / "2026-12-05-first-chunk-state" / "finding-lossless-1-1.json"
)
VOCAB = 2048


def lp(*pairs: tuple[int, float]) -> dict[str, float]:
    return {str(token): logprob for token, logprob in pairs}


def served(tokens: list[int], logprobs: list[dict[str, float]], prompt: list[int]) -> RequestRun:
    return RequestRun(tokens, logprobs, "length", added=0, finished=3, prompt=prompt)


def workload(results: dict[str, RequestRun]) -> WorkloadRun:
    return WorkloadRun(0, 100, results, [1, 1], [1, 1], [0, 0])


# -- the evidence, from the oracle to the file ------------------------------------------------


def test_each_token_difference_keeps_its_evidence_flagged_or_excused():
    plain_lp = [lp((5, -0.1), (9, -3.0)), lp((6, -0.1), (8, -0.9)), lp((7, -0.2), (1, -2.0))]
    tie = [lp((5, -0.6), (9, -0.6 - MARGIN / 2)), lp((6, -0.1), (8, -2.0))]
    plain = {
        "r0": served([5, 6, 7], plain_lp, [11, 12, 13]),
        "r1": served([5, 6], tie, [21, 22]),
        "r2": served([4, 4], [lp((4, -0.1), (3, -4.0))] * 2, [31]),
    }
    dflash = {
        "r0": served([5, 8, 1], plain_lp, [11, 12, 13]),
        "r1": served([9, 6], tie, [21, 22]),
        "r2": served([4, 4], plain["r2"].logprobs, [31]),
    }
    (verdict,) = judge_workload(workload(dflash), workload(plain), Mode())
    # The oracle's lines are as they were; the evidence comes beside them.
    assert verdict.kind == "lossless"
    assert verdict.detail == "r0 position 1: dflash 8, plain 6, plain's top-2 margin 0.800000"
    assert verdict.excused == (
        f"r1 position 0: dflash 9, plain 5, plain's top-2 margin {MARGIN / 2:.6f}",
    )
    flagged, excused = verdict.evidence
    assert flagged == Evidence("r0", (11, 12, 13), (5,), 8, 6, ((6, -0.1), (8, -0.9)), False)
    assert flagged.position == 1 and flagged.plain_margin == pytest.approx(0.8)
    assert excused == Evidence("r1", (21, 22), (), 9, 5, ((5, -0.6), (9, -0.6 - MARGIN / 2)), True)


def test_no_evidence_without_the_prompt_or_in_noise_mode():
    logprobs = [lp((5, -0.1), (9, -3.0))]
    plain = {"r0": served([5], logprobs, [])}
    dflash = {"r0": served([9], logprobs, [])}
    (verdict,) = judge_workload(workload(dflash), workload(plain), Mode())
    assert verdict.kind == "lossless" and verdict.evidence == ()
    plain["r0"].prompt = dflash["r0"].prompt = [3]
    (verdict,) = judge_workload(workload(dflash), workload(plain), Mode("noise", noise=0.05))
    assert verdict.evidence == ()


def _record(reqs: tuple[GpuReq, ...], first: int, index: int = 0) -> dict[str, Any]:
    """One engine's record of a workload as ``serving.gpu_run`` writes it: every request
    gives ``first``, then 6."""
    results = {
        f"r{i}": {
            "tokens": [first, 6],
            "logprobs": [lp((5, -0.1), (9, -3.0)), lp((6, -0.1), (8, -2.0))],
            "finished": 1,
        }
        for i in range(len(reqs))
    }
    return {
        "index": index,
        "requests": [vars(r) for r in reqs],
        "bound": 1000,
        "results": results,
        "scheduled": [1],
        "produced": [1],
        "unfinished": [0],
    }


def test_the_pair_recomputes_each_prompt_as_the_engines_drew_it():
    reqs = (GpuReq(0, 9, 2), GpuReq(1, 3, 2, prefix=0, prefix_len=2))
    runs = {
        "dflash": {"workloads": [_record(reqs, 9)]},
        "plain": {"workloads": [_record(reqs, 5)]},
    }
    (verdict,) = judge_pair(PairRun(runs, 1.0, {}, VOCAB), Mode()).verdicts
    number = workload_number(reqs)
    assert [e.prompt for e in verdict.evidence] == [
        tuple(prompt_ids(number, i, r, VOCAB)) for i, r in enumerate(reqs)
    ]
    # Without the vocabulary nothing is guessed.
    (verdict,) = judge_pair(PairRun(runs, 1.0, {}), Mode()).verdicts
    assert verdict.evidence == ()


class FirstTokenDiffers:
    """A pair runner standing in for the GPU: in every workload DFlash's first token is 9
    where plain's is 5, well clear of a tie, in every request."""

    def __call__(self, settings, number, workloads, replay, work, limit_s) -> PairRun:
        figures = EngineFigures(480, {"budget": 512})
        served_ = replay or [
            draw_workload(0, number, w, figures, settings) for w in range(workloads)
        ]
        runs: dict[str, dict] = {"dflash": {"workloads": []}, "plain": {"workloads": []}}
        for index, reqs in enumerate(served_):
            for role, first in (("dflash", 9), ("plain", 5)):
                runs[role]["workloads"].append(_record(tuple(reqs), first, index))
        return PairRun(runs, 10.0, {"dflash": False, "plain": False}, VOCAB)


@pytest.mark.parametrize("shrink", [False, True])
def test_a_saved_finding_holds_the_evidence_of_the_case_it_saves(tmp_path, shrink):
    """Found, or shrunk: every request's difference, its prompt the one the case's own
    requests give (a shrunk case's, not the workload it was found in)."""
    plan = GpuPlan(seed=0, settings=1, workloads=1, shrink=shrink, shrink_seconds=60)
    report = Campaign(plan, tmp_path, "paper", FirstTokenDiffers()).run()
    (finding,) = report.findings
    assert finding.shrunk is shrink
    saved = read_gpu_case_file(finding.file)
    reqs = saved.case.requests
    assert len(saved.evidence) == len(reqs) and (len(reqs) == 1 or not shrink)
    number = workload_number(reqs)
    for i, (req, e) in enumerate(zip(reqs, saved.evidence, strict=True)):
        assert e.request == f"r{i}" and e.prompt == tuple(prompt_ids(number, i, req, VOCAB))
        assert (e.agreed, e.dflash, e.plain, e.excused) == ((), 9, 5, False)
        assert e.plain_top == ((5, -0.1), (9, -3.0))


def test_a_case_file_with_evidence_reads_back_as_written(tmp_path):
    case = GpuCase(GpuSettings(k=3), (GpuReq(0, 4, 2),))
    evidence = Evidence("r0", (300, 301), (7,), 9, 8, ((8, -0.25), (9, -0.5), (2, -3.0)), True)
    saved = GpuCaseFile(case, "lossless", "r0 position 1", "paper", (), (evidence,))
    write_gpu_case_file(tmp_path / "f.json", saved)
    assert read_gpu_case_file(tmp_path / "f.json") == saved


def test_an_old_finding_without_evidence_still_reads():
    saved = read_gpu_case_file(OLD_FINDING)
    assert saved.kind == "lossless" and saved.evidence == ()
    assert "evidence" not in json.loads(OLD_FINDING.read_text())


GOOD_ENTRY = {
    "request": "r0",
    "prompt": [300, 301],
    "agreed": [],
    "dflash": 9,
    "plain": 8,
    "plain_top": {"8": -0.25, "9": -0.5},
    "excused": False,
}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"prompt": []}, "'prompt'"),
        ({"agreed": [1, -2]}, "'agreed'"),
        ({"dflash": "9"}, "'dflash'"),
        ({"dflash": 8}, "the same token"),
        ({"plain_top": {"x": -0.1}}, "'plain_top'"),
        ({"excused": 0}, "'excused'"),
        ({"extra": 1}, "an entry holds"),
    ],
)
def test_an_evidence_entry_of_the_wrong_shape_is_refused_naming_it(tmp_path, change, named):
    data = GpuCaseFile(GpuCase(GpuSettings(k=3), (GpuReq(0, 4, 2),)), "lossless").to_json()
    data["evidence"] = [GOOD_ENTRY, {**GOOD_ENTRY, **change}]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(FuzzCaseError) as caught:
        read_gpu_case_file(path)
    assert f"{path}: evidence[1]" in str(caught.value) and named in str(caught.value)
