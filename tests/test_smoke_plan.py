"""The smoke's plan (``plan.plan_smoke``) for the pairs it is given, from configs and declared
sizes only: the tiny pair, the seed-shaped pair narrow and at full width, and a pair the size
of Qwen3.6-27B with z-lab's drafter, on one and on two GPUs. The 27B-sized weights are
safetensors headers that declare the sizes; no file holds them."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from tooling.errors import SmokeCapacityError, SmokeError, SmokePairError, exit_code_for
from tooling.smoke import EngineSettings, GpuFacts, SmokeConfig
from tooling.smoke.pair import GIB, read_pair, safetensors_bytes
from tooling.smoke.plan import (
    Layout,
    Limit,
    Mode,
    Role,
    kv_cache_bytes,
    models_draw,
    pair_facts,
    plan_smoke,
    render,
)
from tooling.smoke.serving.tiny import TinySpec, drafter_config, hybrid_config

from .smoke_models import write_model, write_seed_pair

GB = 10**9
H200 = 141 * GB


def gpus(count: int) -> GpuFacts:
    return GpuFacts(count, H200)


@pytest.fixture
def pair27(tmp_path: Path) -> tuple[Path, Path]:
    """Qwen3.6-27B's config (the seed's geometry) with 55 GB declared over 4 shards, and
    z-lab's drafter layout with 3.5 GB."""
    target, drafter = tmp_path / "Qwen3.6-27B", tmp_path / "Qwen3.6-27B-DFlash"
    write_seed_pair(target, drafter, 55 * GB, shards=4)
    return target, drafter


def config(tmp_path: Path, **kw) -> SmokeConfig:
    return SmokeConfig(workdir=tmp_path / "w", python="python3", **kw)


K15 = EngineSettings(num_speculative_tokens=15)


def roles(plan, wave: int) -> dict[str, tuple[int, ...]]:
    return {str(s.role): s.gpus for s in plan.waves()[wave]}


def test_the_tiny_pair_runs_side_by_side_on_one_gpu(tmp_path) -> None:
    c = config(tmp_path, tiny=True)
    plan = plan_smoke(c, pair_facts(c), gpus(1))
    assert plan.layout == Layout.SIDE_BY_SIDE and plan.mode == Mode.FULL
    # Wave 0 writes the models; every engine and the reference then start at once.
    assert [s.name for s in plan.waves()[0]] == ["models"]
    # (test_smoke_runner's dry-run test names them in their start order.)
    assert plan.waves()[1][0].role == "reference"
    assert len(plan.waves()) == 2
    assert all(s.gpus == (0,) for s in plan.waves()[1])
    assert plan.reference.placement == "beside the engines" and plan.reference.shards == 4
    # Engines sharing a GPU each get a fixed KV cache.
    engines = [s for s in plan.steps if s.role not in ("models", "reference")]
    assert all(s.kv_cache_memory_bytes == 4 * GIB for s in engines)
    assert all(status == "run" for check, status in plan.checks.items() if check != "warm_cache")


def test_the_narrow_seed_shaped_pair_at_k15_fits_one_gpu_side_by_side(tmp_path) -> None:
    c = config(tmp_path, tiny=True, tiny_arch="seed", engine=K15)
    plan = plan_smoke(c, pair_facts(c), gpus(1))
    assert 2.0 < plan.pair["target_gib"] < 2.5
    assert plan.layout == Layout.SIDE_BY_SIDE
    # K = 15: the engines with the drafter keep 48 Gated DeltaNet states for each of the
    # 16 verified positions of each of 8 sequences; the plain ones one per sequence. The
    # first-token DFlash engine serves one prompt at a time: one sequence's states.
    kv = {str(s.role): s.kv_cache_memory_bytes for s in plan.steps if s.role != "models"}
    assert kv["serve-dflash"] == kv["engine"] > 16 * GIB
    assert kv["serve-plain"] == kv["first-tokens-plain"] == kv["first-tokens-dflash"] == 4 * GIB
    assert plan.steps[0].argv[-2:] == ("--arch", "seed")
    # The first tokens of K, K+1, K+2 (and 3(K+1))-token prompts, three of each.
    lengths = sorted(set(plan.prompts["first_tokens"].values()))
    assert lengths == [15, 16, 17, 48]
    assert len(plan.prompts["first_tokens"]) == 12


