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

import importlib.util
import json
import os
import re
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from tooling.errors import SmokeCapacityError, SmokeError, exit_code_for
from tooling.smoke import (
    EngineSettings,
    GpuFacts,
    SmokeConfig,
    Timeouts,
    describe_plan,
    format_table,
    run_smoke,
)
from tooling.smoke.checks import ERROR, FAIL, INFO, PASS, SKIP
from tooling.smoke.serving.tiny import TinySpec, hybrid_config, target_config

from .smoke_models import write_model

STANDIN_MAIN = textwrap.dedent(
    """
    import argparse, http.server, json, os, sys, time

    parser = argparse.ArgumentParser()
    parser.add_argument("command")
    parser.add_argument("model")
    for flag in ("--host", "--port", "--served-model-name", "--attention-backend",
                 "--max-model-len", "--gpu-memory-utilization", "--seed", "--block-size",
                 "--kv-cache-dtype", "--tensor-parallel-size", "--max-num-seqs",
                 "--kv-cache-memory-bytes", "--generation-config", "--speculative-config",
                 "--gdn-prefill-backend", "--distributed-executor-backend"):
        parser.add_argument(flag)
    for flag in ("--enable-prompt-tokens-details", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--enforce-eager",
                 "--language-model-only", "--disable-custom-all-reduce"):
        parser.add_argument(flag, action="store_true")
    args = parser.parse_args()

    if os.environ.get("STANDIN_PIDS"):
        with open(os.environ["STANDIN_PIDS"], "a") as f:
            f.write(f"{os.getpid()}\\n")
    # A slow start (compiling), before anything listens.
    time.sleep(float(os.environ.get("STANDIN_DELAY", "0")))
    stock = os.environ.get("STANDIN_MODE") == "stock"
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    print("INFO vLLM API server version stand-in", flush=True)
    if args.block_size:
        block = int(args.block_size)
    else:
        # A hybrid target: vLLM sizes the attention blocks to the Mamba page, larger with
        # the drafter (the seed-shaped pair's figures), and says so before it answers.
        block = 480 if spec else 400
        print(f"(EngineCore pid=1) INFO [interface.py:606] Setting attention block size to "
              f"{block} tokens to ensure that attention page size is >= mamba page size.",
              flush=True)
    print(f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}", flush=True)
    print(f"RAY_ADDRESS={os.environ.get('RAY_ADDRESS')}", flush=True)
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

STANDIN_LLM = textwrap.dedent(
    """
    # vLLM's offline LLM as serving/distribution.py drives it: greedy tokens and top-3
    # logprobs that are a function of the context alone, so an engine with the drafter
    # computes what the plain one does. STANDIN_MODE=stock on a hybrid target: a prompt
    # of exactly K+1 tokens served alone starts from another state (its first token's
    # distribution is not the plain one's), as stock 0.20.1 does.
    import json, os
    from types import SimpleNamespace as NS

    class SamplingParams:
        def __init__(self, max_tokens=16, logprobs=None, prompt_logprobs=None, **kw):
            self.max_tokens, self.logprobs = max_tokens, logprobs
            self.prompt_logprobs = prompt_logprobs

    class LLM:
        def __init__(self, model, speculative_config=None, **kw):
            config = json.load(open(os.path.join(model, "config.json")))
            self.hybrid = "text_config" in config
            self.vocab = (config.get("text_config") or config)["vocab_size"]
            self.k = (speculative_config or {}).get("num_speculative_tokens", 0)
            compilation = NS(cudagraph_mode="FULL_AND_PIECEWISE", cudagraph_capture_sizes=[1])
            self.llm_engine = NS(
                model_executor=NS(driver_worker=NS(worker=NS(model_runner=None))),
                vllm_config=NS(compilation_config=compilation, cache_config=NS(num_gpu_blocks=9)),
            )

        def _top(self, context, shift=0):
            h = sum((j + 1) * t for j, t in enumerate(context)) % 9973
            top = [(h + 7 * r + shift) % self.vocab for r in range(3)]
            return top, {t: NS(logprob=-1.0 - 0.5 * r) for r, t in enumerate(top)}

        def _run(self, ids, sp, defect):
            context, tokens, logprobs = list(ids), [], []
            for i in range(sp.max_tokens):
                top, listed = self._top(context, 500 if defect and i == 0 else 0)
                logprobs.append(listed)
                tokens.append(top[0])
                context.append(top[0])
            # Prompt logprobs: each position's distribution given the tokens before it.
            prompt = None
            if sp.prompt_logprobs is not None:
                prompt = [None] + [self._top(ids[:j])[1] for j in range(1, len(ids))]
            completion = NS(token_ids=tokens, logprobs=logprobs, finish_reason="length")
            return NS(outputs=[completion], prompt_logprobs=prompt)

        def generate(self, prompts, params, use_tqdm=False):
            stock = os.environ.get("STANDIN_MODE") == "stock" and self.hybrid and self.k
            return [
                self._run(p["prompt_token_ids"], sp,
                          stock and len(prompts) == 1 and len(p["prompt_token_ids"]) == self.k + 1)
                for p, sp in zip(prompts, params)
            ]
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

# vLLM 0.20.1's checks that its Ray executor can start (v1/executor/ray_utils.py: the import
# at start-up; ray_executor.py: the version and compiled-graph module at the first request).
STANDIN_RAY_UTILS = textwrap.dedent(
    """
    try:
        import ray
        ray_import_err = None
    except ImportError as e:
        ray = None
        ray_import_err = str(e)

    def assert_ray_available():
        if ray is None:
            raise ValueError(
                f"Failed to import Ray: {ray_import_err}."
                "Please install Ray with `pip install ray`."
            )
    """
)
STANDIN_RAY_EXECUTOR = textwrap.dedent(
    """
    import importlib.metadata, importlib.util

    class RayDistributedExecutor:
        def _check_ray_cgraph_installation(self):
            found = importlib.metadata.version("ray")
            if tuple(int(p) for p in found.split(".")) < (2, 43, 0):
                raise ValueError(f"Ray version 2.43.0 is required, but found {found}")
            if importlib.util.find_spec("ray.experimental.compiled_dag_ref") is None:
                raise ValueError("Ray Compiled Graph is not installed.")
    """
)

DRAFTER_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "num_hidden_layers": 3,
    "hidden_size": 256,  # the target's: a drafter reads its hidden states
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
    (root / "vllm" / "__init__.py").write_text(
        '__version__ = "0.20.1+standin"\nfrom ._llm import LLM, SamplingParams\n'
    )
    (root / "vllm" / "_llm.py").write_text(STANDIN_LLM)
    (root / "vllm" / "entrypoints" / "__init__.py").write_text("")
    (cli / "__init__.py").write_text("")
    (cli / "main.py").write_text(STANDIN_MAIN)
    modules = {
        "inputs": "def TokensPrompt(prompt_token_ids):\n"
        "    return dict(prompt_token_ids=prompt_token_ids)\n",
        "v1/core/sched/scheduler": "class Scheduler:\n    def schedule(self):\n        pass\n",
        "v1/spec_decode/dflash": "class DFlashProposer:\n"
        "    def propose(self, next_token_ids):\n        pass\n",
        "v1/executor/ray_utils": STANDIN_RAY_UTILS,
        "v1/executor/ray_executor": STANDIN_RAY_EXECUTOR,
    }
    for name, text in modules.items():
        path = root / "vllm" / f"{name}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        for folder in path.relative_to(root).parents:
            (root / folder / "__init__.py").touch()
        path.write_text(text)
    # The GPU as the preflight asks torch for it: STANDIN_GPUS devices with
    # STANDIN_FREE_GIB of 140 GiB free each.
    (root / "torch").mkdir()
    (root / "torch" / "__init__.py").write_text(STANDIN_TORCH)
    monkeypatch.setenv("PYTHONPATH", str(root))
    target = tmp_path / "models" / "target"
    drafter = tmp_path / "models" / "drafter"
    write_model(target, target_config(TinySpec.for_arch("qwen3")), 2**20)
    write_model(drafter, DRAFTER_CONFIG, 2**19)
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


def _standin_ray(site: Path, version: str) -> None:
    """A Ray package on the serving interpreter's path, as far as vLLM's checks look."""
    (site / "ray" / "experimental").mkdir(parents=True)
    (site / "ray" / "__init__.py").write_text(f'__version__ = "{version}"\n')
    (site / "ray" / "experimental" / "__init__.py").write_text("")
    (site / "ray" / "experimental" / "compiled_dag_ref.py").write_text("")
    info = site / f"ray-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: ray\nVersion: {version}\n")


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_the_dflash_server_runs_on_the_executor_asked_for(
    tmp_path, standin_vllm, monkeypatch, backend
) -> None:
    monkeypatch.setenv("STANDIN_MODE", "fixed")
    monkeypatch.setenv("STANDIN_GPUS", "2")
    # A cluster elsewhere: a Ray server starts an instance of its own instead.
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    _standin_ray(tmp_path / "site", "2.48.0")
    config = _config(tmp_path, *standin_vllm)
    engine = replace(
        config.engine,
        tensor_parallel_size=2,
        disable_custom_all_reduce=True,
        distributed_executor_backend=backend,
    )
    report = run_smoke(replace(config, engine=engine), notify=lambda m: None)
    assert report.passed, report.summary_line()
    assert report.engine["distributed_executor_backend"] == backend
    logs = tmp_path / "smoke" / "logs"
    text = (logs / "serve-dflash.log").read_text()
    assert f"--distributed-executor-backend {backend}" in text.splitlines()[0]
    assert f"RAY_ADDRESS={'local' if backend == 'ray' else '10.0.0.1:6379'}" in text
    # The control keeps vLLM's choice: one Ray instance a run.
    text = (logs / "serve-plain.log").read_text()
    assert "--distributed-executor-backend" not in text.splitlines()[0]
    assert "RAY_ADDRESS=10.0.0.1:6379" in text
    # Only a Ray run asks the serving interpreter about Ray.
    assert report.vllm.get("ray_version") == ("2.48.0" if backend == "ray" else None)


