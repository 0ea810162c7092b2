"""Acceptance of one vLLM engine on the trained pair, and the table across engines.

The engine side runs on the GPU host, inside the interpreter whose vLLM is
measured (``python -m tooling.smoke.acceptance run IN.json OUT.json`` with
that install first on PYTHONPATH): the held-out prompts of the recipe,
greedy, ``ignore_eos``, 3 drafted tokens; acceptance from vLLM's own
spec-decode counters. Then every prompt again, to read the prefix-cache hit
rate on repeats (fix 3). The table side is pure: it puts the engines beside
the reference package's figures from the same recipe run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .serving.child import exit_now, serve

SPEC = "vllm:spec_decode_"


@dataclass
class EngineFigures:
    engine: str
    vllm_version: str | None
    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_pos: list[int]
    prefix_queries_repeat: int
    prefix_hits_repeat: int
    outputs_equal_reference: int
    prompts: int
    startup_s: float
    error: str | None = None

    @property
    def acceptance_length(self) -> float | None:
        return 1 + self.accepted / self.drafts if self.drafts else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens else None

    @property
    def per_position(self) -> list[float]:
        return [a / self.drafts for a in self.accepted_per_pos] if self.drafts else []

    @property
    def prefix_hit_rate(self) -> float | None:
        if not self.prefix_queries_repeat:
            return None
        return self.prefix_hits_repeat / self.prefix_queries_repeat


def _counters(metrics: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for metric in metrics:
        if metric.name.startswith(SPEC) or metric.name.startswith("vllm:prefix_cache"):
            value = getattr(metric, "values", None)
            out[metric.name] = value if value is not None else getattr(metric, "value", 0)
    return out


def _delta(after: dict[str, Any], before: dict[str, Any], name: str) -> Any:
    a, b = after.get(name, 0), before.get(name, 0)
    if isinstance(a, list):
        b = b if isinstance(b, list) else [0] * len(a)
        return [int(x) - int(y) for x, y in zip(a, b, strict=False)]
    return int(a) - int(b)


def run_engine(request: dict[str, Any]) -> dict[str, Any]:
    """Measure the vLLM importable here on the recipe's prompts (GPU host only)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [p["token_ids"] for p in request["prompts"]]
    started = time.monotonic()
    llm = LLM(
        model=request["target"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=request.get("max_model_len", 1024),
        gpu_memory_utilization=request.get("gpu_memory_utilization", 0.3),
        seed=0,
        disable_log_stats=False,
        attention_backend="FLASH_ATTN",
        enable_prefix_caching=True,
        block_size=16,
        speculative_config={
            "method": "dflash",
            "model": request["drafter"],
            "num_speculative_tokens": request["num_speculative_tokens"],
        },
    )
    startup_s = time.monotonic() - started
    params = SamplingParams(
        temperature=0.0, max_tokens=request["max_new_tokens"], ignore_eos=True, detokenize=False
    )
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    before = _counters(llm.get_metrics())
    first = llm.generate(inputs, params, use_tqdm=False)
    after_first = _counters(llm.get_metrics())
    # The same prompts again: every full block should now come from the cache.
    # Each output says how many of its prompt tokens the cache supplied.
    repeat = llm.generate(inputs, params, use_tqdm=False)
    outputs = [[int(t) for t in r.outputs[0].token_ids] for r in first]
    block = 16
    return {
        "vllm_version": getattr(vllm, "__version__", None),
        "startup_s": startup_s,
        "outputs": outputs,
        "spec": {k: _delta(after_first, before, k) for k in after_first if k.startswith(SPEC)},
        "prefix_repeat": {
            "cached_tokens": sum(int(r.num_cached_tokens or 0) for r in repeat),
            "prompt_tokens": sum(len(p) for p in prompts),
            # A hit can cover at most the full blocks before the last prompt token.
            "full_block_tokens": sum((len(p) - 1) // block * block for p in prompts),
        },
    }


def figures(
    engine: str, result: dict[str, Any], reference_outputs: list[list[int]]
) -> EngineFigures:
    """The table row for one engine's raw result (pure)."""
    if not result.get("ok", True) or "spec" not in result:
        return EngineFigures(
            engine,
            None,
            0,
            0,
            0,
            [],
            0,
            0,
            0,
            len(reference_outputs),
            0.0,
            error=result.get("error", "no result"),
        )
    spec = result["spec"]
    equal = sum(a == b for a, b in zip(result["outputs"], reference_outputs, strict=False))
    return EngineFigures(
        engine=engine,
        vllm_version=result.get("vllm_version"),
        drafts=spec.get(f"{SPEC}num_drafts", 0),
        draft_tokens=spec.get(f"{SPEC}num_draft_tokens", 0),
        accepted=spec.get(f"{SPEC}num_accepted_tokens", 0),
        accepted_per_pos=spec.get(f"{SPEC}num_accepted_tokens_per_pos", []),
        prefix_queries_repeat=result["prefix_repeat"].get("full_block_tokens", 0),
        prefix_hits_repeat=result["prefix_repeat"].get("cached_tokens", 0),
        outputs_equal_reference=equal,
        prompts=len(reference_outputs),
        startup_s=result.get("startup_s", 0.0),
    )


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table_markdown(reference: dict[str, Any], rows: list[EngineFigures]) -> str:
    """The acceptance table (pure): the reference first, then each engine."""
    ref_len = reference["mean_acceptance_length"]
    ref_pos = reference.get("acceptance_per_position", [])
    ref_rate = (
        reference["num_accepted_tokens"] / reference["num_draft_tokens"]
        if reference.get("num_draft_tokens")
        else None
    )
    lines = [
        "| engine | mean acceptance length | acceptance rate | per position | vs reference "
        "| greedy output = reference | prefix cache on repeat |",
        "|---|---|---|---|---|---|---|",
        f"| reference `dflash` package (HF) | {ref_len:.3f} | "
        f"{_fmt(ref_rate)} | "
        f"{', '.join(f'{p:.2f}' for p in ref_pos)} | 1.000 | - | - |",
    ]
    for row in rows:
        if row.error:
            lines.append(f"| {row.engine} | error: {row.error} | | | | | |")
            continue
        ratio = row.acceptance_length / ref_len if row.acceptance_length else None
        hit = row.prefix_hit_rate
        hits = (
            "-"
            if hit is None
            else f"{hit:.1%} ({row.prefix_hits_repeat}/{row.prefix_queries_repeat} block tokens)"
        )
        lines.append(
            f"| {row.engine} | {_fmt(row.acceptance_length)} | {_fmt(row.acceptance_rate)} | "
            f"{', '.join(f'{p:.2f}' for p in row.per_position)} | {_fmt(ratio)} | "
            f"{row.outputs_equal_reference}/{row.prompts} | "
            f"{hits} |"
        )
    return "\n".join(lines) + "\n"


def plot(reference: dict[str, Any], rows: list[EngineFigures], target: Path) -> Path | None:
    """Acceptance per draft position, one line per engine (PNG), when matplotlib is there."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ref = reference.get("acceptance_per_position", [])
    ax.plot(range(1, len(ref) + 1), ref, "k--o", label="reference dflash (HF)")
    for row in rows:
        if row.per_position:
            ax.plot(range(1, len(row.per_position) + 1), row.per_position, "-o", label=row.engine)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted fraction of drafts")
    ax.set_ylim(0, 1)
    ax.set_xticks(range(1, max(len(ref), 1) + 1))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("DFlash acceptance per position, trained pair, greedy")
    fig.tight_layout()
    fig.savefig(target, dpi=120)
    plt.close(fig)
    return target


def measure_engines(
    trained: Path,
    engines: dict[str, Path],
    out_dir: Path,
    timeout_s: float = 420,
    workers: int = 1,
) -> tuple[dict[str, Any], list[EngineFigures]]:
    """Run every engine (a folder holding its vllm, put first on PYTHONPATH) on the trained pair.

    Returns the reference figures and one row per engine; writes each raw
    result, the table (acceptance.md), the rows (acceptance.json) and the
    plot (acceptance.png) into ``out_dir``.
    """
    import subprocess

    summary = json.loads((trained / "summary.json").read_text())
    reference = summary["reference"]
    prompts = json.loads((trained / "prompts.json").read_text())
    reference_outputs = [
        r["output_ids"] for r in json.loads((trained / "reference.json").read_text())["prompts"]
    ]
    request = {
        "target": str(trained / "target"),
        "drafter": str(trained / "drafter"),
        "prompts": prompts["prompts"],
        "max_new_tokens": prompts["max_new_tokens"],
        "num_speculative_tokens": prompts["num_speculative_tokens"],
        # A small share each: the models are small and several engines may run at once.
        "gpu_memory_utilization": 0.12,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "acceptance-request.json").write_text(json.dumps(request))

    def measure(name: str, folder: Path) -> EngineFigures:
        raw = out_dir / f"acceptance-{name}.json"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(folder), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
        with open(out_dir / f"acceptance-{name}.log", "wb") as log:
            try:
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "tooling.smoke.acceptance",
                        "run",
                        str(out_dir / "acceptance-request.json"),
                        str(raw),
                    ],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=timeout_s,
                    stdin=subprocess.DEVNULL,
                )
            except subprocess.TimeoutExpired:
                raw.write_text(json.dumps({"ok": False, "error": f"timed out ({timeout_s}s)"}))
        result = json.loads(raw.read_text()) if raw.is_file() else {"ok": False}
        return figures(name, result, reference_outputs)

    # Engines are separate processes with a small memory share each, so several
    # can share one GPU.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        rows = list(pool.map(lambda item: measure(*item), engines.items()))
    (out_dir / "acceptance.md").write_text(table_markdown(reference, rows))
    (out_dir / "acceptance.json").write_text(
        json.dumps(
            {
                "reference": reference,
                "engines": [
                    {
                        **asdict(r),
                        "acceptance_length": r.acceptance_length,
                        "acceptance_rate": r.acceptance_rate,
                        "per_position": r.per_position,
                        "prefix_hit_rate": r.prefix_hit_rate,
                    }
                    for r in rows
                ],
            },
            indent=2,
        )
    )
    plot(reference, rows, out_dir / "acceptance.png")
    return reference, rows


def main(argv: list[str]) -> int:
    """``run IN.json OUT.json``: measure this interpreter's vLLM; exit 0 when it ran."""
    if len(argv) != 3 or argv[0] != "run":
        print("usage: python -m tooling.smoke.acceptance run IN.json OUT.json", file=sys.stderr)
        return 2
    return serve(Path(argv[1]), Path(argv[2]), run_engine)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
