"""``trained.gpu_fit``: engines served together only where they fit the GPU lent, else in turns
(a speed run's one at a time), said in one line (an H100 may come where an H200 was planned)."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from tooling.host.speed import LOCATE_ENGINES, SPEED_ENGINES
from tooling.trained.gpu_fit import (
    ENGINE_OVERHEAD_GIB,
    fitted,
    gpu_memory_gib,
    needed_gib,
    turns,
)
from tooling.trained.speed import ENGINES, Settings
from tooling.trained.speed_engines import KV_GIB_DRAFTED

#: What nvidia-smi reports as memory.total, MiB: one H200 and one H100 (80 GB).
H200_GIB = 143771 / 1024
H100_GIB = 81559 / 1024


def test_the_sessions_runs_fit_one_h200_together_and_the_locate_run_one_h100():
    together = Settings(interleave=True, sustained=True)
    for names in (SPEED_ENGINES, LOCATE_ENGINES):
        assert fitted(together, [ENGINES[n] for n in names], H200_GIB) is together
    assert fitted(together, [ENGINES[n] for n in LOCATE_ENGINES], H100_GIB) is together
    alone = fitted(together, [ENGINES[n] for n in SPEED_ENGINES], H100_GIB)
    assert alone.one_at_a_time and not alone.interleave and alone.sustained
    # Five engines with 104 GiB of KV cache between them served together on one H200.
    assert needed_gib(ENGINES[n] for n in SPEED_ENGINES) == 104 + 5 * ENGINE_OVERHEAD_GIB


def test_an_unknown_gpu_or_a_run_already_one_at_a_time_is_left_as_asked(caplog):
    engines = [ENGINES[n] for n in SPEED_ENGINES]
    asked = Settings(interleave=True)
    assert fitted(asked, engines, None) is asked
    alone = Settings(one_at_a_time=True)
    with caplog.at_level(logging.WARNING):
        assert fitted(alone, engines, H100_GIB) is alone
    assert not caplog.records


def test_the_switch_is_said_in_one_line(caplog):
    with caplog.at_level(logging.WARNING):
        fitted(Settings(interleave=True), [ENGINES[n] for n in SPEED_ENGINES], H100_GIB)
    [line] = [r.getMessage() for r in caplog.records]
    assert "5 engines need about 129 GiB together and the GPU has 80 GiB" in line


def test_a_trained_call_too_large_for_the_gpu_is_served_in_as_few_turns_as_fit(caplog):
    from tooling.trained import hybrid_plan

    call = [v for v in hybrid_plan.variants((15, 7)) if v.call == 2]
    assert turns(call, H200_GIB, "call 2") == [call]
    for gpu_gib, count in ((H100_GIB, 2), (H100_GIB / 2, 4)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            served = turns(call, gpu_gib, "call 2")
        # Every engine once, in the plan's order, each turn within the GPU.
        assert [v for turn in served for v in turn] == call and len(served) == count
        assert all(needed_gib(turn) <= gpu_gib for turn in served)
        [line] = [r.getMessage() for r in caplog.records]
        assert f"call 2: {len(call)} engines need about {needed_gib(call)} GiB" in line
        assert f"served in {count} turns" in line
    assert turns(call, None, "call 2") == [call] and turns([], H100_GIB, "none") == []


def test_the_gpu_is_asked_through_nvidia_smi(tmp_path, monkeypatch):
    # No GPU and no nvidia-smi on this machine: nothing to ask.
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu_memory_gib() is None
    # nvidia-smi's answer to the query, as it prints it on a host of one H100.
    tool = tmp_path / "nvidia-smi"
    tool.write_text("#!/bin/sh\necho 81559\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    assert gpu_memory_gib() == H100_GIB
    tool.write_text("#!/bin/sh\necho 'No devices were found' >&2\nexit 6\n")
    assert gpu_memory_gib() is None
    assert os.environ["PATH"] == str(tmp_path)


def test_the_state_step_serves_call_1s_checks_of_patches_23_and_24_in_one_turn_on_an_h100():
    from tooling.host.steps import STATE_ENGINES, STEPS
    from tooling.trained import hybrid_plan

    step = STEPS["trained-1-state"]
    assert step.calls == "1" and step.engines == STATE_ENGINES
    by_name = {v.name: v for v in hybrid_plan.variants((15, 7))}
    chosen = [by_name[n] for n in STATE_ENGINES.split(",")]
    assert {v.call for v in chosen} == {1}
    assert [v.site for v in chosen if v.budget] == ["patched", f"no-{hybrid_plan.STATE_FIX}"]
    assert turns(chosen, H100_GIB, "call 1") == [chosen]


def test_the_replay_step_serves_patch_32s_option_beside_the_fixed_wheel_in_one_turn_on_an_h100():
    from tooling.host.steps import REPLAY_ENGINES, STEPS, session_ablations
    from tooling.trained import hybrid_plan

    step = STEPS["trained-1-replay"]
    assert step.calls == "1" and step.engines == REPLAY_ENGINES
    by_name = {v.name: v for v in hybrid_plan.variants((15, 7))}
    chosen = [by_name[n] for n in REPLAY_ENGINES.split(",")]
    assert {v.call for v in chosen} == {1}
    assert [v.name for v in chosen if v.replay] == ["patched-k15-replay"]
    assert turns(chosen, H100_GIB, "call 1") == [chosen]
    # Its engines are the fixed wheel's alone: the installs build no ablation for it, and
    # the state step only the one its control serves.
    assert session_ablations(["trained-1-replay"]) == []
    assert session_ablations(["trained-1-state"]) == [hybrid_plan.STATE_FIX]


def test_the_replay_speed_run_sizes_its_drafting_engines_for_its_levels_and_fits_one_h100(
    tmp_path,
):
    """``speed-replay`` gives each drafting engine the KV cache its levels need, so its three
    engines measure interleaved on one H100; the same engines at their own sizes would not."""
    import json

    from tooling.host.speed import REPLAY_ARGS, REPLAY_ENGINES
    from tooling.trained.speed import plan, sized

    gib = int(REPLAY_ARGS[REPLAY_ARGS.index("--drafted-kv-gib") + 1])
    settings = Settings(interleave=True, drafted_kv_gib=gib, levels=(16, 32))
    own = [ENGINES[n] for n in REPLAY_ENGINES]
    assert fitted(settings, own, H100_GIB) is not settings
    engines = [sized(e, settings) for e in own]
    assert [e.kv_cache_gib for e in engines if e.drafted] == [gib, gib]
    assert [e.kv_cache_gib for e in engines if not e.drafted] == [ENGINES["plain"].kv_cache_gib]
    assert fitted(settings, engines, H100_GIB) is settings
    # The planned requests carry the size, each drafting engine's own options kept.
    pair = tmp_path / "pair"
    pair.mkdir()
    prompts = {
        "prompts": [{"token_ids": [5, 6, 7]}],
        "engine": {"max_model_len": 512, "max_num_seqs": 64},
        "speculative_tokens": [15],
    }
    (pair / "prompts.json").write_text(json.dumps(prompts))
    plan(pair, tmp_path / "work", list(REPLAY_ENGINES), settings)
    sent = json.loads((tmp_path / "work" / "dflash-replay.in.json").read_text())["engine"]
    assert sent["kv_cache_memory_bytes"] == gib << 30
    assert sent["speculative_args"] == {"gdn_spec_replay": True}


@pytest.mark.parametrize("name", ["bar", "hold", "graphs"])
def test_the_bar_steps_measure_against_plain_at_the_bars_levels_together_on_one_h100(name):
    """``speed-bar`` (DFlash as shipped), ``speed-hold`` (patch 33's option) and
    ``speed-graphs`` (patch 22's) each against plain in the same run, at the bar's levels
    their KV caches hold, staggered, on one H100, the profiled level among them."""
    from tooling.host import speed
    from tooling.host.steps import STEPS

    args = getattr(speed, f"{name.upper()}_ARGS")
    engines = getattr(speed, f"{name.upper()}_ENGINES")
    step = STEPS[f"speed-{name}"]
    assert speed.speed_args(step.variant) == args
    value = {args[i]: args[i + 1] for i in range(len(args) - 1)}
    held = min(ENGINES[n].kv_cache_gib for n in engines if ENGINES[n].drafted)
    levels = "1,16,64" if held >= KV_GIB_DRAFTED else "1,16"
    assert value["--levels"] == levels and int(value["--passes"]) >= 5
    assert value["--profile-levels"] in levels.split(",")
    assert "--staggered" in args and "--interleave" in args
    assert engines[0] == "plain" and len(engines) == 2
    settings = Settings(interleave=True)
    assert fitted(settings, [ENGINES[n] for n in engines], H100_GIB) is settings


def test_the_stock_step_holds_plain_to_stock_alone_at_the_bars_levels_on_one_h100():
    """``speed-stock``: plain on stock and on the fixed wheel, in turns, five passes at the
    bar's levels with steady windows, nothing profiled, on one H100."""
    from tooling.host import speed
    from tooling.host.steps import STEPS

    args = speed.STOCK_ARGS
    assert speed.speed_args(STEPS["speed-stock"].variant) == args
    value = {args[i]: args[i + 1] for i in range(len(args) - 1)}
    assert value["--engines"] == "plain-stock,plain" and value["--levels"] == "1,16,64"
    assert int(value["--passes"]) >= 5 and value["--profile-levels"] == ""
    assert "--interleave" in args
    settings = Settings(interleave=True)
    assert fitted(settings, [ENGINES[n] for n in speed.STOCK_ENGINES], H100_GIB) is settings


def test_the_hold_engine_serves_patch_33s_option():
    assert ENGINES["dflash-hold"].speculative_args == {"join_hold_steps": 4}
    assert ENGINES["dflash-hold"].site == "patched" and ENGINES["dflash-hold"].drafted


def test_the_seed_step_draws_the_seeds_width_and_serves_each_engine_alone_up_to_32():
    """``speed-seed``: the seed's full width drawn, plain and DFlash each alone on the GPU
    (two 27B-sized engines never fit one together), at 1, 8 and 32 requests, the DFlash engine
    measured again with every draft accepted, and its KV cache holding 32 requests of the
    seed's at K = 15 (1.51 GiB each, measured on 2026-12-04); the drawn-shape steps beside it
    keep the recipe's shapes."""
    from tooling.host import speed
    from tooling.host.steps import STEPS, Kind

    step = STEPS["speed-seed"]
    assert step.kind is Kind.SPEED_SHAPE and speed.drawn_arch(step.variant) == "seed"
    assert speed.ARCHES["seed"][-2:] == ["--hidden-size", "5120"]
    for name in ("speed-shape", "speed-shape-off", "speed-shape-stock"):
        assert speed.drawn_arch(STEPS[name].variant) == "trained-shape"
    args = speed.speed_args(step.variant)
    value = {args[i]: args[i + 1] for i in range(len(args) - 1)}
    assert value["--engines"] == "seed-plain,seed-dflash" and "--one-at-a-time" in args
    assert value["--levels"] == "1,8,32" and value["--profile-levels"] == ""
    drafted = ENGINES["seed-dflash"]
    assert drafted.constant_logits and drafted.kv_cache_gib >= 32 * 1.51


def test_the_seed_step_measures_1_and_8_on_an_h100_and_refuses_a_smaller_gpu():
    """On an H100 the seed's DFlash engine cannot hold 32 requests beside its 53 GiB of
    weights: ``speed-seed`` measures 1 and 8 there, with a KV cache that holds 8 (1.51 GiB a
    request at K = 15) and what an engine needs beside it within the card; on a GPU too small
    for one such engine it is refused in one line."""
    from tooling.errors import HostStepError
    from tooling.host import speed
    from tooling.trained.gpu_fit import ENGINE_OVERHEAD_GIB

    assert speed.seed_args(141.0) == speed.seed_args(None) == speed.SEED_ARGS
    small = speed.seed_args(H100_GIB)
    value = {small[i]: small[i + 1] for i in range(len(small) - 1)}
    assert value["--levels"] == "1,8" and "--one-at-a-time" in small
    kv = int(value["--drafted-kv-gib"])
    assert kv >= 8 * 1.51 and 53 + kv + ENGINE_OVERHEAD_GIB <= H100_GIB
    with pytest.raises(HostStepError, match="needs a GPU of 70 GiB or more"):
        speed.seed_args(40.0)


def test_the_drawn_stock_step_is_the_stock_steps_run_on_the_recipes_shapes():
    """``speed-shape-stock`` runs ``speed-stock``'s engines and levels on the drawn shapes:
    plain's step does the same work whatever its weights (every request makes exactly its
    tokens), so the 2% bar needs no training."""
    from tooling.host import speed
    from tooling.host.steps import STEPS, Kind

    step = STEPS["speed-shape-stock"]
    assert step.kind is Kind.SPEED_SHAPE
    assert speed.speed_args(step.variant) == speed.speed_args(STEPS["speed-stock"].variant)


def test_the_inputs_step_measures_patch_34_against_its_ablation_on_one_h100():
    """``speed-inputs``: plain, DFlash and DFlash without patch 34 (its ``no-`` install, built
    by the session), at 1 and 16 requests in turns with the batch kept full, fit one H100."""
    from tooling.host import speed
    from tooling.host.steps import STEPS, Kind, session_ablations

    step = STEPS["speed-inputs"]
    assert step.kind is Kind.SPEED_SHAPE
    assert speed.step_engines(step.variant) == speed.INPUTS_ENGINES
    assert ENGINES["dflash-no-inputs-upload"].site == "no-spec-inputs-upload"
    both = [ENGINES[n] for n in ("dflash-16", "dflash-no-inputs-upload")]
    assert {(e.kv_cache_gib, e.drafted) for e in both} == {(both[0].kv_cache_gib, True)}
    assert "spec-inputs-upload" in session_ablations(["speed-inputs"])
    assert "spec-inputs-upload" not in session_ablations(["speed-stock"])
    args = speed.speed_args(step.variant)
    value = {args[i]: args[i + 1] for i in range(len(args) - 1)}
    assert value["--levels"] == "1,16" and int(value["--passes"]) >= 5
    settings = Settings(interleave=True)
    assert fitted(settings, [ENGINES[n] for n in speed.INPUTS_ENGINES], H100_GIB) is settings


def test_the_one_request_step_measures_the_bar_engines_alone_at_one_with_its_regions():
    """``speed-one``: DFlash as shipped against plain at one request, five passes in turns,
    that level profiled (the speed run times its regions with no profiler only at a
    profiled level), on the drawn shapes and on one H100."""
    from tooling.host import speed
    from tooling.host.steps import STEPS, Kind, session_ablations

    step = STEPS["speed-one"]
    assert step.kind is Kind.SPEED_SHAPE
    assert speed.step_engines(step.variant) == speed.BAR_ENGINES
    assert session_ablations(["speed-one"]) == []
    args = speed.speed_args(step.variant)
    value = {args[i]: args[i + 1] for i in range(len(args) - 1)}
    assert value["--levels"] == "1" and int(value["--passes"]) >= 5
    assert value["--profile-levels"] == "1"
    settings = Settings(interleave=True)
    assert fitted(settings, [ENGINES[n] for n in speed.BAR_ENGINES], H100_GIB) is settings


def test_the_stock_step_at_64_profiles_both_plain_engines_there():
    """``speed-shape-stock-64``: plain on stock and on the fixed wheel at 64 alone, five
    passes in turns, that level profiled, on the drawn shapes and on one H100."""
    from tooling.host import speed
    from tooling.host.steps import STEPS, Kind

    step = STEPS["speed-shape-stock-64"]
    assert step.kind is Kind.SPEED_SHAPE
    assert speed.step_engines(step.variant) == speed.STOCK_ENGINES
    args = speed.speed_args(step.variant)
    value = {args[i]: args[i + 1] for i in range(len(args) - 1)}
    assert value["--levels"] == "64" == value["--profile-levels"]
    assert int(value["--passes"]) >= 5
    settings = Settings(interleave=True)
    assert fitted(settings, [ENGINES[n] for n in speed.STOCK_ENGINES], H100_GIB) is settings


@pytest.mark.parametrize(
    ("name", "engines", "ablated", "patch"),
    [
        ("speed-greedy", "GREEDY_ENGINES", "dflash-no-greedy-verify", "greedy-verify-direct"),
        ("speed-context", "CONTEXT_ENGINES", "dflash-no-context-kv", "context-kv-one-launch"),
        ("speed-align", "ALIGN_ENGINES", "dflash-no-align-deferred", "align-counts-deferred"),
    ],
)
def test_a_patch_step_measures_it_against_its_ablation_on_one_h100(
    name: str, engines: str, ablated: str, patch: str
):
    """``speed-greedy`` (patch 35), ``speed-context`` (patch 37) and ``speed-align`` (patch
    39): plain, DFlash and DFlash
    without the patch (its ``no-`` install, built by the session), at 1 and 16 requests in
    turns, one request profiled, fit one H100."""
    from tooling.host import speed
    from tooling.host.steps import STEPS, Kind, session_ablations

    step = STEPS[name]
    assert step.kind is Kind.SPEED_SHAPE
    assert speed.step_engines(step.variant) == getattr(speed, engines)
    assert ablated in getattr(speed, engines)
    assert ENGINES[ablated].site == f"no-{patch}"
    assert session_ablations([name]) == [patch]
    args = speed.speed_args(step.variant)
    value = {args[i]: args[i + 1] for i in range(len(args) - 1)}
    assert value["--levels"] == "1,16" and value["--profile-levels"] == "1"
    settings = Settings(interleave=True)
    assert fitted(settings, [ENGINES[n] for n in getattr(speed, engines)], H100_GIB) is settings


def test_the_host_step_measures_patches_37_and_38_and_patch_22s_graphs_in_one_start():
    """``speed-host``: plain, the fixed wheel, the wheel without patch 38 and without patch
    37 (each its ``no-`` install, built by the session), and patch 22's graphs off, at one
    request in turns, profiled, all five fitting one H100 at once."""
    from tooling.host import speed
    from tooling.host.steps import STEPS, Kind, session_ablations

    step = STEPS["speed-host"]
    assert step.kind is Kind.SPEED_SHAPE
    assert speed.step_engines(step.variant) == speed.HOST_ENGINES
    assert ENGINES["dflash-no-metadata-reuse"].site == "no-spec-metadata-reuse"
    assert sorted(session_ablations(["speed-host"])) == [
        "context-kv-one-launch",
        "spec-metadata-reuse",
    ]
    args = speed.speed_args(step.variant)
    value = {args[i]: args[i + 1] for i in range(len(args) - 1)}
    assert value["--levels"] == "1" and value["--profile-levels"] == "1"
    settings = Settings(interleave=True)
    assert fitted(settings, [ENGINES[n] for n in speed.HOST_ENGINES], H100_GIB) is settings


def test_the_one_request_graphs_step_puts_patch_22_beside_the_bar_engines_on_one_h100():
    """``speed-one-graphs``: plain, DFlash and DFlash with the drafter's full graphs (patch
    22, on by default) off, one request alone, profiled, so that the query pass's host time
    is timed with them and without; fit one H100 in turns."""
    from tooling.host import speed
    from tooling.host.steps import STEPS, Kind, session_ablations

    step = STEPS["speed-one-graphs"]
    assert step.kind is Kind.SPEED_SHAPE
    assert speed.step_engines(step.variant) == ("plain", "dflash", "dflash-no-drafter-graphs")
    off = ENGINES["dflash-no-drafter-graphs"].speculative_args
    assert off == {"dflash_full_cudagraphs": False}
    assert session_ablations(["speed-one-graphs"]) == []
    args = speed.speed_args(step.variant)
    value = {args[i]: args[i + 1] for i in range(len(args) - 1)}
    assert value["--levels"] == "1" == value["--profile-levels"]
    settings = Settings(interleave=True)
    assert fitted(settings, [ENGINES[n] for n in speed.ONE_GRAPHS_ENGINES], H100_GIB) is settings


def test_the_step_graphs_step_puts_patch_40s_option_beside_dflash_as_shipped_on_one_h100():
    """``speed-step``: plain, DFlash as shipped and DFlash with patch 40's option (a decode
    step's drafter replayed as one graph, off by default), at one request in turns,
    profiled, all three fitting one H100; no ablation to build. ``tiny-step-graphs`` gives
    the production smoke the same option, so that its fidelity check sees those drafts."""
    from tooling.host import speed
    from tooling.host.steps import STEPS, Kind, session_ablations
    from tooling.host.variants import VARIANTS

    step = STEPS["speed-step"]
    assert step.kind is Kind.SPEED_SHAPE
    assert speed.step_engines(step.variant) == ("plain", "dflash-16", "dflash-step-graphs")
    assert ENGINES["dflash-step-graphs"].speculative_args == {"dflash_step_graphs": True}
    assert ENGINES["dflash-step-graphs"].site == ENGINES["dflash-16"].site == "patched"
    assert session_ablations(["speed-step"]) == []
    args = speed.speed_args(step.variant)
    value = {args[i]: args[i + 1] for i in range(len(args) - 1)}
    assert value["--levels"] == "1" == value["--profile-levels"]
    settings = Settings(interleave=True)
    assert fitted(settings, [ENGINES[n] for n in speed.STEP_ENGINES], H100_GIB) is settings
    smoke = STEPS["tiny-step-graphs"]
    assert smoke.kind is Kind.SMOKE
    assert VARIANTS[smoke.variant].args == ("--speculative-option", "dflash_step_graphs=true")
