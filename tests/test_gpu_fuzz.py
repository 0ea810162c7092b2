"""The GPU fuzzer's parts that need no GPU: its drawing, its oracles over hand-built records,
its shrink planning, its case files, its campaign over a pair runner given here, and the
command's refusals (a pair it cannot serve, no GPU, a replay file that is not a case)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tooling.errors import FuzzCaseError
from tooling.fuzzing.cases import read_case_file
from tooling.fuzzing.gpu import Campaign, GpuPlan
from tooling.fuzzing.gpu_case import (
    CUDAGRAPH_MODES,
    KS,
    EngineFigures,
    GpuCase,
    GpuCaseFile,
    GpuReq,
    GpuSettings,
    draw_settings,
    draw_workload,
    prompt_ids,
    read_gpu_case_file,
    step_bound,
    workload_number,
    write_gpu_case_file,
)
from tooling.fuzzing.gpu_oracles import (
    MARGIN,
    STALL_STEPS,
    Mode,
    RequestRun,
    WorkloadRun,
    acceptance,
    judge_workload,
)
from tooling.fuzzing.gpu_pair import PairRun, judge_pair
from tooling.fuzzing.gpu_shrink import ShrinkPlan, settings_candidates, shrink

from .helpers import run_tooling
from .smoke_models import write_model, write_seed_pair

# -- drawing ---------------------------------------------------------------------------------


def test_case_n_of_campaign_s_depends_on_s_and_n_alone():
    assert draw_settings(7, 3) == draw_settings(7, 3)
    assert len({draw_settings(7, n) for n in range(40)}) > 30
    assert [draw_settings(8, n) for n in range(10)] != [draw_settings(7, n) for n in range(10)]
    figures = EngineFigures(480, {"budget": 512})
    s = draw_settings(7, 3)
    assert draw_workload(7, 3, 2, figures, s) == draw_workload(7, 3, 2, figures, s)
    assert draw_workload(7, 3, 2, figures, s) != draw_workload(7, 3, 1, figures, s)


def test_settings_cover_what_users_set():
    drawn = [draw_settings(1, n) for n in range(400)]
    assert {s.k for s in drawn} == set(KS)
    assert {s.cudagraph_mode for s in drawn} == set(CUDAGRAPH_MODES)
    assert {s.kv_cache_dtype for s in drawn} == {"auto", "fp8"}
    assert {s.prefix_caching for s in drawn} >= {True, False}
    assert {s.async_scheduling for s in drawn} >= {True, False, None}
    assert None in {s.max_num_batched_tokens for s in drawn}
    assert min(s.max_num_batched_tokens or 1 << 20 for s in drawn) < 64
    assert max(s.max_num_seqs or 0 for s in drawn) >= 1024 and 1 in {s.max_num_seqs for s in drawn}
    assert {s.long_prefill_token_threshold for s in drawn} > {0}


def test_the_hold_is_drawn_last_and_only_for_a_vllm_that_takes_it():
    """Fix 33's ``join_hold_steps`` is drawn where the vLLM under test takes it, never for
    stock (which refuses the key), and last: every other setting of a seed is the one stock
    is served, as before the hold was drawn."""
    fixed = [draw_settings(s, n, hold=True) for s in range(3) for n in range(100)]
    stock = [draw_settings(s, n) for s in range(3) for n in range(100)]
    assert {x.join_hold_steps for x in fixed} == {0, 1, 4, 16}
    assert {x.join_hold_steps for x in stock} == {0}
    assert [replace(x, join_hold_steps=0) for x in fixed] == stock
    capped = [draw_settings(1, n, max_k=7, hold=True) for n in range(100)]
    assert [replace(x, join_hold_steps=0) for x in capped] == [
        draw_settings(1, n, max_k=7) for n in range(100)
    ]


def test_workloads_concentrate_on_the_boundary_lengths():
    """K, K+1, K+2, the engine's own block +- 1, the step budget +- 1 and +- (K + 1), and
    max_model_len less a little, all drawn; with prefixes, aborts, stops and logprobs."""
    k, block, budget, top = 3, 480, 700, 2048
    settings = GpuSettings(k=k, max_model_len=top)
    figures = EngineFigures(block, {"budget": budget})
    reqs = [r for w in range(300) for r in draw_workload(0, 0, w, figures, settings)]
    lengths = {r.prompt_len for r in reqs}
    wanted = {k, k + 1, k + 2, block - 1, block, block + 1, 2 * block - 1, 2 * block + 1}
    wanted |= {budget - 1, budget + 1, budget - k - 1, budget + k + 1, top - 1, top - k - 1}
    assert wanted <= lengths, sorted(wanted - lengths)
    assert any(r.prefix >= 0 and r.prefix_len > 0 for r in reqs)
    assert any(r.abort_at >= 0 for r in reqs) and any(r.stop for r in reqs)
    assert any(r.min_tokens == r.max_tokens > 1 for r in reqs)
    assert any(r.prompt_len + r.max_tokens == top for r in reqs)
    assert {r.logprobs for r in reqs} == {2, 5, 20}
    assert len({r.arrival for r in reqs}) > 10
    assert all(r.prompt_len + r.max_tokens <= top for r in reqs)


def test_prompts_stay_inside_the_vocabulary_and_prefixes_are_shared():
    a = GpuReq(arrival=0, prompt_len=300, max_tokens=1, prefix=1, prefix_len=200)
    b = replace(a, prompt_len=250)
    small = 32000
    ids_a, ids_b = prompt_ids(0, 0, a, small), prompt_ids(3, 5, b, small)
    assert all(100 <= t < small - 1000 for t in ids_a + ids_b)
    assert ids_a[:200] == ids_b[:200] and ids_a[200:250] != ids_b[200:]
    tiny = prompt_ids(0, 0, a, 400)  # the trainer's smallest pair
    assert all(50 <= t < 300 for t in tiny) and len(set(tiny)) > 20
    assert step_bound((a, b)) == 64 + 4 * (301 + 251)


def test_a_workload_draws_its_prompts_from_its_requests_not_its_place_in_the_run(tmp_path):
    """The number a workload's prompts come from is read off its requests: saved as a case,
    read back and served first in a replay, it is the one the campaign drew them with."""
    figures = EngineFigures(480, {"budget": 512})
    settings = CASE.settings
    drawn = [draw_workload(7, 0, w, figures, settings) for w in range(4)]
    numbers = [workload_number(w) for w in drawn]
    assert len(set(numbers)) == 4
    path = tmp_path / "finding.json"
    write_gpu_case_file(path, GpuCaseFile(GpuCase(settings, drawn[3]), "lossless", "", ""))
    replayed = read_gpu_case_file(path).case.requests
    assert workload_number(replayed) == numbers[3]
    prompts = [prompt_ids(numbers[3], i, r, 8192) for i, r in enumerate(drawn[3])]
    assert [prompt_ids(workload_number(replayed), i, r, 8192) for i, r in enumerate(replayed)] == (
        prompts
    )


# -- case files ------------------------------------------------------------------------------

CASE = GpuCase(
    GpuSettings(k=15, max_num_batched_tokens=512, prefix_caching=True, cudagraph_mode="eager"),
    (GpuReq(arrival=2, prompt_len=16, max_tokens=9, stop=True, logprobs=5),),
)


def test_a_case_file_reads_back_as_written(tmp_path):
    path = tmp_path / "finding.json"
    saved = GpuCaseFile(CASE, "lossless", "r0 position 3", "stock", ("r1 position 2",))
    write_gpu_case_file(path, saved)
    assert read_gpu_case_file(path) == saved
    assert not list(tmp_path.glob("*.tmp*"))


def test_a_case_without_the_hold_is_saved_as_before_it_was_drawn(tmp_path):
    """A hold of 0 is left out of the case file, as in every case saved before fix 33 (so
    they read back, and write back, the same); a hold that is set is kept, also on the
    case's scheduler side for the CPU fuzzer."""
    from tooling.fuzzing.gpu_case import scheduler_case_file

    assert "join_hold_steps" not in CASE.to_json()["settings"]
    assert GpuCase.from_json(json.loads(json.dumps(CASE.to_json()))) == CASE
    assert "join_hold_steps" not in scheduler_case_file(CASE, "").case["settings"]
    held = replace(CASE, settings=replace(CASE.settings, join_hold_steps=4))
    assert held.to_json()["settings"]["join_hold_steps"] == 4
    path = tmp_path / "held.json"
    write_gpu_case_file(path, GpuCaseFile(held, "lossless"))
    assert read_gpu_case_file(path).case == held
    assert scheduler_case_file(held, "").case["settings"]["join_hold_steps"] == 4
    for old in GPU_CASES:
        data = json.loads(old.read_text())
        assert read_gpu_case_file(old).case.to_json() == data["case"], old.name


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda d: "not json {", "not JSON"),
        (lambda d: {**d, "format": "dflash-schedfuzz-case/1"}, "'format'"),
        (lambda d: {**d, "kind": "nope"}, "'kind'"),
        (lambda d: {**d, "case": {**d["case"], "settings": {"k": "3"}}}, "'k'"),
        (lambda d: {**d, "case": {**d["case"], "settings": {"k": 2}}}, "'k' must be one of"),
        (
            lambda d: {**d, "case": {**d["case"], "settings": {"k": 3, "join_hold_steps": -1}}},
            "'join_hold_steps' must be 0 or more",
        ),
        (lambda d: {**d, "case": {**d["case"], "requests": []}}, "'requests'"),
        (
            lambda d: {**d, "case": {**d["case"], "requests": [{"arrival": 0}]}},
            "requests[0]: missing key",
        ),
    ],
)
def test_a_file_that_is_not_a_case_is_refused_naming_file_and_key(tmp_path, change, named):
    good = GpuCaseFile(CASE, "crash").to_json()
    bad = change(good)
    path = tmp_path / "bad.json"
    path.write_text(bad if isinstance(bad, str) else json.dumps(bad))
    with pytest.raises(FuzzCaseError) as caught:
        read_gpu_case_file(path)
    assert str(path) in str(caught.value) and named in str(caught.value)


