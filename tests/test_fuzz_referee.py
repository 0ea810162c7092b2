"""The lossless oracle's evidence and its float32 referee (``tooling fuzz referee``): the
evidence of each token difference carried from the oracle to the saved finding and read
back, the pure ruling, the command's refusals, and (slow) the referee end to end on a tiny
random-weight hybrid target in float32 on the CPU."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tooling.errors import (
    FuzzCaseError,
    FuzzFindingError,
    FuzzNoEvidenceError,
    RefereeError,
    RefereeInterpreterError,
)
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
from tooling.fuzzing.referee import NOISE, Ruling, rule
from tooling.paths import REPO_DIR

from .helpers import HANG_GUARD_S, bytecode_env, run_tooling

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


# -- the ruling -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("margin", "noise", "ruling"),
    [
        (0.2917, NOISE, Ruling.DEFECT),  # float32 gives plain's token, well clear
        (0.001, NOISE, Ruling.ROUNDING),  # a tie in float32 too
        (-0.5, NOISE, Ruling.ROUNDING),  # float32 gives DFlash's token
        (NOISE, NOISE, Ruling.ROUNDING),  # within the noise, at its edge
        (NOISE * 1.01, NOISE, Ruling.DEFECT),
        (0.05, 0.1, Ruling.ROUNDING),
        (0.0, 0.0, Ruling.ROUNDING),
        (1e-6, 0.0, Ruling.DEFECT),
    ],
)
def test_a_defect_is_float32_preferring_plains_token_by_more_than_the_noise(margin, noise, ruling):
    assert rule(margin, noise) is ruling


def test_the_default_noise_is_plains_own_and_nan_is_no_margin():
    assert NOISE == 2.0**-5
    assert rule(0.0312) is Ruling.ROUNDING and rule(0.0313) is Ruling.DEFECT
    with pytest.raises(ValueError, match="not a number"):
        rule(float("nan"))


# -- the command's refusals -------------------------------------------------------------------


def referee_cli(*args: str, timeout: float = HANG_GUARD_S) -> tuple[int, str, str]:
    done = run_tooling("fuzz", "referee", *args, timeout=timeout)
    return done.returncode, done.stdout, done.stderr.strip()


@pytest.fixture
def finding(tmp_path: Path) -> Path:
    """A finding with one difference, and a target folder that is only a config."""
    case = GpuCase(GpuSettings(k=3), (GpuReq(0, 4, 2),))
    evidence = Evidence("r0", (300, 301, 302, 303), (), 9, 8, ((8, -0.25), (9, -0.5)))
    path = tmp_path / "finding-lossless-0-0.json"
    write_gpu_case_file(path, GpuCaseFile(case, "lossless", "r0 position 0", "", (), (evidence,)))
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    return path


def test_a_file_that_is_not_a_case_is_one_line_and_its_code(tmp_path, finding):
    target = str(tmp_path / "target")
    bad = tmp_path / "case.json"
    bad.write_text(json.dumps({"format": "dflash-gpufuzz-case/1", "kind": "lossless"}))
    for path in (bad, tmp_path / "missing.json"):
        code, out, err = referee_cli(str(finding), str(path), "--target", target)
        assert code == FuzzCaseError.exit_code == 26 and out == ""
        assert err.count("\n") == 0 and str(path) in err


def test_a_case_with_no_evidence_is_one_line_and_its_code(tmp_path, finding):
    code, _, err = referee_cli(str(OLD_FINDING), "--target", str(tmp_path / "target"))
    assert code == FuzzNoEvidenceError.exit_code == 31
    assert err.count("\n") == 0 and str(OLD_FINDING) in err and "no evidence" in err


def test_an_interpreter_without_torch_is_one_line_and_its_code(tmp_path, finding):
    """This interpreter (the default) has no torch at all."""
    code, out, err = referee_cli(str(finding), "--target", str(tmp_path / "target"))
    assert code == RefereeInterpreterError.exit_code == 32 and out == ""
    assert err.count("\n") == 0 and "cannot import torch" in err and "Traceback" not in err


def test_a_target_that_is_no_model_folder_is_one_line_and_its_code(tmp_path, finding):
    code, _, err = referee_cli(str(finding), "--target", str(tmp_path))
    assert code == RefereeError.exit_code == 33
    assert err.count("\n") == 0 and "no config.json" in err


# -- end to end, on a tiny target in float32 ---------------------------------------------------

#: The tiny target's own float32 choice after a context, computed here apart from the
#: referee: its greedy token and its least likely one.
CHOICE = """
import json, sys, torch, transformers
model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
    sys.argv[1], dtype=torch.float32).eval()
