"""The hybrid defects' proof on a seed-shaped pair (``ci/gpu/hybrid-proof.sh``): the first-token
comparison (``tooling.smoke.distribution``) over the stock and patched installs and an ablation,
each variant one engine (``tooling.smoke.serving.distribution``) in its own process.

The workloads, for K = 15 and K = 3 on the seed-shaped pair:
- prompts of K, K+1, K+2 and 3(K+1) tokens, each served alone (a (K+1)-token
  prompt is then a whole first step: the hybrid K+1 defect);
- staggered requests: short prompts added while others verify drafts (steps
  mixing spec and non-spec requests);
- a prompt generated to ``max_model_len`` (the last position the drafter's
  first pass queries, per request, against the last valid position);
- with PIECEWISE CUDA graphs, 64 concurrent requests (no fault).

``python -m tooling.trained.hybrid_proof plan DIR --target T --drafter D`` writes
one request per engine variant; ``report DIR`` compares the results and exits
0 only when every expectation of the plan holds (1 where one fails, 3 where a
comparison reached no verdict).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..entry import answer, entry_logging
from ..smoke.distribution import FLOOR, NOISE_HEADROOM, Report, build_report
from ..smoke.distribution_plan import Variant, request_for

logger = logging.getLogger(__name__)

VARIANTS = [
    Variant("plain", "patched", 0, 4, ["A3", "A15", "B", "E", "together"]),
    Variant("patched-k15", "patched", 15, 20, ["A15", "B", "E"]),
    Variant("stock-k15", "stock", 15, 20, ["A15", "B", "E"], expect="stock"),
    Variant("patched-k3", "patched", 3, 4, ["A3"], call=2),
    Variant("stock-k3", "stock", 3, 4, ["A3"], expect="stock", call=2),
    Variant("no-gdn-gate-gather-k15", "no-gdn-gate-gather", 15, 20, ["B"], expect="report", call=2),
    Variant("patched-piecewise-k15", "patched", 15, 64, ["A15", "C"], "PIECEWISE", 64, call=3),
    Variant("stock-piecewise-k15", "stock", 15, 48, ["C"], "PIECEWISE", 64, "report", call=3),
]


def write_plan(out: Path, target: str, drafter: str) -> list[Variant]:
    logger.debug("write the proof's %d engine requests into %s", len(VARIANTS), out)
    out.mkdir(parents=True, exist_ok=True)
    for v in VARIANTS:
        (out / f"{v.name}.in.json").write_text(
            json.dumps(request_for(v, target, drafter), indent=1) + "\n", encoding="utf-8"
        )
    (out / "plan.json").write_text(
        json.dumps([asdict(v) for v in VARIANTS], indent=1) + "\n", encoding="utf-8"
    )
    return VARIANTS


def load_results(folder: Path, plan: list[Variant]) -> dict[str, dict[str, Any]]:
    results = {}
    for v in plan:
        path = folder / f"{v.name}.out.json"
        if path.is_file():
            results[v.name] = json.loads(path.read_text(encoding="utf-8"))
    return results


def render(report: Report) -> str:
    lines = [
        f"tolerance {report.tolerance:.4f} at the first token, {report.later_tolerance:.4f} at "
        f"every position ({NOISE_HEADROOM:g} x the {report.noise:.4f} and "
        f"{report.later_noise:.4f} two plain runs differ by; floor {FLOOR})",
        "variant | workload | prompt | verdict | evidence",
    ]
    lines += [
        f"{r.variant} | {r.workload} | {r.prompt} | {r.verdict} | {r.evidence}" for r in report.rows
    ]
    if report.failures:
        lines.append("FAILED: " + "; ".join(report.failures))
    if report.undetermined:
        lines.append("NO VERDICT: " + "; ".join(report.undetermined))
    if report.ok:
        lines.append("ok")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tooling.trained.hybrid_proof")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="write one engine request per variant")
    plan.add_argument("out", type=Path)
    plan.add_argument("--target", required=True)
    plan.add_argument("--drafter", required=True)
    report = sub.add_parser("report", help="compare the variants' results")
    report.add_argument("folder", type=Path)
    report.add_argument(
        "--through-call", type=int, help="only the variants of this GPU call and earlier ones"
    )
    report.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "plan":
        with entry_logging():
            planned = write_plan(args.out, args.target, args.drafter)
        answer("\n".join(f"{v.name} {v.site} {v.call}" for v in planned))
        return 0
    variants = [Variant(**v) for v in json.loads((args.folder / "plan.json").read_text())]
    if args.through_call is not None:
        variants = [v for v in variants if v.call <= args.through_call]
    built = build_report(load_results(args.folder, variants), variants)
    answer(json.dumps(built.to_json(), indent=1) if args.json else render(built))
    if built.failures:
        return 1
    return 3 if built.undetermined else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