# -- oracles ---------------------------------------------------------------------------------


def lp(first: float, second: float, tokens: tuple[int, int] = (1, 2)) -> dict[str, float]:
    return {str(tokens[0]): first, str(tokens[1]): second}


def run(results: dict[str, RequestRun], **more) -> WorkloadRun:
    steps = len(more.get("scheduled", [1, 1]))
    values = {
        "index": 0,
        "bound": 100,
        "results": results,
        "scheduled": [1] * steps,
        "produced": [1] * steps,
        "unfinished": [0] * steps,
    }
    return WorkloadRun(**{**values, **more})


def done(tokens: list[int], logprobs: list[dict[str, float]], **more) -> RequestRun:
    return RequestRun(tokens, logprobs, "length", added=0, finished=3, **more)


def test_equal_greedy_outputs_pass():
    out = {"r0": done([5, 6], [lp(-0.1, -3, (5, 9)), lp(-0.2, -2, (6, 9))])}
    assert judge_workload(run(out), run(out), Mode()) == []


def test_a_difference_at_a_near_tie_is_excused_and_listed():
    plain = {"r0": done([5, 6, 7], [lp(-0.1, -3, (5, 9)), lp(-0.69, -0.69 - MARGIN, (6, 8))] * 2)}
    dflash = {"r0": done([5, 8, 1], plain["r0"].logprobs)}
    (verdict,) = judge_workload(run(dflash), run(plain), Mode())
    assert verdict.kind == "pass" and len(verdict.excused) == 1
    assert "r0 position 1" in verdict.excused[0]


def test_a_real_difference_is_lossless_finding():
    plain = {
        "r0": done([5, 6], [lp(-0.1, -3, (5, 9)), lp(-0.1, -0.2, (6, 8))]),
        "r1": done([5, 6, 7], [lp(-0.6, -0.6 - MARGIN / 2, (5, 9))] * 3),
    }
    dflash = {"r0": done([5, 8], plain["r0"].logprobs), "r1": done([9, 6, 7], plain["r1"].logprobs)}
    (verdict,) = judge_workload(run(dflash), run(plain), Mode())
    assert verdict.kind == "lossless" and "r0 position 1" in verdict.detail
    assert len(verdict.excused) == 1 and "r1 position 0" in verdict.excused[0]


