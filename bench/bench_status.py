"""The status matrix over every pinned release (warm cache), against a floor from the same run.

Floor: one probe run on one release (importing vLLM and exercising the three
probes), times the number of releases, divided by the workers: a matrix that
decides by behaviour cannot cost less than probing each release once.
Ours: ``tooling patch status --bases all`` (which probes each release twice,
before and after applying, plus the git work).

Run: .venv/bin/python bench/bench_status.py [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tooling.fetching.bases import load_bases
from tooling.patching.registry import registry
from tooling.patching.series import load_series
from tooling.paths import REPO_DIR, CacheLayout, default_cache_dir
from tooling.probing import ProbeTarget, run_probes
from tooling.probing.env import ensure_probe_env


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    cache = CacheLayout(default_cache_dir(os.environ))
    python = ensure_probe_env(cache)
    catalog = load_bases(REPO_DIR / "patches" / "bases.toml")
    tooling = [sys.executable, "-m", "tooling", "--no-progress"]
    # Warm the cache: every release's sdist fetched and unpacked, bytecode compiled.
    warm = subprocess.run(
        [*tooling, "patch", "status", "--bases", "all", "--json", "--workers", str(args.workers)],
        capture_output=True,
        text=True,
    )
    root = Path(
        json.loads(
            subprocess.run(
                [*tooling, "fetch", "--no-wheel", "--json"], capture_output=True, text=True
            ).stdout
        )["source_dir"]
    )
    start = time.perf_counter()
    target = ProbeTarget(python=python, root=root, pycache=cache.root / "pycache")
    run_probes(target, registry().probes)
    one_probe = time.perf_counter() - start
    start = time.perf_counter()
    result = subprocess.run(
        [*tooling, "patch", "status", "--bases", "all", "--json", "--workers", str(args.workers)],
        capture_output=True,
        text=True,
    )
    matrix_s = time.perf_counter() - start
    data = json.loads(result.stdout or warm.stdout)
    ids = [p.id for p in load_series(REPO_DIR / "patches" / "series.toml").patches]
    print(f"{'base':<8}" + "".join(f"{i:<26}" for i in ids))
    for entry in data["bases"]:
        report = entry["report"]
        cells = (
            ["error"] * len(ids)
            if report is None
            else [o["status"] + ("!" if o["problem"] else "") for o in report["outcomes"]]
        )
        print(f"{entry['base']:<8}" + "".join(f"{c:<26}" for c in cells))
    floor = one_probe * len(catalog.bases) / args.workers
    print(f"{len(catalog.bases)} releases, {args.workers} workers")
    print(f"floor (one probe run x releases / workers): {floor:.1f}s")
    print(f"tooling patch status --bases all:          {matrix_s:.1f}s  ({matrix_s / floor:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
