"""``tooling host``'s fuzz steps: each campaign's pair, seed and options, and the referee that
settles its lossless findings with the noise this host measured, so a finding is judged on its
own card."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tooling.host.session import STEPS

from .helpers import run_gpu_script


def test_the_fuzz_steps_campaigns_draw_a_new_seed_each_day() -> None:
    import time

    from tooling.host.session import FUZZ_ARGS, fuzz_args

    day = time.strptime("2026-12-05", "%Y-%m-%d")
    args = fuzz_args(day)
    assert args[: len(FUZZ_ARGS)] == FUZZ_ARGS
    assert args[-2:] == ("--seed", "20261205")
    assert fuzz_args(time.strptime("2026-12-06", "%Y-%m-%d"))[-1] != args[-1]


def test_each_fuzz_step_names_its_pair_and_its_campaigns_options() -> None:
    """``fuzz-seed`` draws on the seed-shaped pair in noise mode, ``fuzz-trained`` on the
    trained pair, lossless and held to the recipe's reference acceptance, ``fuzz-replay``
    serves every kept GPU case again on the seed-shaped pair; a replay with no case is
    refused before anything starts."""
    import time

    from tooling.errors import HostStepError
    from tooling.host.session import FUZZ_NOISE, GPU_CASES, fuzz_args, fuzz_settings

    day = time.strptime("2026-12-05", "%Y-%m-%d")
    assert fuzz_settings("seed", day) == ("seed", fuzz_settings("seed", day)[1])
    which, seed = fuzz_settings("seed", day)
    assert (which, seed.noise, seed.args) == ("seed", FUZZ_NOISE, fuzz_args(day))
    which, trained = fuzz_settings("trained", day, reference=4.2834)
    assert which == "trained" and trained.noise is None
    assert trained.args == (*fuzz_args(day), "--reference-acceptance", "4.283")
    assert "--reference-acceptance" not in fuzz_settings("trained", day)[1].args
    kept = tuple(sorted(GPU_CASES.glob("*.json")))
    assert kept, "the crash the GPU fuzzer found is kept"
    which, replay = fuzz_settings("replay", day, cases=kept)
    assert which == "seed" and replay.noise == FUZZ_NOISE and "--seed" not in replay.args
    assert [replay.args[i + 1] for i, a in enumerate(replay.args) if a == "--replay"] == [
        str(c) for c in kept
    ]
    with pytest.raises(HostStepError, match="no kept GPU case"):
        fuzz_settings("replay", day)
    assert {STEPS[s].variant for s in ("fuzz-seed", "fuzz-trained", "fuzz-replay")} == {
        "seed",
        "trained",
        "replay",
    }


def test_the_referee_rules_with_the_noise_this_hosts_trained_call_measured(tmp_path):
    """The plain engine's own noise between one at a time and at once, from the trained
    call's figures on this host, where it is more than the referee's default: bf16 rounds
    differently on another card. Less, none measured, or figures that are not a run's: the
    default."""
    from tooling.fuzzing.referee import NOISE
    from tooling.host.fuzz import session_noise
    from tooling.host.layout import Layout

    layout = Layout(tmp_path / "work")
    assert session_noise(layout)[0] == NOISE
    layout.runs.mkdir(parents=True)
    figures = layout.runs / "plain.out.json"

    def completion(token: int, second: float) -> dict:
        # The two batch shapes part at position 1: each side's top-2 margin there counts.
        return {
            "tokens": [5, token],
            "logprobs": [{"5": -0.1, "6": -3.0}, {str(token): -1.0, "9": -1.0 - second}],
            "finish_reason": "length",
        }

    def write(ok: bool, second: float) -> None:
        runs = {"1": {"completions": [completion(7, second)]}}
        runs["16"] = {"completions": [completion(8, second)]}
        figures.write_text(json.dumps({"ok": ok, "acceptance": runs}))

    write(True, 0.03125)
    noise, source = session_noise(layout)
    assert noise == 0.0625 > NOISE and str(figures) in source
    write(True, 0.0078125)
    assert session_noise(layout)[0] == NOISE
    write(False, 0.03125)
    assert session_noise(layout)[0] == NOISE
    figures.write_text("[1, 2]")
    assert session_noise(layout)[0] == NOISE
    figures.write_text("not json")
    assert session_noise(layout)[0] == NOISE


def test_the_fuzz_step_settles_its_lossless_findings_with_the_referee(tmp_path, monkeypatch):
    """After a campaign on the trained pair, ``tooling fuzz referee`` (real) runs on its
    lossless findings, into a text of its own: here with an interpreter without torch, its
    one line and exit 32; a campaign with no lossless finding runs no referee."""
    import os

    from tooling.fuzzing.gpu_case import (
        GpuCase,
        GpuCaseFile,
        GpuReq,
        GpuSettings,
        write_gpu_case_file,
    )
    from tooling.fuzzing.gpu_oracles import Evidence
    from tooling.host.fuzz import settle
    from tooling.host.layout import Layout

    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    layout = Layout(tmp_path / "work")
    folder, pair = tmp_path / "fuzz-patched-trained", tmp_path / "pair"
    folder.mkdir()
    (pair / "target").mkdir(parents=True)
    (pair / "target" / "config.json").write_text("{}")
    report = tmp_path / "referee.txt"
    assert settle(layout, folder, pair, report, "") is None and not report.exists()
    case = GpuCase(GpuSettings(k=3), (GpuReq(0, 4, 2),))
    evidence = Evidence("r0", (300, 301, 302, 303), (), 9, 8, ((8, -0.25), (9, -0.5)))
    finding = GpuCaseFile(case, "lossless", "r0 position 0", "", (), (evidence,))
    write_gpu_case_file(folder / "finding-lossless-0-0.json", finding)
    # The scheduler side saved beside a finding is no finding: the referee would refuse it.
    (folder / "finding-lossless-0-0.scheduler.json").write_text("{}")
    assert settle(layout, folder, pair, report, "") == 32
    (line,) = report.read_text().strip().splitlines()
    assert "cannot import torch" in line


def test_the_full_width_campaign_serves_its_engines_one_at_a_time_on_an_h100(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fuzz-seed-full``: the seed's pair at full width in noise mode at this width's plain
    noise, the fixed wheel's campaign alone, one engine pair with small KV caches that draws
    workloads once its 27B-sized engines have started, the day's seed. An H200 holds both
    engines at once; on an H100 they serve one after the other, each within a shorter limit;
    a GPU too small for one of them is refused in one line before anything is drawn."""
    import stat
    import time

    from tooling.errors import HostStepError
    from tooling.host.fuzz import NOISY, PAIRS
    from tooling.host.session import (
        FULL_ENGINES,
        FULL_KV_GIB,
        FULL_NOISE,
        FULL_ONE_PAIR_S,
        FULL_PAIR_S,
        fuzz_settings,
    )
    from tooling.host.speed import ONE_WIDE_GPU_GIB, WIDE_GPU_GIB
    from tooling.trained.gpu_fit import gpu_memory_gib

    day = time.strptime("2026-12-06", "%Y-%m-%d")
    # nvidia-smi's answers, MiB: one H200 (141 GB), one H100 (80 GB), one A100 (40 GB).
    tool = tmp_path / "bin" / "nvidia-smi"
    tool.parent.mkdir()
    monkeypatch.setenv("PATH", f"{tool.parent}:{os.environ['PATH']}")

    def on(mib: int) -> float | None:
        tool.write_text(f"#!/bin/sh\necho {mib}\n")
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
        return gpu_memory_gib()

    h200, h100, a100 = on(143771), on(81559), on(40960)
    assert h200 is not None and h100 is not None and a100 is not None
    assert h200 >= WIDE_GPU_GIB > h100 >= ONE_WIDE_GPU_GIB > a100
    for gib, limit, alone in ((h200, FULL_PAIR_S, False), (h100, FULL_ONE_PAIR_S, True)):
        which, full = fuzz_settings("seed-full", day, gpu_gib=gib)
        assert which == "seed-full" and which in PAIRS and which in NOISY
        assert full.noise == FULL_NOISE
        value = {full.args[i]: full.args[i + 1] for i in range(len(full.args) - 1)}
        assert value["--kv-cache-memory-bytes"] == str(FULL_KV_GIB << 30)
        assert value["--settings"] == "1" and value["--seed"] == "20261206"
        assert full.args.count("--pair-seconds") == 1 and int(value["--pair-seconds"]) == limit
        assert ("--one-engine-at-a-time" in full.args) is alone
    # Workloads are drawn until the limit less 300 s; the engines' start takes 250. One at a
    # time, both engines' limits fit one session's 1800 device seconds with its staging.
    assert FULL_PAIR_S - 300 >= 250 + 300 and FULL_ONE_PAIR_S - 300 >= 250 + 150
    assert 2 * FULL_ONE_PAIR_S + 250 <= 1800
    assert FULL_ENGINES == ("patched",)
    assert STEPS["fuzz-seed-full"].variant == "seed-full"
    with pytest.raises(HostStepError, match=f"needs a GPU of {ONE_WIDE_GPU_GIB} GiB or more"):
        fuzz_settings("seed-full", day, gpu_gib=a100)


def test_the_host_fuzz_command_needs_the_noise_of_a_random_weight_pair(tmp_path: Path) -> None:
    done = run_gpu_script("gpu-fuzz.sh", "patched", "seed-full", work=tmp_path, out=tmp_path)
    assert done.returncode == 2 and "NOISE" in done.stderr and len(done.stderr.splitlines()) == 1
