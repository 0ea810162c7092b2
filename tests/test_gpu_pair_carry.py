"""Carrying the trained hybrid pair between GPU sessions (``ci/gpu``): the host's
``trained-hybrid.sh export-pair`` and ``import-pair`` and ``pair-parts.sh`` here, run on real
files with this machine's Python standing in for the host's, as the README tells a user to
run them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tooling.paths import REPO_DIR

from .helpers import run_gpu_script

GPU = REPO_DIR / "ci" / "gpu"


def _run(script: str, *args: str, work: Path, out: Path | None = None) -> str:
    done = run_gpu_script(script, *args, work=work, out=out)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_pair_brought_back_in_several_commands_is_carried_in_whole(tmp_path: Path) -> None:
    host, later = tmp_path / "host", tmp_path / "later"
    pair = host / "hybrid-pair"
    (pair / "target").mkdir(parents=True)
    (pair / "summary.json").write_text('{"recipe": "x"}')
    weights = os.urandom(40 << 20)
    (pair / "target" / "model.safetensors").write_bytes(weights)
    # 40 MiB in parts of 15 MiB: three parts, four a command, so one command; then a second
    # run of the export, as after a lost command, brings the same parts.
    first, again = tmp_path / "out-0", tmp_path / "out-0-again"
    for out in (first, again):
        out.mkdir()
        said = _run("trained-hybrid.sh", "export-pair", "0", work=host, out=out)
        assert "pair parts: 3, four a command; this was CALL 0 of 0..0" in said
    assert sorted(p.name for p in first.iterdir()) == [
        "SHA256SUMS",
        "hybrid-pair.tar.part-000",
        "hybrid-pair.tar.part-001",
        "hybrid-pair.tar.part-002",
        "join.py",
    ]
    assert all(p.stat().st_size <= 16 << 20 for p in first.iterdir())
    assert [p.read_bytes() for p in sorted(first.iterdir())] == [
        p.read_bytes() for p in sorted(again.iterdir())
    ]
    # A device command's folder can bring more back beside the parts: here the recipe's
    # reports, as the session's first export did.
    (first / "train-out").mkdir()
    (first / "train-out" / "summary.json").write_text("{}")
    carry = tmp_path / "carry"
    subprocess.run(
        ["bash", str(GPU / "pair-parts.sh"), str(carry), str(20 << 20), "--", str(first)],
        check=True,
        capture_output=True,
        cwd=REPO_DIR,
    )
    assert all(p.stat().st_size <= 20 << 20 for p in carry.iterdir())
    said = _run("trained-hybrid.sh", "import-pair", str(carry), work=later)
    assert "trained pair carried in" in said
    carried = later / "hybrid-pair"
    assert (carried / "target" / "model.safetensors").read_bytes() == weights
    assert (carried / "summary.json").read_text() == '{"recipe": "x"}'
    assert sorted(p.name for p in later.iterdir()) == ["hybrid-pair"]


def test_a_corrupt_part_is_named_and_nothing_is_carried_in(tmp_path: Path) -> None:
    host, later = tmp_path / "host", tmp_path / "later"
    (host / "hybrid-pair").mkdir(parents=True)
    (host / "hybrid-pair" / "summary.json").write_text("{}")
    (host / "hybrid-pair" / "w.bin").write_bytes(os.urandom(1 << 20))
    out = tmp_path / "out"
    out.mkdir()
    _run("trained-hybrid.sh", "export-pair", "0", work=host, out=out)
    part = out / "hybrid-pair.tar.part-000"
    part.write_bytes(b"x" + part.read_bytes()[1:])
    later.mkdir()
    done = run_gpu_script("trained-hybrid.sh", "import-pair", str(out), work=later)
    assert done.returncode != 0
    assert "hybrid-pair.tar.part-000 is corrupt" in done.stderr
    assert not (later / "hybrid-pair").exists()