@pytest.mark.parametrize(
    ("ray", "why"),
    [
        (None, "ValueError: Failed to import Ray: No module named 'ray'."),
        ("2.40.0", "ValueError: Ray version 2.43.0 is required, but found 2.40.0"),
    ],
)
def test_the_ray_executor_without_a_usable_ray_is_refused_before_any_engine(
    tmp_path, standin_vllm, monkeypatch, ray, why
) -> None:
    """The serving interpreter (this one, whose environment has no Ray, or one with a Ray
    too old for vLLM's executor) is refused in one line naming it, why and the fix."""
    from click.testing import CliRunner

    from tooling.cli import main

    assert importlib.util.find_spec("ray") is None, "this test needs an environment without Ray"
    if ray is not None:
        _standin_ray(tmp_path / "site", ray)
    monkeypatch.setenv("STANDIN_GPUS", "2")
    target, drafter = standin_vllm
    args = ["--no-progress", "smoke", "--target", str(target), "--drafter", str(drafter)]
    args += ["--workdir", str(tmp_path / "w"), "--no-fidelity", "--tensor-parallel-size", "2"]
    args += ["--distributed-executor-backend", "ray", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 17, result.output
    error = json.loads(result.stdout)["error"]
    assert "\n" not in error and result.stderr.splitlines()[-1] == f"error: {error}"
    assert error.startswith(
        f"--distributed-executor-backend ray: vLLM's Ray executor cannot start for "
        f"{sys.executable} ({why}"
    )
    assert "install ray==2.48.0 there (the bundle's --extra ray==2.48.0" in error
    assert not (tmp_path / "w" / "logs" / "serve-dflash.log").exists()


def test_no_vllm_is_one_clear_error(tmp_path, standin_vllm, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "empty"))
    config = _config(tmp_path, *standin_vllm)
    with pytest.raises(SmokeError, match="cannot import vllm"):
        run_smoke(config, notify=lambda m: None)