def test_the_same_tokens_ending_otherwise_is_a_finding_unless_aborted():
    plain = {"r0": done([5, 6, 7], [lp(-0.1, -3, (5, 9))] * 3)}
    short = {"r0": RequestRun([5, 6], plain["r0"].logprobs[:2], "stop", finished=2)}
    (verdict,) = judge_workload(run(short), run(plain), Mode())
    assert verdict.kind == "lossless" and "ends after 2" in verdict.detail
    aborted = {"r0": RequestRun([5, 6], plain["r0"].logprobs[:2], "abort", aborted=True)}
    assert judge_workload(run(aborted), run(plain), Mode()) == []


def test_noise_mode_compares_logprobs_within_the_noise():
    plain = {"r0": done([5, 6], [lp(-0.1, -3, (5, 9)), lp(-1.0, -1.5, (6, 8))])}
    near = {"r0": done([5, 6], [lp(-0.12, -3, (5, 9)), lp(-1.03, -1.5, (6, 8))])}
    far = {"r0": done([5, 6], [lp(-0.1, -3, (5, 9)), lp(-1.3, -1.5, (6, 8))])}
    mode = Mode(kind="noise", noise=0.05)
    assert judge_workload(run(near), run(plain), mode) == []
    (verdict,) = judge_workload(run(far), run(plain), mode)
    assert verdict.kind == "logprobs" and "position 1" in verdict.detail
    # Within twice the noise of a tie, a swapped token is excused.
    swapped = {"r0": done([5, 8], near["r0"].logprobs)}
    tie = {"r0": done([5, 6], [lp(-0.1, -3, (5, 9)), lp(-1.0, -1.08, (6, 8))])}
    (verdict,) = judge_workload(run(swapped), run(tie), mode)
    assert verdict.kind == "pass" and verdict.excused


def test_a_stall_is_found_after_its_steps_and_not_before():
    out = {"r0": RequestRun([5], [lp(-0.1, -3)], None, finished=None)}
    idle = STALL_STEPS - 1
    almost = run(
        out, scheduled=[4] + [0] * idle, produced=[1] + [0] * idle, unfinished=[1] * STALL_STEPS
    )
    kinds = [v.kind for v in judge_workload(almost, almost, Mode()) if v.engine == "dflash"]
    assert kinds == ["livelock"]
    stuck = run(
        out, scheduled=[4] + [0] * STALL_STEPS, produced=[1] + [0] * STALL_STEPS, unfinished=[1] * 9
    )
    kinds = [v.kind for v in judge_workload(stuck, almost, Mode()) if v.engine == "dflash"]
    assert kinds == ["stall", "livelock"]


def test_a_request_past_its_step_bound_is_livelock():
    slow = {"r0": RequestRun([5], [lp(-0.1, -3)], "length", added=2, finished=103)}
    verdicts = judge_workload(run(slow), run(slow), Mode())
    assert {v.kind for v in verdicts} == {"livelock"} and "took 101 steps" in verdicts[0].detail


def test_a_crash_is_a_finding_and_stops_the_comparison():
    out = {"r0": done([5], [lp(-0.1, -3)])}
    dead = run({"r0": RequestRun([9], [lp(-0.1, -3)])}, error="RuntimeError: illegal memory access")
    verdicts = judge_workload(dead, run(out), Mode())
    assert [(v.kind, v.engine) for v in verdicts] == [("crash", "dflash")]
    assert "illegal memory access" in verdicts[0].detail


def test_a_slot_outside_the_requests_blocks_is_a_finding():
    out = {"r0": done([5], [lp(-0.1, -3)])}
    audited = run(out, slot_audit={"slots": 40, "outside": 1, "misplaced": 0, "examples": []})
    assert [v.kind for v in judge_workload(audited, run(out), Mode())] == ["slot"]
    clean = run(out, slot_audit={"slots": 40, "outside": 0, "misplaced": 0})
    assert judge_workload(clean, run(out), Mode()) == []


def test_acceptance_collapses_only_against_a_reference():
    runs = [run({}, spec={"drafts": 100, "accepted": 50})]
    assert acceptance(runs, Mode()) == []
    assert acceptance(runs, Mode(reference_acceptance=2.5)) == []
    (verdict,) = acceptance(runs, Mode(reference_acceptance=4.0))
    assert verdict.kind == "acceptance" and "1.500" in verdict.detail


def test_an_engine_pair_judged_hang_crash_and_refusal():
    hung = [vars(r) for r in CASE.requests]
    stopped = PairRun(
        {
            "dflash": {"workloads": [], "current": 2, "current_requests": hung},
            "plain": {"workloads": [], "current": None},
        },
        10.0,
        {"dflash": True, "plain": False},
    )
    judged = judge_pair(stopped, Mode())
    assert [(v.kind, v.workload) for v in judged.verdicts] == [("hang", 2)]
    assert judged.requests_of == {2: hung} and judged.served == 0
    ended = replace(stopped, stopped={"dflash": False, "plain": False})
    assert [v.kind for v in judge_pair(ended, Mode()).verdicts] == ["crash"]
    refused = PairRun({"dflash": {"refused": "ValueError: no"}, "plain": {}}, 1.0)
    judged = judge_pair(refused, Mode())
    assert judged.refused == "ValueError: no" and judged.verdicts == []


# -- shrinking -------------------------------------------------------------------------------

BIG = GpuCase(
    GpuSettings(
        k=15,
        max_num_batched_tokens=512,
        max_num_seqs=8,
        prefix_caching=True,
        async_scheduling=True,
        long_prefill_token_threshold=100,
        kv_cache_dtype="fp8",
        cudagraph_mode="PIECEWISE",
    ),
    (
        *(
            GpuReq(arrival=i, prompt_len=40 + i, max_tokens=30, stop=True, logprobs=20)
            for i in range(6)
        ),
        GpuReq(arrival=3, prompt_len=16, max_tokens=64, prefix=0, prefix_len=8, min_tokens=5),
    ),
)


def long_prompt(reqs: tuple[GpuReq, ...]) -> bool:
    return any(r.prompt_len >= 16 for r in reqs)


