"""The hybrid recipe (``tooling train --arch hybrid``) end to end at CPU size, in the probe
interpreter: the pair's shapes and files, the lossless check's prompts, the floors.

A module of its own, so the test workers run it beside the attention-only recipe's tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tooling.cli import main
from tooling.errors import TrainingError, TrainSettingsError
from tooling.paths import REPO_DIR
from tooling.trainer.api import TrainRequest, train_in

from .helpers import wait_until

pytestmark = pytest.mark.slow


def _train(*args: str) -> Any:
    return CliRunner().invoke(main, ["train", *args])


#: The hybrid recipe at its CPU size, cut to a few steps: the shapes, files and floors, not
#: the quality, are under test.
HYBRID_QUICK = (
    "target_max_steps=3",
    "drafter_steps=3",
    "data_sequences=16",
    "num_prompts=2",
)


@pytest.fixture(scope="module")
def hybrid_run(
    tmp_path_factory: pytest.TempPathFactory, probe_env: tuple[str, dict[str, str]]
) -> dict[str, Any]:
    python, env = probe_env
    out = tmp_path_factory.mktemp("hybrid") / "pair"
    request = TrainRequest(preset="smoke", arch="hybrid", overrides=HYBRID_QUICK, out_dir=out)
    with pytest.MonkeyPatch.context() as mp:
        for key in ("PYTHONPATH", "TOKENIZERS_PARALLELISM"):
            mp.setenv(key, env[key])
        pair = train_in(Path(python), request)
    return {"python": python, "env": env, "out": out, "pair": pair}


def test_hybrid_recipe_writes_a_pair_of_the_seeds_family(hybrid_run: dict[str, Any]) -> None:
    out = hybrid_run["out"]
    target = json.loads((out / "target" / "config.json").read_text())
    assert target["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    text = target["text_config"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + [
        "linear_attention"
    ] * 3 + ["full_attention"]
    drafter = json.loads((out / "drafter" / "config.json").read_text())
    assert drafter["layer_types"] == ["sliding_attention", "full_attention"]
    # Another KV shape than the target's attention, as the seed's drafter has.
    assert (drafter["num_key_value_heads"], drafter["head_dim"]) != (
        text["num_key_value_heads"],
        text["head_dim"],
    )
    assert drafter["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    assert drafter["block_size"] == 8
    prompts = json.loads((out / "prompts.json").read_text())
    engine = prompts["engine"]
    checked = {p["name"]: p for p in prompts["lossless"]}
    for k in (3, 7):
        for length in (k, k + 1, k + 2):
            assert len(checked[f"k{k}-len{length}"]["token_ids"]) == length
    tail = checked[f"chunk-tail-{engine['max_num_batched_tokens'] + 1}"]
    assert len(tail["token_ids"]) == engine["max_num_batched_tokens"] + 1
    a, b = checked["prefix-a"]["token_ids"], checked["prefix-b"]["token_ids"]
    # Several of a hybrid engine's attention blocks (hundreds of tokens each) are shared.
    shared = engine["max_num_batched_tokens"]
    assert a[:shared] == b[:shared] and a[shared:] != b[shared:]
    assert checked["prefix-a-again"]["token_ids"] == a
    last = checked["to-max-model-len"]
    assert len(last["token_ids"]) + last["max_new_tokens"] == engine["max_model_len"]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["reference"]["by_speculative_tokens"]) == {"7", "3"}
    # Every K's runs, prompt by prompt, for the engines' acceptance on shared outputs.
    runs = json.loads((out / "reference.json").read_text())["by_speculative_tokens"]
    assert set(runs) == {"7", "3"}
    for k, per_prompt in runs.items():
        assert len(per_prompt) == len(prompts["prompts"])
        assert all(set(r["drafted_per_step"]) == {int(k)} for r in per_prompt)
    # Each place took the most decisive of its seeded windows; the recipe names how near a
    # tie each chosen completion came (prefix-a-again repeats prefix-a: one completion).
    choice = prompts["lossless_choice"]
    assert (choice["candidates"], choice["near_tie"]) == (3, 2**-3)
    distinct = [p for p in prompts["lossless"] if p["name"] != "prefix-a-again"]
    assert set(choice["near_ties"]) == {p["name"] for p in distinct}
    assert all(0 <= choice["near_ties"][p["name"]] <= p["max_new_tokens"] for p in distinct)
    floors = summary["floors"]
    assert floors["target_margin_positions"] == 2 * 16 + sum(p["max_new_tokens"] for p in distinct)
    # The acceptance prompts, which nobody chose for being decisive, meet the floor alone too.
    assert floors["acceptance_margin_positions"] == 2 * 16
    assert floors["floor_speculative_tokens"] == 3
    # transformers loads a qwen3_5 target's tokenizer as its own class; it must encode alike.
    assert summary["reload"]["tokenizer_roundtrip"] is True


def test_the_targets_time_cap_starts_after_its_first_step(hybrid_run: dict[str, Any]) -> None:
    out = hybrid_run["out"]
    summary = json.loads((out / "summary.json").read_text())
    target = summary["target"]
    # The first step (on a GPU, the kernels' compile) is timed apart and is one of the main
    # phase's steps; the cap's clock, main_phase_s, starts after it, so the two fit in the
    # phase's whole time (time_s, rounded to 0.01 s).
    assert target["first_step_s"] > 0
    assert target["steps"] == target["main_phase_steps"] == 3
    assert target["first_step_s"] + target["main_phase_s"] <= target["time_s"] + 0.005
    log = (out / "train.log").read_text()
    first = log.index("target: first step (kernel compile)")
    assert log.index("target: 3 steps of") < first < log.index("target step 3/3")
    # Triton decides whether flash-linear-attention's kernels train; the run names it.
    assert set(summary["versions"]) >= {"flash_linear_attention", "triton"}


def test_a_hybrid_target_short_of_its_floor_is_exit_22_and_no_pair(
    hybrid_run: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "pair"
    request = TrainRequest(
        preset="smoke",
        arch="hybrid",
        # Not decisive, so trained on after its first check, then refused. The extra time is
        # shorter than any greedy check: its clock starts after the first check (which
        # compiles the decoding kernels on a GPU), and a check that fails is followed by at
        # least one step, so a second check comes whatever the machine's speed.
        overrides=(
            *HYBRID_QUICK,
            "min_target_margin=100",
            "target_extra_time_s=0.001",
            "target_check_every_s=1",
        ),
        out_dir=out,
        export=tmp_path / "export",
    )
    with pytest.MonkeyPatch.context() as mp:
        for key in ("PYTHONPATH", "TOKENIZERS_PARALLELISM"):
            mp.setenv(key, hybrid_run["env"][key])
        with pytest.raises(TrainingError, match="median top-2 logit margin .* below the floor 100"):
            train_in(Path(hybrid_run["python"]), request)
    assert not out.exists() and not list(tmp_path.glob(".pair.tmp-*"))
    log = (tmp_path / "export" / "train.log").read_text()
    assert log.count("median greedy margin") >= 2 and "target floor" in log


def test_an_out_dir_holding_another_recipes_pair_is_neither_reused_nor_replaced(
    hybrid_run: dict[str, Any],
) -> None:
    out = hybrid_run["out"]
    before = (out / "summary.json").read_bytes()
    result = _train(
        "--python",
        hybrid_run["python"],
        "--preset",
        "smoke",
        "--arch",
        "hybrid",
        "--out-dir",
        str(out),
        *(f"--set={o}" for o in (*HYBRID_QUICK, "seed=1")),
    )
    assert result.exit_code == TrainSettingsError.exit_code
    assert "holds the pair of recipe" in result.stderr and "--force" in result.stderr
    assert (out / "summary.json").read_bytes() == before


def test_a_recipe_stopped_from_outside_leaves_no_run_folder(
    tmp_path: Path, probe_env: tuple[str, dict[str, str]]
) -> None:
    """``train_in`` stops its child with SIGTERM, as a GPU host's kill does: the run folder
    holding the weights written so far goes (it was left, hundreds of MB on the seed's
    recipe), and the exit says why."""
    python, env = probe_env
    runs = tmp_path / "runs"
    runs.mkdir()
    # A drafter phase long enough that the signal lands while the target's weights are
    # on disk and the drafter is training.
    slow = (*HYBRID_QUICK[:1], "drafter_steps=100000", "drafter_time_cap_s=900")
    slow += ("wall_budget_s=1800", "data_sequences=16", "num_prompts=2")
    command = [python, "-m", "tooling.trainer", "train", "--preset", "smoke", "--arch", "hybrid"]
    command += [f"--set={o}" for o in slow] + ["--out-dir", str(runs / "pair")]
    path = os.pathsep.join(p for p in (str(REPO_DIR), env.get("PYTHONPATH", "")) if p)
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as sink:
        child = subprocess.Popen(
            command, env={**env, "PYTHONPATH": path}, stdout=subprocess.DEVNULL, stderr=sink
        )
    try:
        wait_until(
            lambda: (
                any("drafter:" in log.read_text() for log in runs.glob(".pair.tmp-*/train.log"))
                and any(runs.glob(".pair.tmp-*/target/*.safetensors"))
            ),
            "the drafter's training",
            alive=child,
        )
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    err = stderr.read_text()
    assert child.returncode == 143, err[-2000:]
    assert err.rstrip().splitlines()[-1] == "error: interrupted (SIGTERM)"
    assert list(runs.iterdir()) == []