def test_dry_run_plan_lists_every_process(tmp_path) -> None:
    h200 = GpuFacts(1, 141 * 2**30)
    plan = describe_plan(
        SmokeConfig(workdir=tmp_path, tiny=True, python="/usr/bin/python3", gpus=h200)
    ).to_json()
    steps = [s["step"] for s in plan["steps"]]
    # --tiny: everything fits one GPU at once. The reference's four children start first
    # and load while the engines compile, then wait for the in-process engine's proposals.
    assert steps == [
        "models",
        "reference comparison (engine)",
        "serve with DFlash",
        "serve without speculation",
        "first tokens with DFlash",
        "first tokens without speculation",
        "in-process engine (engine)",
    ]
    assert plan["steps"][1]["processes"] == 4 and plan["steps"][1]["loads_before_the_engine"]
    assert plan["layout"] == "side by side"
    config = SmokeConfig(workdir=tmp_path, tiny=True, overlap_engines=False, gpus=h200)
    serial = describe_plan(config).to_json()["steps"]
    assert [(s["step"], s["wave"]) for s in serial][1:] == [
        ("serve with DFlash", 1),
        ("in-process engine (engine)", 2),
        ("serve without speculation", 3),
        ("first tokens with DFlash", 4),
        ("first tokens without speculation", 5),
        ("reference comparison (engine)", 6),
    ]
    # One after another on one GPU, the reference runs last, alone.
    assert not serial[-1]["loads_before_the_engine"]
    assert all(s["argv"][0] == "/usr/bin/python3" for s in plan["steps"])
    assert plan["steps"][0]["argv"][-2:] == ["--arch", "hybrid"]
    assert "--speculative-config" in plan["steps"][2]["argv"]
    assert "--speculative-config" not in plan["steps"][3]["argv"]
    # Compiled graphs unless asked: vLLM's own default.
    assert "--enforce-eager" not in plan["steps"][2]["argv"]


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
    config = SmokeConfig(
        workdir=tmp_path,
        tiny=True,
        warm_cache=True,
        other_site=str(site),
        gpus=GpuFacts(1, 141 * 2**30),
    )
    steps = [(s.name, s.wave) for s in describe_plan(config).steps]
    # The warm-cache runs come first: that check is what such a run is for.
    assert steps[:5] == [
        ("models", 0),
        ("reference comparison (warm-A)", 1),
        ("in-process engine (warm-A)", 1),
        ("reference comparison (warm-B)", 2),
        ("in-process engine (warm-B)", 2),
    ]
    assert steps[-1] == ("in-process engine (engine)", 3)


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