def fails(case: GpuCase) -> bool:
    """The failure the tests shrink: a 16-token prompt (or longer) under async scheduling."""
    return case.settings.async_scheduling is True and long_prompt(case.requests)


def test_the_shrink_finds_the_smallest_case_that_still_fails():
    asked: list[list[GpuCase]] = []

    def runner(batch: list[GpuCase]) -> list[bool | None]:
        asked.append(batch)
        assert len({c.settings for c in batch}) == 1, "one engine pair serves a batch"
        return [fails(c) for c in batch]

    plan = shrink(BIG, runner, seconds=60)
    best = plan.best
    assert fails(best) and len(best.requests) == 1
    (req,) = best.requests
    assert (req.prompt_len, req.arrival, req.stop, req.logprobs, req.prefix) == (
        16,
        0,
        False,
        2,
        -1,
    )
    assert req.max_tokens == 1 and req.min_tokens == 0
    assert best.settings == GpuSettings(k=1, async_scheduling=True)


def test_workloads_share_an_engine_pair_and_settings_take_one_each():
    asked: list[list[GpuCase]] = []

    def runner(batch: list[GpuCase]) -> list[bool | None]:
        asked.append(batch)
        return [False] * len(batch)

    plan = shrink(BIG, runner, seconds=60)
    assert plan.best == BIG and plan.steps == 0
    workload = [b for b in asked if b[0].settings == BIG.settings]
    settings = [b for b in asked if b[0].settings != BIG.settings]
    assert [len(b) for b in workload[:-1]] == [16] * (len(workload) - 1)
    assert all(len(b) == 1 for b in settings)
    assert [b[0] for b in settings] == settings_candidates(BIG)


def test_the_shrink_asks_again_what_a_dead_engine_did_not_serve():
    plan = ShrinkPlan(BIG, batch_size=4)
    first = plan.next_batch()
    plan.tell([False, None, None, None])
    assert plan.asked == 1 and plan.next_batch() == [*first[1:], plan.pending[3]]


def test_the_shrink_stops_at_its_time():
    ticks = iter(range(1000))
    plan = shrink(BIG, lambda batch: [False] * len(batch), seconds=3, clock=lambda: next(ticks))
    assert plan.best == BIG and plan.asked == 2 * 16


def test_settings_go_back_toward_the_defaults_one_at_a_time():
    candidates = settings_candidates(BIG)
    changed = [
        {k for k in vars(c.settings) if getattr(c.settings, k) != getattr(BIG.settings, k)}
        for c in candidates
    ]
    assert all(len(c) == 1 for c in changed)
    assert {next(iter(c)) for c in changed} >= {"async_scheduling", "cudagraph_mode", "k"}
    assert candidates[-1].settings.k == 7


def test_the_shrink_tries_the_hold_unset_first():
    """A finding served with fix 33's hold is first tried without it (off unless set: a
    finding that stays is one every user can meet); one without a hold has no such step."""
    held = replace(BIG, settings=replace(BIG.settings, join_hold_steps=16))
    first, *rest = settings_candidates(held)
    assert first.settings == BIG.settings
    assert all(c.settings.join_hold_steps == 16 for c in rest)
    assert all(c.settings.join_hold_steps == 0 for c in settings_candidates(BIG))
    assert len(settings_candidates(held)) == len(settings_candidates(BIG)) + 1


# -- the campaign over a pair runner given here -------------------------------------------


