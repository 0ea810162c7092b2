"""``python -m tooling.host.kernels --out REPORT``: the series' kernels against what they
replace, compiled on this GPU, before any engine serves them. Patch 37's context K/V write
against vLLM's RMSNorm, RoPE and cache insert (``kernel_context``); patch 36's correction of
computed tokens against 0.20.1's compiled function it replaces (``kernel_correction``).
Beside each patch's cases, its controls: vLLM's side given a fault the check must find.

Run in the fixed engine's interpreter, its site and this checkout on ``PYTHONPATH``: it
imports vLLM and torch, and of this toolchain only these modules. The JSON report is written
whole or not at all. Exit 0 when every case passes and every control is caught, 1
otherwise, 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from .kernel_context import CASES, CONTROLS, TOLERANCE_STEPS, run_case
from .kernel_correction import CHANGES, CONTROL, run_change

NO_CUDA_EXIT = 2

logger = logging.getLogger(__name__)


def _answer(line: str, *, err: bool = False) -> None:
    """The check's lines: what the session keeps in its text."""
    print(line, file=sys.stderr if err else sys.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tooling.host.kernels")
    parser.add_argument("--out", type=Path, required=True, help="the JSON report")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        _answer("kernels: no CUDA device; the check compares compiled kernels", err=True)
        return NO_CUDA_EXIT
    device = torch.device("cuda")
    context = [run_case(case, device) for case in CASES]
    # The seed's drafter in bfloat16 and with an fp8 cache, each with every fault.
    controls = [
        (control, run_case(case, device, control)) for case in CASES[1:3] for control in CONTROLS
    ]
    correction = [run_change(change, device) for change in CHANGES]
    # Batches in which many rows read a previous row that drafted.
    correction_controls = [run_change(change, device, control=True) for change in CHANGES[2:4]]
    report = {
        "device": torch.cuda.get_device_name(),
        "context_kv": {
            "tolerance_steps": TOLERANCE_STEPS,
            "cases": [asdict(c) for c in CASES],
            "outcomes": [{**asdict(o), "ok": o.ok} for o in context],
            "controls": [
                {"control": name, "case": o.case, "worst_steps": o.worst_steps, "caught": not o.ok}
                for name, o in controls
            ],
        },
        "correction": {
            "changes": [asdict(c) for c in CHANGES],
            "outcomes": [{**asdict(o), "ok": o.ok} for o in correction],
            "controls": [
                {"control": CONTROL, "change": c.change, "caught": not c.ok}
                for c in correction_controls
            ],
        },
    }
    partial = args.out.with_suffix(".partial")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    partial.replace(args.out)
    logger.debug("report written to %s", args.out)
    for o in context:
        _answer(
            f"context kv {o.case}: {'ok' if o.ok else 'DIFFERS'}, worst {o.worst_steps} steps, "
            f"{o.differing} of {o.elements} differ, {o.stray_rows} stray rows; host "
            f"{o.stock_host_us:.0f} us stock, {o.fused_host_us:.0f} us fused"
        )
    for name, o in controls:
        _answer(
            f"context kv control {name} on {o.case}: "
            f"{'caught' if not o.ok else 'NOT CAUGHT'}, worst {o.worst_steps} steps"
        )
    for c in correction:
        _answer(
            f"correction {c.change}: {'ok' if c.ok else 'DIFFERS'}, {c.computed_differ} "
            f"computed and {c.accepted_differ} accepted differ; host "
            f"{c.stock_host_us:.0f} us stock, {c.kernel_host_us:.0f} us kernel"
        )
    for c in correction_controls:
        _answer(
            f"correction control {CONTROL} on {c.change}: "
            f"{'caught' if not c.ok else 'NOT CAUGHT'}, {c.computed_differ} computed and "
            f"{c.accepted_differ} accepted differ"
        )
    passed = all(o.ok for o in context) and all(c.ok for c in correction)
    missed = any(o.ok for _, o in controls) or any(c.ok for c in correction_controls)
    return 0 if passed and not missed else 1


if __name__ == "__main__":
    sys.exit(main())