def test_model_architectures_are_the_pairs_classes(tmp_path) -> None:
    from tooling.smoke.preflight import model_architectures

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


@pytest.mark.parametrize("mode", ["fixed", "stock"])
def test_quick_on_a_hybrid_pair_answers_in_one_start(tmp_path, standin_vllm, monkeypatch, mode):
    """--quick: no server; the first tokens of K, K+1, K+2-token prompts, each alone, with
    and without the drafter. Stock's (K+1)-token prompts start from another state."""
    monkeypatch.setenv("STANDIN_MODE", mode)
    drafter = standin_vllm[1]
    hybrid = tmp_path / "hybrid"
    write_model(hybrid, hybrid_config(TinySpec.for_arch("hybrid")), 2**20)
    config = replace(_config(tmp_path, hybrid, drafter, quick=True), expect=mode)
    report = run_smoke(config, notify=lambda m: None)
    status = {c.id: c.status for c in report.checks}
    first = next(c for c in report.checks if c.id == "first_tokens")
    assert status.pop("first_tokens") == (PASS if mode == "fixed" else FAIL), first.evidence
    assert set(status.values()) == {SKIP}
    assert report.passed  # as expected: stock fails the first tokens on a hybrid target
    if mode == "stock":
        assert first.evidence.startswith("1 of 4 prompts off")
        assert "A3-K+1-0" in first.evidence
    assert not any(s.name.startswith("serve") for s in report.steps)
    assert report.to_json()["plan"]["mode"] == "quick"


@pytest.mark.parametrize("mode", ["fixed", "stock"])
def test_hybrid_prefix_prompt_fills_two_of_each_engines_blocks(
    tmp_path, standin_vllm, monkeypatch, mode
):
    """A hybrid target's engines state their enlarged blocks in their logs; each server's
    repeated prompt is two of its blocks and a tail, and stock drops the last one."""
    monkeypatch.setenv("STANDIN_MODE", mode)
    hybrid = tmp_path / "hybrid"
    write_model(hybrid, hybrid_config(TinySpec.for_arch("hybrid")), 2**20)
    report = run_smoke(_config(tmp_path, hybrid, standin_vllm[1]), notify=lambda m: None)
    prefix = next(c for c in report.checks if c.id == "prefix_cache")
    assert prefix.status == (PASS if mode == "fixed" else FAIL), prefix.evidence
    assert prefix.details["speculative"]["prompt_tokens"] == 976
    assert prefix.details["speculative"]["block_size"] == 480
    assert prefix.details["plain"] == {
        "prompt_tokens": 816,
        "hits": 800,
        "queries": 816,
        "cached_tokens": 800,
        "block_size": 400,
    }
    if mode == "stock":
        assert "480 tokens from the cache" in prefix.evidence
        assert "one block dropped: fix 3 absent" in prefix.evidence


def test_hybrid_prefix_prompt_too_long_for_max_model_len_is_an_error(
    tmp_path, standin_vllm, monkeypatch
):
    monkeypatch.setenv("STANDIN_MODE", "fixed")
    hybrid = tmp_path / "hybrid"
    write_model(hybrid, hybrid_config(TinySpec.for_arch("hybrid")), 2**20)
    config = _config(tmp_path, hybrid, standin_vllm[1])
    config = replace(config, engine=replace(config.engine, max_model_len=512))
    report = run_smoke(config, notify=lambda m: None)
    prefix = next(c for c in report.checks if c.id == "prefix_cache")
    assert prefix.status == ERROR
    assert prefix.evidence == (
        "no prefix-cache observation: the repeated prompt needs two 480-token blocks and a "
        "16-token tail (976 tokens) and 8 to generate: more than max_model_len 512"
    )


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