class PairOnPaper:
    """Stands in for the GPU: DFlash's output differs from plain's, well clear of a tie,
    in a workload with a prompt of 16 tokens or more."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.calls: list[tuple[GpuSettings, int]] = []
        self.stop_after = stop_after

    def __call__(self, settings, number, workloads, replay, work, limit_s):
        if self.stop_after is not None and len(self.calls) >= self.stop_after:
            raise KeyboardInterrupt
        self.calls.append((settings, number))
        figures = EngineFigures(480, {"budget": 512})
        served = replay or [
            draw_workload(0, number, w, figures, settings) for w in range(workloads)
        ]
        runs: dict[str, dict] = {"dflash": {"workloads": []}, "plain": {"workloads": []}}
        for index, reqs in enumerate(served):
            bad = long_prompt(tuple(reqs))
            for role in runs:
                first = 9 if bad and role == "dflash" else 5
                results = {
                    f"r{i}": {"tokens": [first], "logprobs": [lp(-0.1, -3, (5, 9))], "finished": 1}
                    for i in range(len(reqs))
                }
                runs[role]["workloads"].append(
                    {
                        "index": index,
                        "requests": [vars(r) for r in reqs],
                        "bound": 1000,
                        "results": results,
                        "scheduled": [1],
                        "produced": [1],
                        "unfinished": [0],
                    }
                )
        return PairRun(runs, 30.0, {"dflash": False, "plain": False})


def test_a_campaign_saves_each_finding_shrunk_and_reports(tmp_path):
    runner = PairOnPaper()
    plan = GpuPlan(seed=0, settings=2, workloads=3, shrink_seconds=60)
    report = Campaign(plan, tmp_path, "paper", runner).run()
    assert report.pairs == 2 and report.workloads == 6
    assert report.requests == sum(
        len(draw_workload(0, n, w, EngineFigures(480, {"budget": 512}), draw_settings(0, n)))
        for n in range(2)
        for w in range(3)
    )
    assert report.findings and {f.kind for f in report.findings} == {"lossless"}
    shrunk = [f for f in report.findings if f.shrunk]
    assert len(shrunk) == 2  # two a kind are shrunk; the rest kept as found
    for f in shrunk:
        saved = read_gpu_case_file(f.file)
        assert saved.kind == "lossless" and saved.found_on == "paper"
        assert len(saved.case.requests) == 1 and saved.case.requests[0].prompt_len == 16
        # Its scheduler side, for `tooling fuzz scheduler --replay`.
        cpu = read_case_file(f.file.with_suffix(".scheduler.json"))
        assert cpu.kind == "pass" and cpu.case["requests"][0]["prompt_len"] == 16
        assert cpu.case["settings"]["k"] == saved.case.settings.k
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["findings_by_oracle"] == {"lossless": len(report.findings)}
    assert summary["requests_per_gpu_minute"] > 0 and not summary["ok"]
    # Two pairs of 30 s each for the rate; the shrinks' pairs apart.
    assert summary["gpu_minutes"] == 1.0 and summary["shrink_gpu_minutes"] > 0
    assert "| lossless |" in (tmp_path / "summary.md").read_text()


def test_settings_their_config_refuses_take_no_pair_and_are_reported(tmp_path):
    """The vetter answers for several times as many draws as the plan serves; the campaign
    serves the first ones it passes, in draw order, and reports the others refused (the
    vetter's answer here is a rule on K; on the GPU host it is vLLM's config)."""
    asked: list[list[GpuSettings]] = []

    def vetter(drawn):
        asked.append(drawn)
        return [f"K = {s.k} refused" if s.k >= 7 else None for s in drawn]

    runner = PairOnPaper()
    plan = GpuPlan(seed=3, settings=3, workloads=1, shrink=False)
    report = Campaign(plan, tmp_path, "paper", runner, vetter).run()
    (drawn,) = asked
    assert drawn == [draw_settings(3, n) for n in range(12)]
    passed = [n for n, why in enumerate(vetter(drawn)) if why is None][:3]
    assert [number for _, number in runner.calls] == passed
    refused_before = [n for n in range(passed[-1]) if n not in passed]
    assert report.vetted == len(refused_before) == len(report.refused) > 0
    assert report.pairs == 3
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["refused_before_start"] == report.vetted
    assert (
        f"{report.vetted} more settings refused by their config"
        in (tmp_path / "summary.md").read_text()
    )


@pytest.mark.parametrize("answer", [None, "every draw refused"])
def test_without_a_useful_answer_from_the_vetter_every_draw_is_served(tmp_path, answer):
    """No answer (the child failed), or every draw refused alike (as a model the config
    cannot inspect refuses them all): the pairs start as drawn and show what it is."""
    runner = PairOnPaper()
    plan = GpuPlan(seed=3, settings=2, workloads=1, shrink=False)

    def vetter(drawn):
        return None if answer is None else [answer] * len(drawn)

    report = Campaign(plan, tmp_path, "paper", runner, vetter).run()
    assert [number for _, number in runner.calls] == [0, 1] and report.vetted == 0


def test_a_vetting_child_that_cannot_import_vllm_leaves_the_draws_as_drawn(tmp_path, pair):
    """The real child, run by an interpreter without vLLM: it fails, says so in its log,
    and the campaign is told to serve every draw (None), not that all were refused."""
    from tooling.fuzzing.gpu_pair import GpuTarget, vet_settings

    target = GpuTarget(Path(sys.executable), pair)
    answer = vet_settings(target, [draw_settings(0, 0)], tmp_path / "vet", 1 << 30)
    assert answer is None
    assert json.loads((tmp_path / "vet" / "vet.out.json").read_text())["ok"] is False


def test_a_campaign_stopped_by_a_signal_keeps_its_findings(tmp_path):
    plan = GpuPlan(seed=0, settings=5, workloads=3, shrink=False)
    with pytest.raises(KeyboardInterrupt):
        Campaign(plan, tmp_path, "paper", PairOnPaper(stop_after=1)).run()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stopped"] and summary["pairs"] == 1
    files = [Path(f["file"]) for f in summary["findings"]]
    assert files and all(read_gpu_case_file(p).kind == "lossless" for p in files)


def test_a_replayed_case_reports_its_outcome(tmp_path):
    case = GpuCase(GpuSettings(k=3, async_scheduling=True), (GpuReq(0, 16, 1),))
    plan = GpuPlan(
        replay=(
            GpuCaseFile(case, "lossless"),
            GpuCaseFile(replace(case, requests=(GpuReq(0, 4, 1),)), "pass"),
        )
    )
    report = Campaign(plan, tmp_path, "paper", PairOnPaper()).run()
    assert [r["outcome"] for r in report.replayed] == ["lossless", "pass"]
    assert [r["expected"] for r in report.replayed] == ["lossless", "pass"]


@pytest.mark.parametrize("join_hold", [True, False])
def test_a_campaign_draws_the_hold_only_on_a_vllm_that_takes_it(tmp_path, join_hold):
    """The fixed wheel's campaign serves and vets pairs with holds; stock's, of the same
    seed, the same pairs with none: its DFlash engine is never given the key."""
    vetted: list[GpuSettings] = []

    def vetter(drawn):
        vetted.extend(drawn)
        return [None] * len(drawn)

    runner = PairOnPaper()
    plan = GpuPlan(seed=5, settings=30, workloads=1, shrink=False, join_hold=join_hold)
    Campaign(plan, tmp_path, "paper", runner, vetter).run()
    served = [settings for settings, _ in runner.calls]
    if join_hold:
        assert {s.join_hold_steps for s in served} > {0}
    else:
        assert {s.join_hold_steps for s in served + vetted} == {0}
    assert [replace(s, join_hold_steps=0) for s in served] == [
        draw_settings(5, n) for n in range(30)
    ]


# -- the command's refusals ------------------------------------------------------------------


@pytest.fixture
def pair(tmp_path: Path) -> Path:
    folder = tmp_path / "pair"
    write_seed_pair(folder / "target", folder / "drafter", 10**9)
    return folder


def refusal(*args: str) -> tuple[int, str]:
    done = run_tooling("fuzz", "gpu", *args, timeout=300)
    return done.returncode, done.stderr.strip()


def test_a_pair_it_cannot_serve_is_one_line_and_its_code(tmp_path, pair):
    code, err = refusal("--pair", str(tmp_path / "missing"), "--python", sys.executable)
    assert code == 29 and err.count("\n") == 0 and "no target/ folder" in err
    broken = tmp_path / "broken"
    write_model(broken / "target", json.loads((pair / "target" / "config.json").read_text()), 10**6)
    write_model(broken / "drafter", {"architectures": ["DFlashDraftModel"]}, 10**6)
    code, err = refusal("--pair", str(broken), "--python", sys.executable)
    assert code == 29 and err.count("\n") == 0 and "drafter" in err


def test_no_gpu_is_one_line_and_its_code(pair):
    """This interpreter has no torch at all: it sees no GPU."""
    code, err = refusal("--pair", str(pair), "--python", sys.executable)
    assert code == 30 and err.count("\n") == 0
    assert sys.executable in err and "no GPU" in err


@pytest.mark.slow
def test_the_probe_interpreter_sees_no_gpu(pair, probe_python):
    """torch without CUDA: ``torch.cuda.is_available()`` is false there. Without --python
    the command asks the probe interpreter, as ``tooling fuzz scheduler`` finds it."""
    done = run_tooling(
        "fuzz", "gpu", "--pair", str(pair), env={"TOOLING_PROBE_PYTHON": str(probe_python)}
    )
    assert done.returncode == 30, done.stderr
    assert "torch.cuda.is_available() is false" in done.stderr
    assert str(probe_python) in done.stderr and done.stderr.strip().count("\n") == 0


def test_a_replay_file_that_is_not_a_case_is_one_line_and_its_code(tmp_path, pair):
    bad = tmp_path / "case.json"
    bad.write_text(json.dumps({"format": "dflash-gpufuzz-case/1", "kind": "lossless"}))
    code, err = refusal("--pair", str(pair), "--python", sys.executable, "--replay", str(bad))
    assert code == 26 and err.count("\n") == 0 and str(bad) in err


def test_noise_mode_needs_its_noise(pair):
    code, err = refusal("--pair", str(pair), "--python", sys.executable, "--mode", "noise")
    assert code == 2 and "--noise" in err


# -- what the campaign hands the engine driver ----------------------------------------------


def test_the_driver_reads_the_request_the_campaign_writes_and_asks_for_the_engine():
    from tooling.fuzzing.serving.gpu_run import GpuRunRequest, _engine_request

    data = {
        "role": "dflash",
        "target": "/pair/target",
        "drafter": "/pair/drafter",
        "settings": vars(CASE.settings),
        "kv_cache_memory_bytes": 1 << 30,
        "figures_file": "/w/figures.json",
        "progress": "/w/dflash.progress.json",
        "replay": [[vars(r) for r in CASE.requests]],
    }
    request = GpuRunRequest.from_json(json.loads(json.dumps(data)))
    assert request.settings == CASE.settings and request.replay == [list(CASE.requests)]
    engine = _engine_request(request)
    assert engine.enforce_eager and engine.cudagraph_mode is None
    assert engine.num_speculative_tokens == 15 and engine.max_num_seqs is None
    assert engine.engine_args["enable_prefix_caching"] is True
    assert engine.engine_args["max_logprobs"] >= max(r.logprobs for r in CASE.requests)
    plain = _engine_request(replace(request, drafter=None, role="plain"))
    assert plain.drafter is None and plain.num_speculative_tokens == 0
    graphs = replace(request, settings=replace(CASE.settings, cudagraph_mode="FULL_DECODE_ONLY"))
    assert _engine_request(graphs).cudagraph_mode == "FULL_DECODE_ONLY"
    assert engine.speculative_args == {}  # unset: stock vLLM refuses the key, even as 0


def test_only_the_dflash_engine_is_given_the_hold():
    """A pair's settings go to both engines; the hold is the DFlash engine's speculative
    config's, so the plain engine serves as without it."""
    from tooling.fuzzing.serving.gpu_run import GpuRunRequest, _engine_request

    held = replace(CASE.settings, join_hold_steps=4)
    request = GpuRunRequest("dflash", "/t", "/d", held, 1 << 30, "/f", "/p")
    assert _engine_request(request).speculative_args == {"join_hold_steps": 4}
    plain = _engine_request(replace(request, drafter=None, role="plain"))
    assert plain.speculative_args == {} and plain.drafter is None


