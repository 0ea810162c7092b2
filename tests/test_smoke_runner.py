"""``run_smoke`` end to end against the stand-in ``vllm`` (no GPU here): the verdicts a fixed
and a stock build earn, how servers start, run in waves and stop, and what the run leaves."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from tooling.smoke import GpuFacts, SmokeConfig, Timeouts, describe_plan, format_table, run_smoke
from tooling.smoke.checks import FAIL, INFO, PASS, SKIP
from tooling.smoke.config import EngineSettings

from .smoke_runner_helpers import _config, standin_vllm_fixture  # noqa: F401 (fixture)


def test_fixed_build_passes_server_checks(tmp_path, standin_vllm, monkeypatch) -> None:
    monkeypatch.setenv("STANDIN_MODE", "fixed")
    messages: list[str] = []
    report = run_smoke(_config(tmp_path, *standin_vllm), notify=messages.append)
    status = {c.id: c.status for c in report.checks}
    assert status == {
        "lossless": PASS,
        "aux_layers": PASS,
        "drafter_windows": SKIP,
        "prefix_cache": PASS,
        "fidelity": SKIP,
        "acceptance": INFO,
        "warm_cache": SKIP,
        "slot_audit": SKIP,
        "concurrent_load": SKIP,
        "first_tokens": PASS,
    }
    assert report.passed
    assert report.vllm["version"] == "0.20.1+standin"
    prefix = next(c for c in report.checks if c.id == "prefix_cache")
    assert prefix.details["speculative"]["hits"] == 192
    assert prefix.details["speculative"]["cached_tokens"] == 192
    assert prefix.details["plain"]["hits"] == 192
    acceptance = next(c for c in report.checks if c.id == "acceptance")
    assert acceptance.details["acceptance_length"] == pytest.approx(1.25)
    # The plain engine's one-pass scoring lines up with its decode position by position (the
    # stand-in's logprobs are a function of the context alone, so they agree exactly).
    first = next(c for c in report.checks if c.id == "first_tokens")
    assert first.details["scored_noise"] == 0.0, first.evidence
    servers = [s for s in report.steps if s.name.startswith("serve")]
    assert [s.extra["stop"] for s in servers] == ["terminated", "terminated"]
    saved = json.loads((tmp_path / "smoke" / "report.json").read_text())
    assert saved["passed"] is True
    assert "Using auxiliary layers" in (tmp_path / "smoke/logs/serve-dflash.log").read_text()
    assert any("server ready" in m for m in messages)
    assert "smoke passed" in format_table(report)


def test_a_speculative_option_reaches_the_dflash_server_and_the_in_process_engines(
    tmp_path, standin_vllm, monkeypatch
) -> None:
    """``--speculative-option``'s keys reach every DFlash engine the smoke starts: the
    DFlash server's ``--speculative-config`` and each in-process engine's
    ``speculative_config`` (the first-token check's), each recorded by the stand-in."""
    monkeypatch.setenv("STANDIN_MODE", "fixed")
    specs = tmp_path / "specs.jsonl"
    monkeypatch.setenv("STANDIN_SPECS", str(specs))
    engine = EngineSettings(speculative_options=(("dflash_full_cudagraphs", True),))
    report = run_smoke(_config(tmp_path, *standin_vllm, engine=engine), notify=lambda m: None)
    assert report.passed
    seen = [json.loads(line) for line in specs.read_text().splitlines()]
    assert {s["by"] for s in seen} == {"serve", "LLM"}
    assert all(s["dflash_full_cudagraphs"] is True for s in seen), seen
    assert all(s["method"] == "dflash" and s["num_speculative_tokens"] == 3 for s in seen)


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_starts_both_servers_first_and_stops_both(
    tmp_path, standin_vllm, monkeypatch, overlap
) -> None:
    monkeypatch.setenv("STANDIN_MODE", "fixed")
    pids = tmp_path / "pids"
    monkeypatch.setenv("STANDIN_PIDS", str(pids))
    config = _config(tmp_path, *standin_vllm, overlap_engines=overlap)
    report = run_smoke(config, notify=lambda m: None)
    assert report.passed
    # Overlapped: both servers were up before the first took a request; in turn:
    # the server with the drafter was alone, then the plain one after it stopped.
    seen = [line.split() for line in Path(f"{pids}.seen").read_text().splitlines()]
    assert [int(n) for _, n in seen] == ([2, 2] if overlap else [1, 2])
    servers = [s for s in report.steps if s.name.startswith("serve")]
    assert [s.extra["stop"] for s in servers] == ["terminated", "terminated"]
    # Each step says when it began in the run, on the clock of its duration: the servers'
    # requests are taken in turn either way, the plain server's after the other's stop.
    assert all(s.started_s is not None and s.started_s >= 0 for s in report.steps)
    dflash, plain = sorted(servers, key=lambda s: s.name != "serve with DFlash")
    assert plain.started_s >= dflash.started_s + dflash.seconds
    for pid in map(int, pids.read_text().split()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # Every engine gets a fixed KV cache: engines sharing a GPU cannot profile its memory.
    assert report.engine["kv_cache_memory_bytes"] == 4 << 30
    for log in ("serve-dflash.log", "serve-plain.log"):
        command = (tmp_path / "smoke" / "logs" / log).read_text().splitlines()[0]
        assert "--kv-cache-memory-bytes 4294967296" in command


def test_stock_build_fails_fix_checks_but_stays_lossless(tmp_path, standin_vllm, monkeypatch):
    monkeypatch.setenv("STANDIN_MODE", "stock")
    report = run_smoke(
        _config(tmp_path, *standin_vllm, min_acceptance_length=1.5), notify=lambda m: None
    )
    status = {c.id: c.status for c in report.checks}
    assert status["lossless"] == PASS
    assert status["aux_layers"] == FAIL
    assert status["prefix_cache"] == FAIL
    assert status["acceptance"] == FAIL  # 1.25 < 1.5
    assert not report.passed
    assert "2 aux_layers (fail)" in report.summary_line()


# Waits out a real time limit (seconds of wall time): the slow tier.
@pytest.mark.slow
def test_spent_time_limit_still_writes_the_report_and_stops_servers(
    tmp_path, standin_vllm, monkeypatch
) -> None:
    monkeypatch.setenv("STANDIN_MODE", "fixed")
    # The server never answers: the run ends only because the overall limit does.
    monkeypatch.setenv("STANDIN_DELAY", "3600")
    pids = tmp_path / "pids"
    monkeypatch.setenv("STANDIN_PIDS", str(pids))
    config = _config(tmp_path, *standin_vllm)
    config = SmokeConfig(
        **{
            **config.__dict__,
            "timeouts": Timeouts(total=6, server_start=3600, request=10, server_stop=1),
        }
    )
    report = run_smoke(config, notify=lambda m: None)
    assert not report.passed
    saved = json.loads((tmp_path / "smoke" / "report.json").read_text())
    assert saved["passed"] is False
    servers = {s.name: s for s in report.steps if s.name.startswith("serve")}
    assert not servers["serve with DFlash"].ok
    assert "time limit is spent" in servers["serve without speculation"].message
    # The slow servers were started (side by side), then stopped with their whole groups.
    started = [int(line) for line in pids.read_text().split()]
    assert len(started) == 2
    for pid in started:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_run_executes_the_plan_a_dry_run_prints(tmp_path, standin_vllm, monkeypatch):
    """``--dry-run`` and the run make one plan object: the run reports what it executed."""
    monkeypatch.setenv("STANDIN_MODE", "fixed")
    config = _config(tmp_path, *standin_vllm)
    planned = describe_plan(config).to_json()
    report = run_smoke(config, notify=lambda m: None)
    assert report.to_json()["plan"] == planned
    assert planned["gpus"] == {"count": 1, "total_gib": 140.0}
    # The steps it recorded are the plan's, in its order (the preflight and models first).
    ran = [s.name for s in report.steps if s.name not in ("preflight", "models")]
    assert ran == [s["step"] for s in planned["steps"]]


def test_the_users_model_folders_are_never_written(tmp_path, standin_vllm, monkeypatch):
    monkeypatch.setenv("STANDIN_MODE", "fixed")

    def snapshot() -> dict[str, tuple[int, int]]:
        return {
            str(p): (p.stat().st_size, p.stat().st_mtime_ns)
            for folder in standin_vllm
            for p in [folder, *folder.rglob("*")]
        }

    before = snapshot()
    for folder in standin_vllm:
        for path in [*folder.rglob("*"), folder]:
            path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        report = run_smoke(_config(tmp_path, *standin_vllm), notify=lambda m: None)
    finally:
        for folder in standin_vllm:
            for path in [folder, *folder.rglob("*")]:
                path.chmod(0o755 if path.is_dir() else 0o644)
    assert report.passed
    assert snapshot() == before


def test_engines_that_do_not_fit_together_run_in_waves_on_their_gpus(
    tmp_path, standin_vllm, monkeypatch
) -> None:
    """Two GPUs that each hold one engine: the servers first, one a GPU, then the
    first-token engines; each process sees only the GPU the plan gave it."""
    monkeypatch.setenv("STANDIN_MODE", "fixed")
    monkeypatch.setenv("STANDIN_GPUS", "2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    pids = tmp_path / "pids"
    monkeypatch.setenv("STANDIN_PIDS", str(pids))
    config = replace(_config(tmp_path, *standin_vllm), gpus=GpuFacts(2, 8 * 2**30))
    report = run_smoke(config, notify=lambda m: None)
    assert report.passed, report.summary_line()
    plan = report.to_json()["plan"]
    assert plan["layout"] == "one after another"
    assert [(s["step"], s["wave"], s["gpus"]) for s in plan["steps"]] == [
        ("serve with DFlash", 1, [0]),
        ("serve without speculation", 1, [1]),
        ("first tokens with DFlash", 2, [0]),
        ("first tokens without speculation", 2, [1]),
    ]
    logs = tmp_path / "smoke" / "logs"
    assert "CUDA_VISIBLE_DEVICES=0" in (logs / "serve-dflash.log").read_text()
    assert "CUDA_VISIBLE_DEVICES=1" in (logs / "serve-plain.log").read_text()
    # Both servers were up before the first took a request: one wave.
    seen = [line.split() for line in Path(f"{pids}.seen").read_text().splitlines()]
    assert [int(n) for _, n in seen] == [2, 2]


def test_a_run_in_waves_leaves_the_verdicts_each_wave_reached(
    tmp_path, standin_vllm, monkeypatch
) -> None:
    """A run longer than the session it runs in (the seed's width: one engine a wave) keeps
    what its finished waves decided: after each wave but the last, report.json holds those
    verdicts, the checks still waiting marked pending, and it never reads as a pass. An
    earlier run's report is gone once this one starts."""
    monkeypatch.setenv("STANDIN_MODE", "fixed")
    monkeypatch.setenv("STANDIN_GPUS", "2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = replace(_config(tmp_path, *standin_vllm), gpus=GpuFacts(2, 8 * 2**30))
    path = tmp_path / "smoke" / "report.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"passed": True}))
    seen: dict[str, dict | None] = {}

    def notify(message: str) -> None:
        for step in ("serve with DFlash", "first tokens with DFlash"):
            if message == f"{step} ..." and step not in seen:
                seen[step] = json.loads(path.read_text()) if path.exists() else None

    report = run_smoke(config, notify=notify)
    assert seen["serve with DFlash"] is None
    partial = seen["first tokens with DFlash"]
    assert partial is not None
    assert (partial["passed"], partial["complete"]) == (False, False)
    assert partial["incomplete"] == "wave 1 of 2 done"
    status = {c["id"]: c["status"] for c in partial["checks"]}
    # The servers' checks are decided; what reads the first-token engines waits for them.
    assert status["prefix_cache"] == status["aux_layers"] == "pass"
    assert status["first_tokens"] == status["lossless"] == "pending"
    pending = {c["id"]: c["evidence"] for c in partial["checks"] if c["status"] == "pending"}
    assert pending["first_tokens"] == (
        "waits for first tokens with DFlash, first tokens without speculation"
    )
    assert partial["summary"].startswith("smoke incomplete, wave 1 of 2 done: so far ")
    assert "2 pass, 3 skip, 4 pass" in partial["summary"]
    assert partial["summary"].split(";")[1].startswith(" pending 1, 10 (report: ")
    # The end of the run replaces it with the whole verdict.
    final = json.loads(path.read_text())
    assert report.passed and (final["passed"], final["complete"]) == (True, True)
    assert not any(c["status"] == "pending" for c in final["checks"])
