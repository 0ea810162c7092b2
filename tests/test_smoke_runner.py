"""``run_smoke`` end to end against a stand-in ``vllm`` package (no GPU here).

The stand-in is a real ``python -m vllm.entrypoints.cli.main serve`` on the
child's PYTHONPATH: it parses the same flags, prints vLLM's aux-layer log
line, and serves /health, /tokenize, /v1/completions and a Prometheus
/metrics whose counters follow vLLM 0.20.1's names. STANDIN_MODE=stock makes
it behave like stock 0.20.1 (raw aux ids, one cached block dropped with
DFlash); ``fixed`` like the patched build. What is under test is the runner:
ports, start-up, requests, metric deltas, log scanning, verdicts, stopping.
The in-process fidelity run needs a GPU and is switched off here.
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from tooling.errors import SmokeError
from tooling.smoke import SmokeConfig, Timeouts, describe_plan, format_table, run_smoke
from tooling.smoke.checks import FAIL, INFO, PASS, SKIP

STANDIN_MAIN = textwrap.dedent(
    """
    import argparse, http.server, json, os, sys, time

    parser = argparse.ArgumentParser()
    parser.add_argument("command")
    parser.add_argument("model")
    for flag in ("--host", "--port", "--served-model-name", "--attention-backend",
                 "--max-model-len", "--gpu-memory-utilization", "--seed", "--block-size",
                 "--kv-cache-dtype", "--tensor-parallel-size", "--max-num-seqs",
                 "--kv-cache-memory-bytes", "--generation-config", "--speculative-config"):
        parser.add_argument(flag)
    for flag in ("--enable-prompt-tokens-details", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--enforce-eager",
                 "--language-model-only"):
        parser.add_argument(flag, action="store_true")
    args = parser.parse_args()

    if os.environ.get("STANDIN_PIDS"):
        with open(os.environ["STANDIN_PIDS"], "a") as f:
            f.write(f"{os.getpid()}\\n")
    # A slow start (compiling), before anything listens.
    time.sleep(float(os.environ.get("STANDIN_DELAY", "0")))
    stock = os.environ.get("STANDIN_MODE") == "stock"
    block = int(args.block_size)
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    print("INFO vLLM API server version stand-in", flush=True)
    if spec:
        ids = json.load(open(os.path.join(spec["model"], "config.json")))
        ids = ids["dflash_config"]["target_layer_ids"]
        aux = tuple(ids) if stock else tuple(i + 1 for i in ids)
        print(f"(EngineCore_DP0 pid=1) INFO [gpu_model_runner.py:4840] "
              f"Using auxiliary layers from speculative config: {aux}", flush=True)
    state = {"queries": 0, "hits": 0, "drafts": 0, "accepted": 0, "seen": set()}

    def tokenize(text):
        return [1 + (ord(c) % 1000) for c in text]

    def metrics():
        name = args.served_model_name
        lines = [
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries.",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f'vllm:prefix_cache_queries_total{{engine="0",model_name="{name}"}} '
            f"{float(state['queries'])}",
            f'vllm:prefix_cache_hits_total{{engine="0",model_name="{name}"}} '
            f"{float(state['hits'])}",
        ]
        if spec:
            k = spec["num_speculative_tokens"]
            lines += [
                f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="{name}"}} '
                f"{float(state['drafts'])}",
                f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="{name}"}} '
                f"{float(state['drafts'] * k)}",
                f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="{name}"}} '
                f"{float(state['accepted'])}",
            ] + [
                f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",'
                f'model_name="{name}",position="{p}"}} {float(state["accepted"] if p == 0 else 0)}'
                for p in range(k)
            ]
        return "\\n".join(lines) + "\\n"

    class Handler(http.server.BaseHTTPRequestHandler):
        def _send(self, code, body, kind="application/json"):
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, "")
            elif self.path == "/metrics":
                self._send(200, metrics(), "text/plain")
            else:
                self._send(404, {"error": "no"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/tokenize":
                tokens = tokenize(body["prompt"])
                self._send(200, {"count": len(tokens), "max_model_len": 1024, "tokens": tokens})
                return
            prompt = body["prompt"]
            ids = prompt if isinstance(prompt, list) else tokenize(prompt)
            if os.environ.get("STANDIN_PIDS") and not state.get("noted"):
                # How many servers the runner had started by this server's first request:
                # it writes each server's log (its command line) before starting it, so
                # the count does not depend on how far the other interpreter has got.
                state["noted"] = True
                logs = os.path.dirname(os.readlink("/proc/self/fd/1"))  # this server's log
                started = len([n for n in os.listdir(logs) if n.startswith("serve-")])
                with open(os.environ["STANDIN_PIDS"] + ".seen", "a") as f:
                    f.write(f"{os.getpid()} {started}\\n")
            hits = 0
            if args.enable_prefix_caching and tuple(ids) in state["seen"]:
                hits = ((len(ids) - 1) // block) * block
                if spec and stock:
                    hits -= block
            state["seen"].add(tuple(ids))
            state["queries"] += len(ids)
            state["hits"] += hits
            out = [(sum(ids) * 31 + 7 * i) % 997 for i in range(body["max_tokens"])]
            if spec:
                state["drafts"] += body["max_tokens"]
                state["accepted"] += body["max_tokens"] // 4
            self._send(200, {
                "id": "cmpl-standin", "object": "text_completion", "model": body["model"],
                "choices": [{"index": 0, "text": " ".join(map(str, out)),
                             "finish_reason": "length", "token_ids": out}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out),
                          "total_tokens": len(ids) + len(out),
                          "prompt_tokens_details": {"cached_tokens": hits}},
            })

        def log_message(self, *a):
            pass

    http.server.ThreadingHTTPServer((args.host, int(args.port)), Handler).serve_forever()
    """
)

STANDIN_TORCH = textwrap.dedent(
    """
    import os

    class cuda:
        @staticmethod
        def device_count():
            return int(os.environ.get("STANDIN_GPUS", "1"))

        @staticmethod
        def mem_get_info(i):
            return (int(float(os.environ.get("STANDIN_FREE_GIB", "139")) * 2**30), 140 * 2**30)
    """
)

DRAFTER_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "num_hidden_layers": 3,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "sliding_window": 16,
    "use_sliding_window": True,
    "dflash_config": {"target_layer_ids": [1, 3, 5], "mask_token_id": 2047, "block_size": 4},
}


@pytest.fixture
def standin_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    root = tmp_path / "site"
    cli = root / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text('__version__ = "0.20.1+standin"\n')
    (root / "vllm" / "entrypoints" / "__init__.py").write_text("")
    (cli / "__init__.py").write_text("")
    (cli / "main.py").write_text(STANDIN_MAIN)
    # The GPU as the preflight asks torch for it: STANDIN_GPUS devices with
    # STANDIN_FREE_GIB of 140 GiB free each.
    (root / "torch").mkdir()
    (root / "torch" / "__init__.py").write_text(STANDIN_TORCH)
    monkeypatch.setenv("PYTHONPATH", str(root))
    target = tmp_path / "models" / "target"
    drafter = tmp_path / "models" / "drafter"
    target.mkdir(parents=True)
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text(json.dumps(DRAFTER_CONFIG))
    (target / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    return target, drafter


def _config(tmp_path: Path, target: Path, drafter: Path, **kw) -> SmokeConfig:
    return SmokeConfig(
        workdir=tmp_path / "smoke",
        target=str(target),
        drafter=str(drafter),
        python=sys.executable,
        run_fidelity=False,
        plot=False,
        # Guards against a hang only, never reached by a stand-in on a loaded machine: a
        # verdict here must not depend on how fast the interpreters start.
        timeouts=Timeouts(total=600, server_start=300, request=120, server_stop=10),
        load=False,
        **kw,
    )


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
    }
    assert report.passed
    assert report.vllm["version"] == "0.20.1+standin"
    prefix = next(c for c in report.checks if c.id == "prefix_cache")
    assert prefix.details["speculative"]["hits"] == 192
    assert prefix.details["speculative"]["cached_tokens"] == 192
    assert prefix.details["plain"]["hits"] == 192
    acceptance = next(c for c in report.checks if c.id == "acceptance")
    assert acceptance.details["acceptance_length"] == pytest.approx(1.25)
    servers = [s for s in report.steps if s.name.startswith("serve")]
    assert [s.extra["stop"] for s in servers] == ["terminated", "terminated"]
    saved = json.loads((tmp_path / "smoke" / "report.json").read_text())
    assert saved["passed"] is True
    assert "Using auxiliary layers" in (tmp_path / "smoke/logs/serve-dflash.log").read_text()
    assert any("server ready" in m for m in messages)
    assert "smoke passed" in format_table(report)


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
    for pid in map(int, pids.read_text().split()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # Overlapping engines share a GPU: each gets a fixed KV cache.
    assert (report.engine["kv_cache_memory_bytes"] is not None) == overlap
    for log in ("serve-dflash.log", "serve-plain.log"):
        command = (tmp_path / "smoke" / "logs" / log).read_text().splitlines()[0]
        assert ("--kv-cache-memory-bytes" in command) == overlap


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
    # The slow server was started, then stopped with its whole group.
    (pid,) = [int(line) for line in pids.read_text().split()]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.parametrize(
    ("env", "kw", "message"),
    [
        ({"STANDIN_GPUS": "0"}, {}, "no CUDA GPU is visible to"),
        (
            {"STANDIN_FREE_GIB": "20"},
            {},
            "GPU 0 has 20.0 GiB free of 140.0 GiB; vLLM needs --gpu-memory-utilization 0.3",
        ),
        ({}, {"tensor_parallel_size": 2}, "--tensor-parallel-size 2 needs 2 GPUs; 1 visible"),
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


def test_no_vllm_is_one_clear_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "empty"))
    drafter = tmp_path / "d"
    drafter.mkdir()
    config = _config(tmp_path, tmp_path, drafter)
    with pytest.raises(SmokeError, match="cannot import vllm"):
        run_smoke(config, notify=lambda m: None)


def test_dry_run_plan_lists_every_process(tmp_path) -> None:
    plan = describe_plan(SmokeConfig(workdir=tmp_path, tiny=True, python="/usr/bin/python3"))
    steps = [s["step"] for s in plan["steps"]]
    # --tiny: both servers start first, to compile while the in-process engine runs,
    # and the reference's four children load meanwhile, then wait for its proposals.
    assert steps == [
        "models",
        "serve with DFlash",
        "serve without speculation",
        "reference comparison (engine)",
        "in-process engine (engine)",
    ]
    assert plan["steps"][3]["processes"] == 4 and plan["steps"][3]["loads_before_the_engine"]
    config = SmokeConfig(workdir=tmp_path, tiny=True, overlap_engines=False)
    serial = describe_plan(config)["steps"]
    assert [s["step"] for s in serial][1:] == [
        "in-process engine (engine)",
        "serve with DFlash",
        "serve without speculation",
        "reference comparison (engine)",
    ]
    # One reference process, once the servers are gone: it loads a second target.
    assert serial[-1]["processes"] == 1 and not serial[-1]["loads_before_the_engine"]
    assert all(s["argv"][0] == "/usr/bin/python3" for s in plan["steps"])
    assert plan["steps"][0]["argv"][-2:] == ["--arch", "hybrid"]
    assert "--speculative-config" in plan["steps"][1]["argv"]
    assert "--speculative-config" not in plan["steps"][2]["argv"]
    # Compiled graphs unless asked: vLLM's own default.
    assert "--enforce-eager" not in plan["steps"][1]["argv"]


def test_warm_cache_plan_and_its_one_line_errors(tmp_path) -> None:
    with pytest.raises(SmokeError, match="needs another build"):
        SmokeConfig(workdir=tmp_path, tiny=True, warm_cache=True).validate()
    with pytest.raises(SmokeError, match="no vllm package"):
        SmokeConfig(
            workdir=tmp_path, tiny=True, warm_cache=True, other_site=str(tmp_path)
        ).validate()
    site = tmp_path / "stock"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    config = SmokeConfig(workdir=tmp_path, tiny=True, warm_cache=True, other_site=str(site))
    steps = [s["step"] for s in describe_plan(config)["steps"]]
    # The warm-cache runs come first: that check is what such a run is for.
    assert steps[:5] == [
        "models",
        "reference comparison (warm-A)",
        "in-process engine (warm-A)",
        "reference comparison (warm-B)",
        "in-process engine (warm-B)",
    ]
    assert steps[-2:] == ["reference comparison (engine)", "in-process engine (engine)"]


def test_a_child_past_its_limit_is_named_as_timed_out_not_as_an_exit(tmp_path) -> None:
    """The limit's message, not the exit status the stop gave the killed child."""
    from tooling.smoke.runner import _Run

    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(60)\n")
    run = _Run(SmokeConfig(workdir=tmp_path / "w", tiny=True), notify=lambda _: None)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    log = tmp_path / "sleeper.log"
    with pytest.raises(SmokeError) as e:
        run.child("sleeper", [], log=log, timeout_s=1, env=env)
    assert str(e.value) == f"sleeper did not finish within 1s (log: {log})"


def test_model_architectures_are_the_pairs_classes(tmp_path) -> None:
    from tooling.smoke.runner import model_architectures

    tiny = SmokeConfig(workdir=tmp_path, tiny=True)
    assert model_architectures(tiny) == ["Qwen3_5ForConditionalGeneration", "DFlashDraftModel"]
    assert model_architectures(replace(tiny, tiny_arch="qwen3"))[0] == "Qwen3ForCausalLM"
    target, drafter = tmp_path / "t", tmp_path / "d"
    for folder, arch in ((target, "Qwen3_5ForCausalLM"), (drafter, "DFlashDraftModel")):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"architectures": [arch]}))
    given = SmokeConfig(workdir=tmp_path, target=str(target), drafter=str(drafter))
    assert model_architectures(given) == ["Qwen3_5ForCausalLM", "DFlashDraftModel"]
    # A hub id (no local config): vLLM inspects it itself.
    hub = SmokeConfig(workdir=tmp_path, target="Qwen/Qwen3.6-27B", drafter=str(drafter))
    assert model_architectures(hub) == ["DFlashDraftModel"]