# -- the GPU host's step ---------------------------------------------------------------------


def test_the_host_step_refuses_before_it_starts_anything(tmp_path):
    from .helpers import run_gpu_script

    work, out = tmp_path / "work", tmp_path / "out"
    env = {k: "" for k in ("NOISE", "TIME_LIMIT", "FUZZ_ARGS")}
    done = run_gpu_script("gpu-fuzz.sh", "patched", "seed", work=work, out=out, **env)
    assert done.returncode == 2 and "gpu-fuzz.sh: NOISE is not set" in done.stderr
    done = run_gpu_script("gpu-fuzz.sh", "patched", "trained", work=work, out=out, **env)
    assert done.returncode == 28 and "no patched engine" in done.stderr
    (work / "engines" / "patched").mkdir(parents=True)
    done = run_gpu_script("gpu-fuzz.sh", "patched", "trained", work=work, out=out, **env)
    assert done.returncode == 28 and "no trained pair" in done.stderr
    assert not (out / "fuzz-patched-trained").exists()


# -- an engine pair's processes ---------------------------------------------------------------

#: Stands in for the vLLM interpreter (``python -m gpu_run IN OUT``): the DFlash engine hangs
#: in its first workload, the plain engine serves nothing and ends.
ENGINE_ON_PAPER = """#!{python}
import json, os, sys, time
request = json.load(open(sys.argv[3]))
progress = {{"role": request["role"], "workloads": [], "cache": os.environ["VLLM_CACHE_ROOT"],
            "multiprocessing": os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]}}
if request["role"] == "dflash":
    progress.update(current=0, current_requests=request["replay"][0])
    json.dump(progress, open(request["progress"], "w"))
    time.sleep(600)
json.dump({{"ok": True, **progress}}, open(sys.argv[4], "w"))
"""


def test_an_engine_pair_stopped_in_a_workload_is_a_hang_with_its_requests(tmp_path):
    from tooling.fuzzing.gpu_pair import GpuTarget, run_pair

    python = tmp_path / "python"
    python.write_text(ENGINE_ON_PAPER.format(python=sys.executable))
    python.chmod(0o755)
    target = GpuTarget(python=python, pair=tmp_path / "pair", cache_root=tmp_path / "cache")
    pair = run_pair(
        target,
        CASE.settings,
        tmp_path / "work",
        3.0,
        kv_cache_memory_bytes=1 << 30,
        replay=[CASE.requests],
    )
    assert pair.stopped == {"dflash": True, "plain": False} and pair.seconds < 60
    caches = {pair.runs[role]["cache"] for role in ("dflash", "plain")}
    assert caches == {str(tmp_path / "cache" / "dflash"), str(tmp_path / "cache" / "plain")}
    assert pair.runs["plain"]["multiprocessing"] == "0"
    judged = judge_pair(pair, Mode())
    assert [(v.kind, v.engine, v.workload) for v in judged.verdicts] == [("hang", "dflash", 0)]
    assert [GpuReq(**r) for r in judged.requests_of[0]] == list(CASE.requests)