@pytest.mark.parametrize("count", [1, 2])
def test_the_seed_shaped_pair_at_full_width_runs_one_after_another(tmp_path, count) -> None:
    c = config(tmp_path, tiny=True, tiny_arch="seed", tiny_hidden_size=5120, engine=K15)
    plan = plan_smoke(c, pair_facts(c), gpus(count))
    # About 56 GB of weights, counted from the generator's own configs.
    total = plan.pair["target_gib"] + plan.pair["drafter_gib"]
    assert 50 * GB / GIB < total < 60 * GB / GIB
    # Drawn in bf16 on the GPU: in fp32 on the CPU it would hold twice its size in memory.
    assert plan.steps[0].argv[-4:] == ("--hidden-size", "5120", "--device", "cuda")
    assert plan.layout == Layout.ONE_AFTER_ANOTHER
    engines = [s for s in plan.steps if s.role not in ("models", "reference")]
    # The in-process engine runs second, so the reference (its proposals' comparison) can
    # load beside a later wave's engines where one leaves it room, not in a wave of its own.
    assert plan.reference.placement == "beside the engines"
    assert plan.step(Role.REFERENCE).loads_before_the_engine
    if count == 1:
        assert len(plan.waves()) == 6  # five waves after the models
        assert all(s.gpus == (0,) for s in engines)
        assert roles(plan, 2) == {"engine": (0,)}
        assert roles(plan, 3) == {"reference": (0,), "serve-plain": (0,)}
    else:
        assert roles(plan, 1) == {"serve-dflash": (0,), "engine": (1,)}
        assert roles(plan, 2) == {
            "reference": (0,),
            "serve-plain": (0,),
            "first-tokens-dflash": (1,),
        }
        assert roles(plan, 3) == {"first-tokens-plain": (0,)}


@pytest.mark.parametrize("width, on_gpu", [(None, False), (5120, True)])
def test_the_runner_draws_the_pair_the_plan_names(tmp_path, width, on_gpu) -> None:
    # The runner starts the generator before the plan exists, to overlap the preflight. It
    # once built its own arguments without the plan's --device, so the 5120-wide pair was
    # drawn in fp32 on the CPU (2 shards in the manifest, no device) although the plan said
    # GPU: the runner now starts models_draw's, which the plan's step shows.
    c = config(tmp_path, tiny=True, tiny_arch="seed", tiny_hidden_size=width, engine=K15)
    draw = models_draw(c, pair_facts(c))
    assert draw is not None
    plan = plan_smoke(c, pair_facts(c), gpus(1))
    assert plan.steps[0].argv[1:3] == ("-m", "tooling.smoke.serving.tiny")
    assert plan.steps[0].argv[3:] == draw.args
    assert draw.args[0] == str((tmp_path / "w" / "models").resolve())
    assert ("--device" in draw.options) is on_gpu
    # The plan says where: on the GPU the pair is there whole before it is written.
    assert plan.steps[0].gpus == ((0,) if on_gpu else ())
    where = "models on GPU 0 (53.3 GiB)" if on_gpu else "models on CPU (0.0 GiB)"
    assert f"wave 0: {where}" in render(plan)
    assert plan.deadlines.tiny_s == draw.limit_s
    assert models_draw(replace(c, tiny=False), pair_facts(c)) is None


