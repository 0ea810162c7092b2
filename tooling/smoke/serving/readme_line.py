"""README's serving line, served as written on a GPU host, with a prefix-caching check.

Runs on the GPU host in the serving interpreter (vLLM installed): ``python -m
tooling.smoke.serving.readme_line session PAIR OUT [--variant NAME ...]`` waits for the pair
``tooling.smoke.serving.tiny`` writes under PAIR (its manifest), then serves it with the
line README gives (the DFlash drafter at K = 15, ``--language-model-only``, the chat
template's thinking off; ``--gdn-prefill-backend triton`` where flashinfer is missing) and
nothing else, so vLLM's defaults decide the rest, once per variant:

- ``defaults``: the line as written;
- ``prefix``: the line with ``--enable-prefix-caching``;
- ``small-budget``: the line with ``--enable-prefix-caching --max-num-batched-tokens 512
  --max-num-seqs 16``, a step budget of 288 tokens, below the 480-token block: every prompt
  of a block or more is prefilled in chunks smaller than a block.

Each variant records how long the server took to answer /health, the log lines vLLM wrote
about the batch settings, then serves: a short prompt, a 1000-token prompt twice (cold,
then from the prefix cache) and once with tokens 288..479 replaced (another context for
the same blocks), each greedy with the first 16 tokens' top-20 logprobs, and 16 prompts at
once of the lengths where blocks and drafts meet. ``OUT/VARIANT.json`` holds it all, and
``OUT/compare.json`` how far the first token's logprobs moved between runs: a prefix hit
against its cold run, each variant against the whole-block ``prefix`` run, and the replaced
context against its run (what a Mamba state of the wrong position would look like).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from ...procs import log_tail, start_group, stop_group
from ..client import get_text, is_healthy, post_json
from ..server import free_port

logger = logging.getLogger(__name__)

K = 15
READY_S = 900.0
REQUEST_S = 300.0
VARIANTS = {
    "defaults": [],
    "prefix": ["--enable-prefix-caching"],
    "small-budget": [
        "--enable-prefix-caching",
        "--max-num-batched-tokens",
        "512",
        "--max-num-seqs",
        "16",
    ],
}
#: Prompt lengths of the concurrent wave: K, K + 1, K + 2, the 480-token block +- 1, two
#: blocks + 1, the small budget (288) +- (K + 1), and a long one.
WAVE_LENGTHS = (15, 16, 17, 479, 480, 481, 961, 272, 304, 1200, 33, 100, 200, 500, 800, 2000)
LONG = 1000
#: The span of the long prompt replaced for the other-context run: the tokens a Mamba
#: state saved at 288 instead of 480 would have missed.
REPLACED = (288, 480)


def serve_command(python: str, target: str, drafter: str, port: int, extra: list[str]) -> list[str]:
    """README's serving line for ``target`` and ``drafter`` (local folders), on ``port``."""
    spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": K}
    return [
        python,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        target,
        "--speculative-config",
        json.dumps(spec),
        "--language-model-only",
        "--default-chat-template-kwargs",
        '{"enable_thinking": false}',
        "--gdn-prefill-backend",
        "triton",
        "--port",
        str(port),
        *extra,
    ]


def tokens(seed: int, n: int, vocab: int) -> list[int]:
    """``n`` token ids of prompt ``seed``, away from the vocabulary's reserved top."""
    return [(seed * 7919 + i * 104729) % (vocab - 1000) + 100 for i in range(n)]


def _complete(url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 20,
        "return_token_ids": True,
    }
    started = time.monotonic()
    data = post_json(f"{url}/v1/completions", payload, REQUEST_S)
    choice = data["choices"][0]
    return {
        "seconds": round(time.monotonic() - started, 3),
        "token_ids": choice.get("token_ids"),
        "top": (choice.get("logprobs") or {}).get("top_logprobs"),
    }


def _requests(url: str, model: str, vocab: int) -> dict[str, Any]:
    long = tokens(1, LONG, vocab)
    other = long[: REPLACED[0]] + tokens(2, REPLACED[1] - REPLACED[0], vocab) + long[REPLACED[1] :]
    out: dict[str, Any] = {"short": _complete(url, model, tokens(3, 12, vocab), 16)}
    out["long_cold"] = _complete(url, model, long, 16)
    out["long_hit"] = _complete(url, model, long, 16)
    out["long_other"] = _complete(url, model, other, 16)
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(WAVE_LENGTHS)) as pool:
        futures = [
            pool.submit(_complete, url, model, tokens(10 + i, n, vocab), 32)
            for i, n in enumerate(WAVE_LENGTHS)
        ]
        wave = [f.result() for f in futures]
    out["wave"] = {
        "lengths": list(WAVE_LENGTHS),
        "seconds": round(time.monotonic() - started, 3),
        "served": sum(1 for w in wave if len(w["token_ids"] or ()) == 32),
    }
    return out