def test_a_request_refused_by_one_engine_only_is_a_finding():
    out = {"r0": done([5], [lp(-0.1, -3)])}
    refused = {"r0": RequestRun([], refused="ValueError: the prompt is too long")}
    assert judge_workload(run(refused), run(refused), Mode()) == []
    (verdict,) = judge_workload(run(refused), run(out), Mode())
    assert verdict.kind == "lossless" and "refused by one engine only" in verdict.detail


@pytest.mark.slow
def test_a_findings_scheduler_side_replays_on_the_cpu(probe_python, upstream_0201, tmp_path):
    """The file saved beside a GPU finding is a case ``tooling fuzz scheduler --replay``
    serves: the same settings and requests through vLLM's real scheduler."""
    from tooling.fuzzing.cases import write_case_file
    from tooling.fuzzing.gpu_case import scheduler_case_file

    case = GpuCase(
        GpuSettings(k=3, max_model_len=512, prefix_caching=True),
        (GpuReq(0, 16, 8, logprobs=5), GpuReq(2, 4, 30, stop=True)),
    )
    path = tmp_path / "finding-lossless-0-0.scheduler.json"
    write_case_file(path, scheduler_case_file(case, "the scheduler side"))
    done = run_tooling(
        "fuzz",
        "scheduler",
        "--root",
        str(upstream_0201.source_dir),
        "--replay",
        str(path),
        "--out",
        str(tmp_path / "out"),
        "--json",
        env={"TOOLING_PROBE_PYTHON": str(probe_python)},
    )
    assert done.returncode == 0, done.stderr
    (replayed,) = json.loads(done.stdout)["replayed"]
    assert replayed["outcome"] == "pass" and replayed["steps"] > 8


def test_k_stays_within_the_drafters_block(pair):
    from tooling.fuzzing.gpu_pair import check_pair

    shape = check_pair(pair)
    assert shape.max_k == 15 and shape.vocab_size == 248320
    capped = [draw_settings(1, n, max_k=7) for n in range(100)]
    assert {s.k for s in capped} == {1, 3, 7}
    full = [draw_settings(1, n) for n in range(100)]
    assert [replace(s, k=0) for s in capped] == [replace(s, k=0) for s in full]


def test_a_pair_whose_dflash_engine_did_not_start_stops_its_plain_engine_at_once(tmp_path):
    """Real processes: the DFlash engine writes that it failed and ends; the plain engine,
    still starting, is stopped then (it has nothing to serve), not left to the deadline, and
    neither reads as a hang. A pair that serves on is waited for, and one past the deadline
    is stopped and marked."""
    import time

    from tooling.fuzzing.gpu_pair import wait_pair
    from tooling.procs import start_group, stop_group

    figures = tmp_path / "figures.json"
    failed = f"import json; json.dump({{'failed': 'refused'}}, open({str(figures)!r}, 'w'))"

    def started(code: str, name: str):
        return start_group([sys.executable, "-c", code], log=tmp_path / f"{name}.log", env={})

    procs = {
        "dflash": started(failed, "dflash"),
        "plain": started("import time; time.sleep(60)", "p"),
    }
    began = time.monotonic()
    try:
        assert wait_pair(procs, figures, began + 50) == {"dflash": False, "plain": False}
        assert time.monotonic() - began < 30
    finally:
        for proc in procs.values():
            stop_group(proc, grace_s=1.0)
    figures.unlink()
    procs = {"dflash": started("import time; time.sleep(60)", "d2"), "plain": started("pass", "p2")}
    try:
        assert wait_pair(procs, figures, time.monotonic() + 2) == {"dflash": True, "plain": False}
    finally:
        for proc in procs.values():
            stop_group(proc, grace_s=1.0)


# -- a workload cut at its pair's time -------------------------------------------------------

#: Run in the probe interpreter with a vLLM tree on its path: the campaign's driver over an
#: engine that serves on (a token a request each step, none ever finished), its workload cut
#: once its time has passed. vLLM's engine is not what is tested here: the driver is. The
#: driver's clock is the engine's step count, so where it cuts does not hang on speed.
DRIVER_PAST_ITS_TIME = """
import json, sys
from types import SimpleNamespace
import tooling.fuzzing.serving.gpu_run as gpu_run
from tooling.fuzzing.gpu_case import GpuReq, GpuSettings
from tooling.fuzzing.serving.gpu_run import Driver, GpuRunRequest
from tooling.smoke.serving.distribution import RunningCounter

clock = [0.0]
gpu_run.time = SimpleNamespace(monotonic=lambda: clock[0])

class ServesOn:
    def __init__(self):
        self.live, self.aborted, self.steps = {}, [], 0
    def add_request(self, rid, prompt, params):
        self.live[rid] = []
    def abort_request(self, rids):
        self.aborted += [r for r in rids if r in self.live]
        for r in rids:
            self.live.pop(r, None)
    def has_unfinished_requests(self):
        return bool(self.live)
    def get_num_unfinished_requests(self):
        return len(self.live)
    def step(self):
        self.steps += 1
        clock[0] += 1.0
        outs = []
        for rid, tokens in self.live.items():
            tokens.append(7)
            done = SimpleNamespace(token_ids=list(tokens), logprobs=None, finish_reason=None)
            outs.append(SimpleNamespace(request_id=rid, outputs=[done], finished=False))
        return outs

engine = ServesOn()
request = GpuRunRequest("plain", "/t", None, GpuSettings(k=3), 1, "/f", "/p", vocab_size=64)
driver = Driver(request, engine, RunningCounter())
reqs = [GpuReq(0, 8, max_tokens=10**6), GpuReq(arrival=10**6, prompt_len=4, max_tokens=2)]
record = driver.run(0, reqs, float(sys.argv[1]))
print(json.dumps({"record": record, "aborted": engine.aborted, "steps": engine.steps}))
"""