with torch.inference_mode():
    logits = model(torch.tensor([json.loads(sys.argv[2])]), use_cache=False).logits[0, -1]
print(json.dumps({"best": int(logits.argmax()), "worst": int(logits.argmin()),
                  "vocab": int(logits.numel())}))
"""


def _probe(probe_python: Path, *args: str) -> str:
    env = {**bytecode_env(), "PYTHONPATH": str(REPO_DIR), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [str(probe_python), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        cwd=REPO_DIR,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_the_referee_settles_differences_by_the_targets_float32_choice(tmp_path, probe_python):
    """A tiny random-weight Qwen3.5-style hybrid target (Gated DeltaNet and gated attention,
    saved in bf16 as the smoke's are): plain taking float32's greedy token where DFlash took
    its least likely one is a defect; the two swapped is rounding."""
    target = tmp_path / "target"
    _probe(
        probe_python,
        "-c",
        "import sys; from pathlib import Path; "
        "from tooling.smoke.serving.tiny import TinySpec, write_hybrid_target; "
        "write_hybrid_target(Path(sys.argv[1]), TinySpec.for_arch('hybrid', 0))",
        str(target),
    )
    prompt, agreed = [300, 301, 302, 303], [304, 305]
    choice = json.loads(
        _probe(probe_python, "-c", CHOICE, str(target), json.dumps(prompt + agreed))
    )
    assert choice["vocab"] >= VOCAB
    case = GpuCase(GpuSettings(k=3), (GpuReq(0, len(prompt), 4),))

    def saved(name: str, plain: int, dflash: int) -> Path:
        top = ((plain, -0.5), (dflash, -0.75))
        evidence = Evidence("r0", tuple(prompt), tuple(agreed), dflash, plain, top)
        path = tmp_path / name
        write_gpu_case_file(path, GpuCaseFile(case, "lossless", "", "", (), (evidence,)))
        return path

    defect = saved("defect.json", choice["best"], choice["worst"])
    rounding = saved("rounding.json", choice["worst"], choice["best"])
    python = ("--target", str(target), "--python", str(probe_python))

    code, out, err = referee_cli(str(rounding), *python)
    assert code == 0, err
    (line, summary) = out.strip().splitlines()
    assert line.startswith("rounding.json r0 position 2:") and line.endswith(": rounding")
    assert "plain's bf16 top-2 margin 0.250000" in line
    assert summary.startswith("0 defect(s), 1 rounding, of 1 difference(s) in 1 finding(s)")

    done = run_tooling("fuzz", "referee", "--json", str(rounding), str(defect), *python)
    assert done.returncode == FuzzFindingError.exit_code == 25, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "1 of 2 difference(s) a defect" in done.stderr
    report = json.loads(done.stdout)
    assert not report["ok"] and report["defects"] == 1 and report["noise"] == NOISE
    first, second = report["differences"]
    assert (first["ruling"], second["ruling"]) == ("rounding", "defect")
    assert first["float32_margin"] == pytest.approx(-second["float32_margin"])
    assert second["float32_margin"] > NOISE and second["float32_best"] == choice["best"]

    outside = saved("outside.json", choice["vocab"] + 5, choice["best"])
    code, _, err = referee_cli(str(outside), *python)
    assert code == RefereeError.exit_code and err.count("\n") == 0
    assert "outside the target's vocabulary" in err
