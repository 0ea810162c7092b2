"""tooling verify against floors measured in the same run, on a fresh install of our wheel.

Floors: ``sha256sum`` over every file RECORD lists (the integrity check can do
no less), and a cold import of the vLLM modules the probes exercise (the
behavioural check can do no less). Ours: the integrity check alone, and the
whole ``tooling verify``, which hashes while the probes import. Goals: 1.5x
of each floor.

Run: .venv/bin/python bench/bench_verify.py [--wheel dist/vllm-*.whl] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tooling.paths import CacheLayout, default_cache_dir
from tooling.probing.env import ensure_probe_env
from tooling.verifying.verify import (
    check_files,
    install_into_fresh_env,
    locate_with_python,
    read_record,
)

IMPORTS = (
    "import vllm.v1.worker.gpu_model_runner, vllm.model_executor.models.qwen3_dflash, "
    "vllm.v1.core.sched.scheduler, vllm.config.speculative"
)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--wheel", type=Path)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    wheel = args.wheel or max(Path("dist").glob("vllm-*.whl"), key=lambda p: p.stat().st_mtime)
    cache = CacheLayout(default_cache_dir(os.environ))
    probe_python = ensure_probe_env(cache)
    with tempfile.TemporaryDirectory(prefix="bench-verify-") as tmp:
        python = install_into_fresh_env(wheel, probe_python, Path(tmp) / "venv")
        dist = locate_with_python(python)
        files = [str(dist.site / p) for p, h, _ in read_record(dist) if h]
        size = sum(os.path.getsize(f) for f in files)
        list_file = Path(tmp) / "files"
        list_file.write_text("\0".join(files))

        def sha256sum() -> None:
            subprocess.run(f"xargs -0 sha256sum < {list_file} > /dev/null", shell=True, check=True)

        def cold_import() -> None:
            env = {
                **os.environ,
                "PYTHONPYCACHEPREFIX": str(cache.root / "pycache"),
                "CUDA_VISIBLE_DEVICES": "",
                "VLLM_LOGGING_LEVEL": "WARNING",
            }
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            subprocess.run(
                [str(python), "-c", IMPORTS],
                check=True,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )

        def whole_verify() -> None:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "tooling",
                    "--no-progress",
                    "verify",
                    "--python",
                    str(python),
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )

        cold_import()  # bytecode into the shared prefix, as the probes would find it
        floor_hash = statistics.median(timed(sha256sum) for _ in range(args.runs))
        ours_hash = statistics.median(timed(lambda: check_files(dist)) for _ in range(args.runs))
        floor_import = statistics.median(timed(cold_import) for _ in range(args.runs))
        ours_verify = statistics.median(timed(whole_verify) for _ in range(args.runs))
    print(f"{len(files)} files, {size / 2**20:.0f} MiB installed from {wheel.name}")
    print(f"{'what':<52}{'median s':>10}{'ratio':>8}")
    print(f"{'sha256sum over RECORD files (floor)':<52}{floor_hash:>10.2f}")
    print(f"{'integrity check (ours)':<52}{ours_hash:>10.2f}{ours_hash / floor_hash:>8.2f}")
    print(f"{'import of the probed vLLM modules (floor)':<52}{floor_import:>10.2f}")
    print(
        f"{'tooling verify, whole (ours)':<52}{ours_verify:>10.2f}"
        f"{ours_verify / floor_import:>8.2f}"
    )
    print("goals: integrity <= 1.5x sha256sum; whole verify <= 1.5x the import")
    return 0


if __name__ == "__main__":
    sys.exit(main())
