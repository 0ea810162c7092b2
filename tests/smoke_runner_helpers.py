"""The stand-in ``vllm`` package that ``run_smoke``'s CPU tests serve with, and their config.

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

import sys
import textwrap
from pathlib import Path

import pytest

from tooling.smoke import SmokeConfig, Timeouts
from tooling.smoke.serving.tiny import TinySpec, target_config

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
    if spec and os.environ.get("STANDIN_SPECS"):
        with open(os.environ["STANDIN_SPECS"], "a") as f:
            f.write(json.dumps({"by": "serve", **spec}) + "\\n")
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
            if speculative_config and os.environ.get("STANDIN_SPECS"):
                with open(os.environ["STANDIN_SPECS"], "a") as f:
                    f.write(json.dumps({"by": "LLM", **speculative_config}) + "\\n")
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


@pytest.fixture(name="standin_vllm")
def standin_vllm_fixture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """The stand-in package on PYTHONPATH, and a tiny target and drafter to serve."""
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
