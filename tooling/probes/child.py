"""Entry point inside the probed interpreter: run the named probes, write their verdicts as JSON.

Usage: python -m <pkg>.child OUT.json PROBE [PROBE ...]

vLLM logs to stdout, so results go to a file. A probe that raises becomes
``unknown`` with the exception as evidence; the other probes still run.
"""

from __future__ import annotations

import json
import sys
import traceback
from importlib import import_module

from .result import UNKNOWN, ProbeResult


def _run_one(name: str) -> ProbeResult:
    try:
        module = import_module(f"{__package__}.{name}")
        return module.run()
    except Exception as e:  # a probe must never take the others down
        last = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{last.filename.rsplit('/vllm/', 1)[-1]}:{last.lineno}"
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return ProbeResult(
            probe=name,
            status=UNKNOWN,
            evidence=f"{type(e).__name__} at {where}: {message}"[:400],
            details={"traceback": traceback.format_exc()[-4000:]},
        )


def main(argv: list[str]) -> int:
    out, names = argv[0], argv[1:]
    results = []
    try:
        import vllm

        version = getattr(vllm, "__version__", "?")
        location = vllm.__file__
    except Exception as e:
        version, location = None, f"{type(e).__name__}: {e}"
    for name in names:
        results.append(
            _run_one(name).to_json()
            if version
            else ProbeResult(
                probe=name, status=UNKNOWN, evidence=f"cannot import vllm: {location}"
            ).to_json()
        )
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"vllm_version": version, "vllm_location": location, "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