def run_variant(name: str, pair: Path, out: Path) -> dict[str, Any]:
    """Serve ``pair`` with README's line and variant ``name``'s flags; the record."""
    manifest = json.loads((pair / "tiny.json").read_text())
    target, drafter = manifest["target"], manifest["drafter"]
    port = free_port()
    log = out / f"{name}.log"
    # One compile cache for every variant: the same wheel and model, and vLLM's own keys
    # decide what a variant may reuse, as on a user's host.
    env = {**os.environ, "VLLM_CACHE_ROOT": str(out / "vllm-cache")}
    cmd = serve_command(sys.executable, target, drafter, port, VARIANTS[name])
    record: dict[str, Any] = {"variant": name, "argv": cmd[3:], "ok": False}
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    proc = start_group(cmd, log=log, env=env, truncate_log=True)
    try:
        while not is_healthy(url):
            if proc.poll() is not None or time.monotonic() - started > READY_S:
                record["error"] = f"not ready (exit {proc.poll()}): {log_tail(log, 3)}"
                return record
            time.sleep(2)
        record["ready_s"] = round(time.monotonic() - started, 1)
        record["requests"] = _requests(url, target, manifest["spec"]["vocab_size"])
        record["metrics"] = [
            line
            for line in get_text(f"{url}/metrics").splitlines()
            if line.startswith(("vllm:prefix_cache", "vllm:spec_decode_num"))
        ]
        record["ok"] = True
    except Exception as e:  # the record says what failed; the session goes on
        record["error"] = f"{type(e).__name__}: {e}"[:500]
    finally:
        stop_group(proc, grace_s=20)
        text = log.read_text(errors="replace").splitlines()
        record["log"] = [
            line
            for line in text
            if any(
                k in line
                for k in (
                    "max_num_seqs",
                    "max_num_scheduled_tokens",
                    "block size",
                    "Prefill chunks",
                    "init engine",
                    "Error",
                    "error",
                )
            )
        ][:40]
        (out / f"{name}.json").write_text(json.dumps(record, indent=1))
    return record


def first_token_delta(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """The largest difference of the first token's logprobs over the tokens both list."""
    if not a.get("top") or not b.get("top"):
        return None
    x, y = a["top"][0], b["top"][0]
    shared = set(x) & set(y)
    return max((abs(x[t] - y[t]) for t in shared), default=None)


def compare(records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """How far each run's first token moved from the ones it should match."""
    out: dict[str, Any] = {}
    ref = records.get("prefix", {}).get("requests")
    for name, record in records.items():
        r = record.get("requests")
        if not r:
            continue
        row = {
            "hit_vs_cold": first_token_delta(r["long_hit"], r["long_cold"]),
            "other_vs_cold": first_token_delta(r["long_other"], r["long_cold"]),
            "greedy_hit_equals_cold": r["long_hit"]["token_ids"] == r["long_cold"]["token_ids"],
        }
        if ref and name != "prefix":
            row["cold_vs_prefix_cold"] = first_token_delta(r["long_cold"], ref["long_cold"])
            row["hit_vs_prefix_cold"] = first_token_delta(r["long_hit"], ref["long_cold"])
        out[name] = row
    return out


def verdict(records: dict[str, dict[str, Any]]) -> list[str]:
    """What the run got wrong; empty when every variant served and prefix caching held.

    A prefix hit must give its cold run's greedy tokens, and each prefix-caching variant's
    cold and hit runs the whole-block ``prefix`` run's; their first token may move no more
    than the two engines without and with prefix caching moved apart in the same run (bf16
    kernels of other batch shapes), which ``defaults`` against ``prefix`` measures.
    """
    wrong = [
        f"{n}: {r.get('error', 'did not serve')}" for n, r in records.items() if not r.get("ok")
    ]
    table = compare(records)
    noise = (table.get("defaults") or {}).get("cold_vs_prefix_cold")
    ref = (records.get("prefix") or {}).get("requests")
    for name in ("prefix", "small-budget"):
        r = (records.get(name) or {}).get("requests")
        if not r:
            continue
        if r["long_hit"]["token_ids"] != r["long_cold"]["token_ids"]:
            wrong.append(f"{name}: the prefix hit's tokens differ from its cold run's")
        if ref and r["long_cold"]["token_ids"] != ref["long_cold"]["token_ids"]:
            wrong.append(f"{name}: the cold run's tokens differ from the whole-block run's")
        for key in ("hit_vs_cold", "cold_vs_prefix_cold", "hit_vs_prefix_cold"):
            delta = table[name].get(key)
            if delta is not None and noise is not None and delta > noise * 1.5:
                wrong.append(f"{name}: {key} {delta:.4f} past 1.5 x the engines' {noise:.4f}")
    return wrong


def session(pair: Path, out: Path, variants: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    while not (pair / "tiny.json").is_file():
        time.sleep(5)
    records = {}
    for name in variants:
        logger.debug("README line, variant %s", name)
        records[name] = run_variant(name, pair, out)
        try:
            table: Any = compare(records)
        except Exception as e:  # a malformed answer must not cost the variants after it
            table = {"error": f"{type(e).__name__}: {e}"}
        (out / "compare.json").write_text(json.dumps(table, indent=1))
    return 0 if all(r["ok"] for r in records.values()) else 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tooling.smoke.serving.readme_line")
    parser.add_argument("command", choices=("session",))
    parser.add_argument("pair", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--variant", action="append", choices=tuple(VARIANTS))
    args = parser.parse_args(argv)
    return session(args.pair, args.out, args.variant or list(VARIANTS))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