def test_on_an_h200_as_torch_sees_it_four_waves_hold_every_step(tmp_path) -> None:
    # torch reports 139 GiB on the H200s lent here: a first-token DFlash engine sized for
    # one sequence (4 GiB of cache, not 21) fits beside the plain server at the seed's
    # width, and the reference beside the plain first-token engine: no fifth wave.
    c = config(tmp_path, tiny=True, tiny_arch="seed", tiny_hidden_size=5120, engine=K15)
    plan = plan_smoke(c, pair_facts(c), GpuFacts(1, 139 * GIB))
    assert plan.why.endswith("in 4 waves") and len(plan.waves()) == 5
    assert roles(plan, 3) == {"serve-plain": (0,), "first-tokens-dflash": (0,)}
    assert roles(plan, 4) == {"reference": (0,), "first-tokens-plain": (0,)}
    assert plan.reference.why == "1 copy of the pair fits beside wave 4's engines on GPU 0"
    quick = plan_smoke(replace(c, quick=True), pair_facts(c), GpuFacts(1, 139 * GIB))
    assert [sorted(roles(quick, w)) for w in (1, 2)] == [
        ["engine"],
        ["first-tokens-dflash", "first-tokens-plain"],
    ]
    # The first start's allowance counts the first wave's engines: one here.
    assert quick.deadlines.first_start_s == plan.deadlines.first_start_s


def test_a_lone_sequence_keeps_a_recurrent_block_per_max_num_seqs(tmp_path) -> None:
    # vLLM refuses to capture a hybrid target's full CUDA graphs with fewer recurrent
    # blocks than max_num_seqs: a lone sequence at K = 3 has 4 positions, not 32.
    c = config(tmp_path, tiny=True, tiny_arch="seed", tiny_hidden_size=5120)
    pair = pair_facts(c)
    engine = replace(EngineSettings(num_speculative_tokens=3), max_num_seqs=32)
    state = pair.target.recurrent_layers * pair.target.recurrent_state_bytes
    assert kv_cache_bytes(pair, engine, True, 1, alone=True) >= 32 * state


def test_a_27b_sized_pair_is_planned_from_its_config_and_declared_sizes(pair27, tmp_path):
    target, drafter = pair27
    pair = read_pair(str(target), str(drafter))
    assert pair.target.weight_bytes == 55 * GB and pair.drafter.weight_bytes == int(3.5 * GB)
    assert pair.target.hybrid and pair.target.multimodal
    assert pair.target.attention_layers == 16 and pair.target.recurrent_layers == 48
    c = config(tmp_path, target=str(target), drafter=str(drafter), engine=K15)
    one = plan_smoke(c, pair, gpus(1))
    assert one.layout == Layout.ONE_AFTER_ANOTHER and one.why.endswith("in 5 waves")
    assert [sorted(roles(one, w)) for w in range(1, 6)] == [
        ["serve-dflash"],
        ["engine"],
        ["reference", "serve-plain"],
        ["first-tokens-dflash"],
        ["first-tokens-plain"],
    ]
    # Held twice, the target fits one GPU: the reference compares every prompt, beside the
    # plain server (it takes the servers' divergences once that one is observed).
    assert one.reference.placement == "beside the engines"
    assert one.reference.prompts == (0, 1, 2, 3)
    assert "--language-model-only" in one.step(Role.SERVE_DFLASH).argv
    two = plan_smoke(c, pair, gpus(2))
    assert two.why.endswith("as many at a time as the GPUs hold, in 3 waves")
    assert len(two.waves()) == 4  # after the models' empty wave 0
    assert [len(w) for w in two.waves()[1:]] == [2, 3, 1]
    # The first start is not measured yet: its limit grows with the weights.
    assert two.deadlines.first_start_s > one.deadlines.start.floor_s + 400


def test_a_target_too_large_to_hold_twice_is_compared_on_a_stated_subset(tmp_path) -> None:
    target, drafter = tmp_path / "t", tmp_path / "d"
    write_seed_pair(target, drafter, 70 * GB)
    c = config(tmp_path, target=str(target), drafter=str(drafter), engine=K15)
    plan = plan_smoke(c, read_pair(str(target), str(drafter)), gpus(1))
    assert plan.reference.placement == "after the engines"
    assert plan.reference.prompts == (0, 1)
    assert "too large to hold twice" in plan.reference.why
    assert "on 2 of the 4 fidelity prompts" in render(plan)


