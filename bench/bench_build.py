"""Warm precompiled build against floors measured in the same run.

Floors: ``cp`` of the official wheel (the least any build must do: write the whole
wheel) and the naive repack (``wheel unpack`` + ``wheel pack --local-version``, which
recompresses every kernel). Ours: ``tooling build`` with the cache and the patched
work tree warm (it still re-verifies the official wheel's sha256). Goal: within
4x of ``cp``.

Run: .venv/bin/python bench/bench_build.py [--runs 5] [--naive-runs 1]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(cmd: list[str], **kw) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, **kw)
    return time.perf_counter() - start


def median_of(runs: int, fn) -> float:
    return statistics.median(fn() for _ in range(runs))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--naive-runs", type=int, default=1)
    args = parser.parse_args()
    tooling = [sys.executable, "-m", "tooling", "--no-progress"]
    with tempfile.TemporaryDirectory(prefix="bench-build-") as tmp:
        work = Path(tmp)
        # Warm everything once: fetch, patch (with probes), build.
        out = subprocess.run(
            [*tooling, "build", "--dist", str(work / "warm"), "--json"],
            check=True,
            capture_output=True,
            text=True,
            cwd=ROOT,
        ).stdout
        built = json.loads(out)
        fetched = subprocess.run(
            [*tooling, "fetch", "--json"], check=True, capture_output=True, text=True, cwd=ROOT
        ).stdout
        official = Path(json.loads(fetched)["wheel"])

        cp = median_of(args.runs, lambda: timed(["cp", str(official), str(work / "copy.whl")]))
        # A verified copy: what cp does plus the two digests a build owes its user
        # (the official wheel against its pin, the output for the summary).
        verified = median_of(
            args.runs,
            lambda: timed(
                [
                    "sh",
                    "-c",
                    f"cp {official} {work}/copy.whl && sha256sum {official} {work}/copy.whl",
                ]
            ),
        )
        ours = median_of(
            args.runs, lambda: timed([*tooling, "build", "--dist", str(work / "ours")], cwd=ROOT)
        )

        def naive() -> float:
            unpacked = work / "unpacked"
            shutil.rmtree(unpacked, ignore_errors=True)
            start = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "wheel", "unpack", "-d", str(unpacked), str(official)],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            (tree,) = unpacked.iterdir()
            (work / "naive").mkdir(exist_ok=True)
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "wheel",
                    "pack",
                    "--local-version",
                    "dflash.naive",
                    "-d",
                    str(work / "naive"),
                    str(tree),
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            return time.perf_counter() - start

        naive_s = median_of(args.naive_runs, naive)
    print(f"wheel: {built['filename']} ({built['size'] / 2**20:.0f} MiB)")
    print(f"{'what':<44}{'median s':>10}{'x cp':>8}")
    for label, value in (
        ("cp of the official wheel (floor)", cp),
        ("cp + sha256sum of input and output (floor 2)", verified),
        ("tooling build, warm (ours)", ours),
        ("wheel unpack + wheel pack (naive)", naive_s),
    ):
        print(f"{label:<44}{value:>10.2f}{value / cp:>8.2f}")
    print(
        f"ours / cp = {ours / cp:.2f} (goal <= 4.0); ours / verified copy = "
        f"{ours / verified:.2f}; naive / ours = {naive_s / ours:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
