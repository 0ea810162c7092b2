"""Runs that cannot start or finish are refused in one line with their own exit code,
before any server starts where they can be."""

from __future__ import annotations

import json
import os
import re

import pytest

from tooling.errors import SmokeCapacityError, SmokeError, exit_code_for
from tooling.smoke import EngineSettings, GpuFacts, SmokeConfig, describe_plan, run_smoke

from .smoke_runner_helpers import _config, standin_vllm_fixture  # noqa: F401 (fixture)


@pytest.mark.parametrize(
    ("env", "kw", "message"),
    [
        ({"STANDIN_GPUS": "0"}, {}, "no CUDA GPU is visible to"),
        (
            {"STANDIN_FREE_GIB": "20"},
            {},
            "GPU 0 has 20.0 GiB free of 140.0 GiB; vLLM needs --gpu-memory-utilization 0.3",
        ),
        ({}, {"run_fidelity": True}, "the reference package dflash does not import for"),
    ],
)
def test_preflight_stops_a_run_that_cannot_start_in_one_line(
    tmp_path, standin_vllm, monkeypatch, env, kw, message
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    from dataclasses import replace

    config = _config(tmp_path, *standin_vllm)
    engine = replace(config.engine, **{k: v for k, v in kw.items() if k != "run_fidelity"})
    config = replace(config, engine=engine, run_fidelity=kw.get("run_fidelity", False))
    with pytest.raises(SmokeError, match=re.escape(message)) as raised:
        run_smoke(config, notify=lambda m: None)
    assert "\n" not in str(raised.value) and "vllm-import.log" in str(raised.value)
    # Nothing was started: no server log.
    assert not (tmp_path / "smoke" / "logs" / "serve-dflash.log").exists()


def test_fewer_gpus_than_the_tensor_parallel_size_is_exit_24_as_in_a_dry_run(
    tmp_path, standin_vllm
) -> None:
    from dataclasses import replace

    config = _config(tmp_path, *standin_vllm)
    config = replace(config, engine=replace(config.engine, tensor_parallel_size=2))
    needs = "--tensor-parallel-size 2 needs 2 GPUs; 1 visible"
    with pytest.raises(SmokeCapacityError, match=needs):
        run_smoke(config, notify=lambda m: None)
    assert not (tmp_path / "smoke" / "logs" / "serve-dflash.log").exists()


def test_a_generated_pair_the_disk_cannot_hold_is_exit_24_before_anything_is_written(
    tmp_path,
) -> None:
    # The seed-shaped pair at a width no disk holds (terabytes of weights): a dry run and a
    # run both name the figures in one line, and neither creates the workdir.
    config = SmokeConfig(
        workdir=tmp_path / "smoke",
        tiny=True,
        tiny_arch="seed",
        tiny_hidden_size=65536,
        engine=EngineSettings(num_speculative_tokens=15),
        gpus=GpuFacts(1, 141 * 2**30),
    )
    for attempt in (describe_plan, lambda c: run_smoke(c, notify=lambda m: None)):
        with pytest.raises(SmokeCapacityError) as refused:
            attempt(config)
        message = str(refused.value)
        assert message.startswith(f"{tmp_path / 'smoke' / 'models'}: the generated pair needs ")
        assert "GiB of weights, 2 for logs and caches); " in message
        assert message.endswith(" GiB free there") and "\n" not in message
        assert exit_code_for(refused.value) == 24
        assert not (tmp_path / "smoke").exists()


def test_no_vllm_is_one_clear_error(tmp_path, standin_vllm, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "empty"))
    config = _config(tmp_path, *standin_vllm)
    with pytest.raises(SmokeError, match="cannot import vllm"):
        run_smoke(config, notify=lambda m: None)


@pytest.mark.parametrize(
    ("edit", "code", "message"),
    [
        ("gpus", 24, "serve with DFlash needs"),
        ("dflash_config", 23, "the drafter has no dflash_config: not a DFlash drafter"),
        ("architectures", 23, "name no causal LM"),
    ],
)
def test_bad_input_is_one_line_with_its_own_exit_code(
    tmp_path, standin_vllm, edit, code, message
) -> None:
    from click.testing import CliRunner

    from tooling.cli import main

    target, drafter = standin_vllm
    args = ["--no-progress", "smoke", "--target", str(target), "--drafter", str(drafter)]
    args += ["--workdir", str(tmp_path / "w"), "--gpus", "1x141"]
    if edit == "gpus":
        args[-1] = "1x4"  # each engine needs at least its 4 GiB KV cache and working memory
    else:
        folder = drafter if edit == "dflash_config" else target
        data = json.loads((folder / "config.json").read_text())
        data[edit] = None if edit == "dflash_config" else ["Qwen3Model"]
        (folder / "config.json").write_text(json.dumps(data))
    result = CliRunner().invoke(main, args)
    assert result.exit_code == code, result.output
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1
    # Refused before anything started: no preflight, no server.
    assert not (tmp_path / "w" / "logs").exists()


def test_a_child_past_its_limit_is_named_as_timed_out_not_as_an_exit(tmp_path) -> None:
    """The limit's message, not the exit status the stop gave the killed child."""
    from tooling.smoke.run_state import SmokeRun as _Run

    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(60)\n")
    run = _Run(SmokeConfig(workdir=tmp_path / "w", tiny=True), notify=lambda _: None)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    log = tmp_path / "sleeper.log"
    with pytest.raises(SmokeError) as e:
        run.child("sleeper", [], log=log, timeout_s=1, env=env)
    assert str(e.value) == f"sleeper did not finish within 1s (log: {log})"
