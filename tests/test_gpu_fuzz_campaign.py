"""The GPU fuzzer's shrink planning and its campaign over a pair runner given here (no GPU)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tooling.fuzzing.cases import read_case_file
from tooling.fuzzing.gpu import Campaign, GpuPlan
from tooling.fuzzing.gpu_case import (
    EngineFigures,
    GpuCase,
    GpuCaseFile,
    GpuReq,
    GpuSettings,
    draw_settings,
    draw_workload,
    read_gpu_case_file,
)
from tooling.fuzzing.gpu_pair import PairRun
from tooling.fuzzing.gpu_shrink import ShrinkPlan, settings_candidates, shrink

from .gpu_fuzz_parts import lp

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