def on_stock(probe_python: Path, upstream: Any, script: str, *args: str) -> Any:
    """``script`` run by the probe interpreter with stock ``upstream`` on its path: the JSON
    its last line prints."""
    return on_tree(probe_python, Path(upstream.source_dir), script, *args)


def on_tree(probe_python: Path, tree: Path, script: str, *args: str) -> Any:
    """``script`` run by the probe interpreter with the vLLM tree ``tree`` on its path: the
    JSON its last line prints."""
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": f"{tree}:{Path.cwd()}"}
    done = subprocess.run(
        [str(probe_python), "-c", script, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
def test_the_interpreter_check_tells_the_fixed_vllm_from_stock(
    probe_python, upstream_0201, patched_0201
):
    """The question the campaign asks its interpreter before drawing, on the real trees:
    patched 0.20.1 takes ``join_hold_steps`` (the hold is drawn), stock does not."""
    from tooling.fuzzing.gpu_pair import CHECK

    stock = on_tree(probe_python, Path(upstream_0201.source_dir), CHECK)
    fixed = on_tree(probe_python, Path(patched_0201.work_dir), CHECK)
    assert stock["vllm"] and fixed["vllm"]
    assert (stock["join_hold"], fixed["join_hold"]) == (False, True)


@pytest.mark.slow
def test_a_workload_past_its_time_is_cut_by_the_driver_not_left_to_hang(
    probe_python, upstream_0201
):
    """A pair's engine still stepping when its time runs out (an eager engine decoding
    thousands of tokens beside the training) ends the workload itself, with every request
    aborted and the step it ended at: the campaign then finds the process gone, no hang."""
    answer = on_stock(probe_python, upstream_0201, DRIVER_PAST_ITS_TIME, "5.5")
    record = answer["record"]
    assert record["error"] is None and record["cut"] == 6 == answer["steps"]
    assert answer["aborted"] == ["w0r0"]
    assert len(record["scheduled"]) == record["cut"] < record["bound"]
    assert "finished" not in record["results"]["r0"] and "r1" not in record["results"]


def test_a_cut_workload_is_no_hang_and_compares_what_both_engines_finished():
    """The record of a cut workload: an unfinished request is no livelock, a request both
    engines finished is still compared, and the pair counts the workload as cut."""
    same = done([5, 6], [lp(-0.1, -3.0), lp(-0.1, -3.0, (6, 2))])
    other = done([5, 9], [lp(-0.1, -3.0), lp(-0.1, -3.0, (9, 2))])
    left = RequestRun([5], [lp(-0.1, -3.0)], added=0, finished=None)
    d = run({"r0": same, "r1": left}, cut=40)
    p = run({"r0": same, "r1": replace(left, tokens=[5, 6], finished=3)})
    assert [v.kind for v in judge_workload(d, p, Mode())] == []
    assert "livelock" in [v.kind for v in judge_workload(replace(d, cut=None), p, Mode())]
    d_other = run({"r0": other, "r1": left}, cut=40)
    assert [v.kind for v in judge_workload(d_other, p, Mode())] == ["lossless"]
    as_json = {"index": 0, "bound": 64, "results": {}, "cut": 40, "requests": []}
    pair = PairRun(
        {
            "dflash": {"workloads": [as_json], "current": None},
            "plain": {"workloads": [{**as_json, "cut": None}], "current": None},
        },
        10.0,
        {"dflash": False, "plain": False},
    )
    judged = judge_pair(pair, Mode())
    assert judged.verdicts == [] and judged.cut == 1 and judged.served == 1


GPU_CASES = sorted((Path(__file__).parent / "data" / "gpu-fuzz").glob("*.json"))


@pytest.mark.parametrize("path", GPU_CASES, ids=lambda p: p.stem)
def test_every_saved_gpu_finding_is_a_case_whose_scheduler_side_is_kept(path):
    """A GPU finding is kept as a case ``tooling fuzz gpu --replay`` serves again, and the
    part of it the CPU reproduces, its scheduler side, is kept among the scheduler fuzzer's
    regression cases (which test_sched_fuzz replays on stock and on the fixed tree)."""
    from tooling.fuzzing.gpu_case import scheduler_case_file

    saved = read_gpu_case_file(path)
    assert saved.kind != "pass"
    side = json.loads(json.dumps(scheduler_case_file(saved.case, "").case))
    kept = [
        read_case_file(p)
        for p in sorted((Path(__file__).parent / "data" / "sched-fuzz").glob("*.json"))
    ]
    assert any(k.case == side and k.kind != "pass" for k in kept), path.name


VET_ON_THE_CPU = """
import json, sys
from dataclasses import asdict
from pathlib import Path
from tooling.probes import _harness
_harness.install_cpu_platform()
from tooling.fuzzing.gpu_case import GpuSettings
from tooling.fuzzing.serving import gpu_vet

pair = _harness.hybrid_pair(Path(sys.argv[1]))
settings = [
    GpuSettings(k=3, max_num_batched_tokens=8, max_num_seqs=8, max_model_len=1024),
    GpuSettings(k=3, max_num_batched_tokens=2048, max_num_seqs=8, max_model_len=1024),
]
request = {
    "target": str(pair.target),
    "drafter": str(pair.drafter),
    "settings": [asdict(s) for s in settings],
    "kv_cache_memory_bytes": 1 << 30,
    "vocab_size": 512,
}
print(json.dumps(gpu_vet.vet(request)))
"""


@pytest.mark.slow
def test_the_vetting_child_answers_with_vllms_own_config(probe_python, upstream_0201, tmp_path):
    """The real vetting child on vLLM's real config (stock 0.20.1, a hybrid target and a
    DFlash drafter, on the CPU platform the probes give vLLM): a step budget the drafts
    leave no token in is refused with vLLM's own line, a setting that fits passes, and
    the child returns with no engine started."""
    refused = on_stock(probe_python, upstream_0201, VET_ON_THE_CPU, str(tmp_path / "pair"))[
        "refused"
    ]
    assert refused[1] is None
    assert refused[0] is not None and "max_num_scheduled_tokens" in refused[0]