def test_quick_plans_the_checks_of_one_start(tmp_path, pair27) -> None:
    c = config(tmp_path, tiny=True, quick=True)
    plan = plan_smoke(c, pair_facts(c), gpus(1))
    assert plan.mode == Mode.QUICK and len(plan.waves()) == 2
    assert {str(s.role) for s in plan.waves()[1]} == {
        "engine",
        "first-tokens-dflash",
        "first-tokens-plain",
    }
    ran = [check for check, status in plan.checks.items() if status == "run"]
    assert ran == ["aux_layers", "drafter_windows", "slot_audit", "first_tokens"]
    assert plan.reference.placement == "not run"
    assert len(plan.prompts["first_tokens"]) == 4  # one prompt of each length


def test_deadlines_are_multiples_of_the_measured_start_with_a_floor(tmp_path) -> None:
    c = config(tmp_path, tiny=True)
    d = plan_smoke(c, pair_facts(c), gpus(1)).deadlines
    assert d.total_s is None
    assert d.request.seconds(None) == d.request.floor_s == 60
    assert d.request.seconds(252.0) == pytest.approx(126.0)
    assert d.start_s(None) == d.first_start_s and d.start_s(252.0) == pytest.approx(504.0)
    assert d.child_s(Limit(10.0, 1.0), 100.0) == pytest.approx(d.start.floor_s + 100.0)


def test_a_pair_too_large_for_the_gpus_is_one_line_with_its_figures(pair27, tmp_path):
    target, drafter = pair27
    c = config(tmp_path, target=str(target), drafter=str(drafter), engine=K15)
    with pytest.raises(SmokeCapacityError) as e:
        plan_smoke(c, read_pair(str(target), str(drafter)), GpuFacts(1, 80 * GIB))
    assert str(e.value).startswith("serve with DFlash needs 81.2 GiB on each of 1 GPU(s)")
    assert "72.0 GiB usable of 80.0 GiB" in str(e.value) and "\n" not in str(e.value)
    assert exit_code_for(e.value) == 24
    with pytest.raises(SmokeCapacityError, match="--tensor-parallel-size 2 needs 2 GPUs; 1"):
        tp2 = replace(c, engine=replace(K15, tensor_parallel_size=2))
        plan_smoke(tp2, read_pair(str(target), str(drafter)), gpus(1))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            ("target", "architectures", ["Qwen3Model"]),
            r"Qwen3.6-27B: the target's architectures \['Qwen3Model'\] name no causal LM",
        ),
        (("drafter", "dflash_config", None), "the drafter has no dflash_config"),
    ],
)
def test_a_pair_the_smoke_cannot_serve_is_refused_in_one_line(
    pair27, tmp_path, edit, message
) -> None:
    role, key, value = edit
    folder = pair27[0] if role == "target" else pair27[1]
    data = json.loads((folder / "config.json").read_text())
    if value is None:
        del data[key]
    else:
        data[key] = value
    (folder / "config.json").write_text(json.dumps(data))
    with pytest.raises(SmokePairError, match=message) as e:
        read_pair(str(pair27[0]), str(pair27[1]))
    assert exit_code_for(e.value) == 23 and "\n" not in str(e.value)


@pytest.mark.parametrize(("k", "placed"), [(15, True), (16, False)])
def test_k_is_bounded_by_the_drafters_block(pair27, tmp_path, k, placed) -> None:
    """z-lab's drafter states block_size 16 at the top level: 15 tokens a step at most (vLLM
    would serve 16, with a last draft position the drafter never learned)."""
    c = config(
        tmp_path,
        target=str(pair27[0]),
        drafter=str(pair27[1]),
        engine=EngineSettings(num_speculative_tokens=k),
    )
    pair = pair_facts(c)
    assert pair.drafter.block_size == 16
    if placed:
        assert plan_smoke(c, pair, gpus(2)).engine.num_speculative_tokens == 15
        return
    with pytest.raises(SmokePairError) as e:
        plan_smoke(c, pair, gpus(2))
    assert str(e.value) == (
        f"{pair27[1]}: its block_size 16 drafts at most 15 tokens a step; "
        "--num-speculative-tokens 16 asks for more"
    )
    assert exit_code_for(e.value) == 23


