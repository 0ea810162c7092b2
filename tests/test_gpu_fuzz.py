"""The GPU fuzzer's parts that need no GPU, first: its drawing, its case files and its oracles
over hand-built records (its shrink and campaign: ``test_gpu_fuzz_campaign.py``; the command
and its engines: ``test_gpu_fuzz_command.py``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tooling.errors import FuzzCaseError
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
    acceptance,
    judge_workload,
)
from tooling.fuzzing.gpu_pair import PairRun, judge_pair

from .gpu_fuzz_parts import CASE, GPU_CASES, done, lp, run

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


def test_the_drafters_full_graphs_are_turned_off_after_the_hold_for_a_vllm_that_takes_them():
    """Fix 22's ``dflash_full_cudagraphs`` (on by default in the fixed wheel) is drawn false
    in about half the pairs of a vLLM that takes it, left unset otherwise and on any other
    vLLM, and after the hold: every other setting of a seed is the one a vLLM without it is
    served; an unset one is saved as before it was drawn, a false one is saved as false,
    and the shrink tries it unset first, beside the hold."""
    from tooling.fuzzing.gpu_shrink import settings_candidates

    both = [draw_settings(s, n, hold=True, graphs=True) for s in range(3) for n in range(100)]
    held = [draw_settings(s, n, hold=True) for s in range(3) for n in range(100)]
    assert {x.drafter_full_graphs for x in both} == {None, False}
    assert 100 < sum(x.drafter_full_graphs is False for x in both) < 200
    assert all(x.drafter_full_graphs is None for x in held)
    assert [replace(x, drafter_full_graphs=None) for x in both] == held
    assert "drafter_full_graphs" not in CASE.to_json()["settings"]
    off = replace(CASE, settings=replace(CASE.settings, drafter_full_graphs=False))
    assert off.to_json()["settings"]["drafter_full_graphs"] is False
    assert GpuCase.from_json(json.loads(json.dumps(off.to_json()))) == off
    assert settings_candidates(off)[0] == CASE


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


@pytest.mark.slow
def test_the_interpreter_check_finds_the_fixed_wheels_options_and_not_stocks(
    probe_python, patched_0201, upstream_0201
):
    """What the campaign asks the interpreter before it draws (``gpu_pair.CHECK``), run by a
    real interpreter on each tree: the fixed tree takes fixes 33 and 22's keys, so both are
    drawn for it; stock 0.20.1 takes neither, so neither is drawn for it, which would refuse
    them. No GPU here, which the check says in its own key."""
    import os
    import subprocess
    from pathlib import Path

    from tooling.fuzzing.gpu_pair import CHECK

    def answer(tree: Path) -> dict:
        env = {**os.environ, "PYTHONPATH": str(tree), "CUDA_VISIBLE_DEVICES": ""}
        done = subprocess.run(
            [str(probe_python), "-c", CHECK], env=env, capture_output=True, text=True, timeout=600
        )
        return json.loads(done.stdout.strip().splitlines()[-1])

    fixed, stock = answer(Path(patched_0201.work_dir)), answer(upstream_0201.source_dir)
    assert (fixed["join_hold"], fixed["drafter_graphs"]) == (True, True)
    assert (stock["join_hold"], stock["drafter_graphs"]) == (False, False)
    assert fixed["gpu"] is False and stock["vllm"].startswith(str(upstream_0201.source_dir))
