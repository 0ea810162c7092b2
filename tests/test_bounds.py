"""Every size or count a user gives a command, at its most absurd: each is bounded before
memory or disk is used (a plan for 10^20 GPUs grew past 1.2 GB; ``--split 1`` wrote 671,604
parts), one line and an exit code of its own, never a hang or a traceback. The GPU host's
scripts' numbers: ``tests/test_gpu_scripts.py``; bundle --split: ``test_bundle_hostile.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tooling.cli import main
from tooling.errors import BundleError, SmokeCapacityError, SmokeError, SmokePairError

DRY = ["smoke", "--dry-run", "--tiny", "--gpus", "1x80"]

#: (arguments, exit code, what the one line says).
ABSURD = [
    ([*DRY[:-1], "10000000000x80"], SmokeError.exit_code, "expected COUNTxGIB"),
    ([*DRY[:-1], "65x80"], SmokeError.exit_code, "COUNT must be 1 to 64"),
    ([*DRY[:-1], "1x1e309"], SmokeError.exit_code, "expected COUNTxGIB"),
    ([*DRY, "--num-speculative-tokens", "1000000000000"], 2, "is not in the range 1<=x<=1024"),
    ([*DRY, "--num-speculative-tokens", "15"], SmokePairError.exit_code, "block_size 4 drafts"),
    ([*DRY, "--time-limit", "inf"], 2, "is not in the range 0.0<x<=604800"),
    ([*DRY, "--time-limit", "nan"], 2, "'nan' is not a finite number"),
    ([*DRY, "--gpu-memory-utilization", "nan"], 2, "'nan' is not a finite number"),
    ([*DRY, "--min-acceptance-length", "inf"], 2, "'inf' is not a finite number"),
    (
        [*DRY, "--kv-cache-memory-bytes", str(10**30)],
        SmokeCapacityError.exit_code,
        "serve with DFlash needs ",
    ),
    (
        [*DRY, "--tiny-arch", "seed", "--tiny-hidden-size", str(10**10)],
        SmokeCapacityError.exit_code,
        "the generated pair needs ",
    ),
    ([*DRY, "--tensor-parallel-size", str(10**6)], SmokeCapacityError.exit_code, "needs 1000000"),
    (["bundle", "--wheel", "{wheel}", "--split", "9" * 40 + "G"], BundleError.exit_code, "--split"),
    (["bundle", "--wheel", "{wheel}", "--split", "0"], BundleError.exit_code, "--split '0'"),
]


@pytest.mark.parametrize(("args", "code", "says"), ABSURD)
def test_an_absurd_size_or_count_is_refused_in_one_line(
    tmp_path: Path, args: list[str], code: int, says: str
) -> None:
    wheel = tmp_path / "vllm-0.20.1+dflash.12.abc-py3-none-any.whl"
    wheel.write_bytes(b"")
    given = [a.format(wheel=wheel) for a in args]
    env = {"VLLM_DFLASH_CACHE": str(tmp_path / "cache")}
    if given[0] == "smoke":  # a plan writes nothing: this folder must stay unmade
        given += ["--workdir", str(tmp_path / "w")]
    result: Any = CliRunner(env=env).invoke(main, given)
    assert result.exit_code == code, result.output
    assert says in result.stderr, result.stderr
    assert "Traceback" not in result.output
    assert not (tmp_path / "w").exists()