def test_weights_without_safetensors_are_refused(tmp_path) -> None:
    spec = TinySpec.for_arch("hybrid")
    target, drafter = tmp_path / "t", tmp_path / "d"
    write_model(target, hybrid_config(spec), GB)
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps(drafter_config(spec)))
    with pytest.raises(SmokePairError, match=r"d: no safetensors weights to size the model by$"):
        read_pair(str(target), str(drafter))
    assert safetensors_bytes(target / "model-00000-of-00001.safetensors") == GB


def test_gpus_option_is_parsed_or_refused() -> None:
    assert GpuFacts.parse("2x141") == GpuFacts(2, 141 * GIB)
    with pytest.raises(Exception, match=r"--gpus '2': expected COUNTxGIB"):
        GpuFacts.parse("2")


def test_engines_that_do_not_all_fit_share_what_each_wave_holds(tmp_path) -> None:
    c = config(tmp_path, tiny=True)
    plan = plan_smoke(c, pair_facts(c), GpuFacts(1, 20 * GIB))
    assert plan.layout == Layout.ONE_AFTER_ANOTHER
    # Two engines of about 7 GiB a wave on 18 GiB usable. The reference would fit beside
    # the first, but takes the servers' first differences (check 1's margins) once its wave
    # is over: it joins the plain server's wave, not the one before.
    assert [len(w) for w in plan.waves()[1:]] == [2, 3, 1]
    assert roles(plan, 1) == {"serve-dflash": (0,), "engine": (0,)}
    assert roles(plan, 2) == {
        "reference": (0,),
        "serve-plain": (0,),
        "first-tokens-dflash": (0,),
    }
    asked = plan_smoke(replace(c, overlap_engines=False), pair_facts(c), gpus(2))
    assert asked.why.startswith("asked (--sequential)")
    # One engine a GPU at a time: the reference only where a GPU is free.
    assert [roles(asked, w) for w in (1, 2, 3)] == [
        {"serve-dflash": (0,), "engine": (1,)},
        {"serve-plain": (0,), "first-tokens-dflash": (1,)},
        {"reference": (1,), "first-tokens-plain": (0,)},
    ]
    assert asked.reference.placement == "own GPU"


def test_the_executor_backend_reaches_the_dflash_server_alone(tmp_path) -> None:
    """``--distributed-executor-backend ray`` at TP=2 on the seed-shaped pair (the Ray
    variant's plan): the DFlash server gets the flag; the plain server, the control, keeps
    vLLM's choice (one Ray instance a run); the in-process engines run at TP 1 in the
    smoke's own children, which take no command-line flags of vLLM's."""
    engine = replace(K15, tensor_parallel_size=2, distributed_executor_backend="ray")
    c = config(tmp_path, tiny=True, tiny_arch="seed", engine=engine)
    plan = plan_smoke(c, pair_facts(c), gpus(2))
    flag = ["--distributed-executor-backend", "ray"]
    for s in plan.steps:
        argv = list(s.argv)
        carries = any(argv[i : i + 2] == flag for i in range(len(argv)))
        assert carries == (s.role == Role.SERVE_DFLASH), s.name
        if s.role in (Role.SERVE_DFLASH, Role.SERVE_PLAIN):
            assert s.gpus == (0, 1)
            assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert plan.to_json()["engine"]["distributed_executor_backend"] == "ray"
    assert "DFlash server: --distributed-executor-backend ray at tensor parallel 2" in render(plan)
    # vLLM's own choice unless asked: no flag, no line.
    default = replace(c, engine=replace(engine, distributed_executor_backend=None))
    plan = plan_smoke(default, pair_facts(default), gpus(2))
    assert not any("--distributed-executor-backend" in s.argv for s in plan.steps)
    assert plan.to_json()["engine"]["distributed_executor_backend"] is None
    assert "DFlash server:" not in render(plan)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"quick": True},
            "--distributed-executor-backend reaches the DFlash server, which --quick does not "
            "start",
        ),
        ({"backend": "uni"}, "--distributed-executor-backend 'uni': choose mp or ray"),
    ],
)
def test_an_executor_backend_the_run_cannot_use_is_refused(tmp_path, kw, message) -> None:
    engine = replace(K15, distributed_executor_backend=kw.pop("backend", "ray"))
    with pytest.raises(SmokeError, match=re.escape(message)) as e:
        config(tmp_path, tiny=True, engine=engine, **kw).validate()
    assert exit_code_for(e.value) == 17 and "\n" not in str(e.value)


