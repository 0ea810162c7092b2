"""The reference comparison's calls against a repeat of the same call, on one GPU or the CPU.

The smoke's check 5 recomputes vLLM's DFlash proposals with the reference implementation
(``tooling.smoke.serving.reference``): one HF target pass per prompt, one drafter pass per
proposal. At the seed's width its processes compared two prompts each for minutes without
an answer, far past what the same calls cost at width 512, so the cost is not what the
arithmetic of those calls says. This measures where it goes.

Floor: each call repeated at the same length (weights on the device, kernels compiled and
tuned, the caches of the first call warm): the least that call can cost. Ours: the first
call at each sequence length not seen before, as the comparison makes them (every prompt is
a new length). Goal: the first call within 2x its repeat; past it, a per-shape cost (a
compile, a tuning, an allocation) is paid per prompt, and the first such call's profile
(cProfile, its top functions by cumulative time) names it.

With ``--engine-result`` (an in-process engine run's ``engine.json``, its recorded features
beside it) it then compares that run's proposals for the first ``--prompts`` prompts as
check 5 would, and prints the phases' seconds and the agreement.

Run in an interpreter with torch, transformers and the reference ``dflash`` package (the
smoke's serving interpreter), from the repository root:
  PYTHONPATH=.:SITE python3 bench/bench_reference.py --target T --drafter D \
      [--engine-result WORKDIR/engine.json] [--prompts 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path
from typing import Any

from tooling.smoke.serving.reference import (
    FidelityInput,
    LoadedPair,
    ModelSetup,
    reference_logits,
    tally,
    target_hidden_states,
    warm_up,
)

#: Lengths the comparison meets: the fidelity prompts with their outputs (48-240 tokens),
#: none of them the warm-up's, one of each divisibility by 16 the kernels specialise on.
LENGTHS = (88, 96, 131, 200)
GOAL = 2.0
PROFILE_LINES = 25


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(device: str, fn: Any) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _tokens(length: int, vocab: int, salt: int) -> list[int]:
    return [(11 * i + 5 + salt) % vocab for i in range(length)]


def measure_calls(pair: LoadedPair, lengths: tuple[int, ...]) -> list[dict[str, float]]:
    """Per length: the target pass and one drafter pass, first call then a repeat."""
    from dflash.model import extract_context_feature

    target, drafter, device = pair.target, pair.drafter, pair.device
    vocab = int(target.config.get_text_config().vocab_size)
    k = max(1, drafter.block_size - 1)
    rows = []
    for length in lengths:
        sequence = _tokens(length, vocab, salt=length)
        hidden: list[Any] = []

        def target_pass(sequence: list[int] = sequence, hidden: list[Any] = hidden) -> None:
            hidden[:] = target_hidden_states(target, sequence)

        first_target = _timed(device, target_pass)
        repeat_target = _timed(device, target_pass)
        features = extract_context_feature(hidden, drafter.target_layer_ids)

        def drafter_pass(features: Any = features, length: int = length) -> None:
            reference_logits(target, drafter, features, length - 1, 7, k)

        first_drafter = _timed(device, drafter_pass)
        repeat_drafter = _timed(device, drafter_pass)
        rows.append(
            {
                "length": length,
                "target_first_s": first_target,
                "target_repeat_s": repeat_target,
                "drafter_first_s": first_drafter,
                "drafter_repeat_s": repeat_drafter,
            }
        )
        print(
            f"length {length}: target {first_target:.3f}s first, {repeat_target:.3f}s repeat; "
            f"drafter {first_drafter:.3f}s first, {repeat_drafter:.3f}s repeat",
            flush=True,
        )
    return rows


def profile_first_pass(pair: LoadedPair, length: int) -> str:
    """cProfile of one target pass at a length not seen before: the top functions."""
    vocab = int(pair.target.config.get_text_config().vocab_size)
    sequence = _tokens(length, vocab, salt=1)
    profiler = cProfile.Profile()
    profiler.enable()
    target_hidden_states(pair.target, sequence)
    _sync(pair.device)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(PROFILE_LINES)
    return out.getvalue()


def compare_engine_run(pair: LoadedPair, engine_result: Path, prompts: int) -> dict[str, Any]:
    """Check 5's comparison of the run's proposals for its first ``prompts`` prompts, with
    the context the smoke gives a hybrid target (the engine's recorded features)."""
    run = json.loads(engine_result.read_text(encoding="utf-8"))
    features = run.get("features_path")
    request = FidelityInput(
        prompts=run["prompts"],
        outputs=run["outputs"],
        proposals=run["proposals"],
        context="engine" if features else "target",
        features_path=features,
        prompt_indices=list(range(prompts)),
    )
    start = time.perf_counter()
    counts = tally(pair, request, lambda line: print(line, flush=True))
    result = counts.result()
    result["wall_s"] = time.perf_counter() - start
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--engine-result", type=Path)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    pair = LoadedPair.load(ModelSetup(args.target, args.drafter, device=args.device))
    print(f"loaded in {pair.seconds:.1f}s on {pair.device}", flush=True)
    warm_s = warm_up(pair)
    print(f"warm-up (the comparison's own) {warm_s:.1f}s", flush=True)
    rows = measure_calls(pair, LENGTHS)
    profile = profile_first_pass(pair, max(LENGTHS) + 3)
    print(profile, flush=True)
    figures: dict[str, Any] = {
        "device": pair.device,
        "load_s": pair.seconds,
        "warm_up_s": warm_s,
        "calls": rows,
        "profile": profile,
    }
    if args.engine_result:
        figures["comparison"] = compare_engine_run(pair, args.engine_result, args.prompts)
        c = figures["comparison"]
        print(
            f"comparison of {c['compared_proposals']} proposals in {c['wall_s']:.1f}s "
            f"(phases {c.get('seconds')}): agreement {c['agreement']:.4f}",
            flush=True,
        )
    print(f"{'length':>6} {'target first/repeat':>20} {'drafter first/repeat':>21}")
    worst = 0.0
    for r in rows:
        t = r["target_first_s"] / max(r["target_repeat_s"], 1e-9)
        d = r["drafter_first_s"] / max(r["drafter_repeat_s"], 1e-9)
        worst = max(worst, t, d)
        print(f"{r['length']:>6} {t:>19.1f}x {d:>20.1f}x")
    print(f"goal: the first call at a new length within {GOAL:g}x its repeat; worst {worst:.1f}x")
    figures["worst_ratio"] = worst
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