@pytest.mark.parametrize("gpus_text", ["1x80", "1x139", "2x80", "2x141"])
def test_the_reference_never_runs_before_a_server_or_the_in_process_engine(
    tmp_path, gpus_text
) -> None:
    """The reference compares the in-process engine's proposals, and for check 1 the
    target's margins at the two servers' first differences, handed over when its wave ends:
    planned in a wave before the plain server's, it got none, and check 1 could only fail
    ("the target's margins there unknown") wherever the servers differed, as near-ties on
    random weights do (a 20 GB or 48 GB pair of the seed's family was planned so)."""
    gpus_facts = GpuFacts.parse(gpus_text)
    planned = 0
    for gb in range(4, 76, 4):
        target, drafter = tmp_path / f"t{gb}", tmp_path / f"d{gb}"
        write_seed_pair(target, drafter, gb * GB, shards=2)
        c = config(tmp_path, target=str(target), drafter=str(drafter), engine=K15)
        try:
            plan = plan_smoke(c, read_pair(str(target), str(drafter)), gpus_facts)
        except SmokeCapacityError:
            continue  # too large for these GPUs: refused before anything starts
        planned += 1
        ref = plan.step(Role.REFERENCE)
        assert ref is not None, gb
        inputs = [
            s for s in plan.steps if s.role in (Role.ENGINE, Role.SERVE_DFLASH, Role.SERVE_PLAIN)
        ]
        assert len(inputs) == 3 and all(s.wave <= ref.wave for s in inputs), (gb, render(plan))
    assert planned >= 10


@pytest.mark.parametrize("warm_cache", [False, True])
@pytest.mark.parametrize("overlap", [None, False])
def test_no_wave_asks_a_gpu_for_more_than_it_holds(tmp_path, warm_cache, overlap) -> None:
    """Every wave's processes on each GPU, the reference's copies counted, within its usable
    memory, for pairs of the seed's family from 2 to 74 GB on GPUs of 48 to 139 GiB (the
    servers at TP=2 on two). Check 7's runs put the in-process engine and its reference on
    GPU 0 at once whatever their size: 76.7 GiB on an 80 GiB GPU's 72 usable for a 6 GB
    target."""
    site = tmp_path / "other"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    planned = 0
    for gb in range(2, 76, 6):
        target, drafter = tmp_path / f"t{gb}", tmp_path / f"d{gb}"
        write_seed_pair(target, drafter, gb * GB, shards=2)
        pair = read_pair(str(target), str(drafter))
        for text, tp in (("1x48", 1), ("1x80", 1), ("1x139", 1), ("2x80", 2), ("4x80", 1)):
            facts = GpuFacts.parse(text)
            c = config(
                tmp_path,
                target=str(target),
                drafter=str(drafter),
                engine=replace(K15, tensor_parallel_size=tp),
                warm_cache=warm_cache,
                other_site=str(site) if warm_cache else None,
                overlap_engines=overlap,
            )
            try:
                plan = plan_smoke(c, pair, facts)
            except SmokeCapacityError:
                continue  # refused before anything starts
            planned += 1
            held: dict[tuple[int, int], int] = {}
            for s in plan.steps:
                for gpu in s.gpus:
                    key = (s.wave, gpu)
                    held[key] = held.get(key, 0) + s.memory_bytes * s.processes
            over = {k: round(v / GIB, 1) for k, v in held.items() if v > facts.usable_bytes}
            assert not over, (gb, text, over, render(plan))
    assert planned >= 30
