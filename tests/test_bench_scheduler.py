"""bench/bench_scheduler_step.py on vLLM's real Scheduler (the fixed tree): its steady step
and its step with a prompt joining, for plain and for DFlash (issue 45)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tooling.paths import REPO_DIR


def _bench(script: str, args: list[str], patched: object, probe_python: Path) -> list[dict]:
    """``bench/SCRIPT ARGS --json`` in the probe interpreter on the patched tree: its rows."""
    work_dir = Path(patched.work_dir)  # type: ignore[attr-defined]
    done = subprocess.run(
        [str(probe_python), str(REPO_DIR / "bench" / script), *args, "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{work_dir}{os.pathsep}{REPO_DIR}"},
        cwd=work_dir.parent,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # vLLM logs on stdout too: the figures are the JSON list the bench prints last.
    return json.loads(done.stdout[done.stdout.rindex("[\n {") :])


@pytest.mark.slow
def test_the_scheduler_bench_times_a_step_with_a_prompt_joining(patched_0201, probe_python):
    """On the GPU a step with a prompt joining costs DFlash far more than a decode step
    (2026-12-05); the bench times the scheduler's side of such a step on the CPU."""
    args = ["--k", "15", "--steps", "8", "--concurrent", "16"]
    rows = {
        row["k"]: row for row in _bench("bench_scheduler_step.py", args, patched_0201, probe_python)
    }
    assert set(rows) == {0, 15}
    # Every request verifies K drafts a step with the drafter, one token without.
    assert rows[0]["tokens_per_step"] == 16 and rows[15]["tokens_per_step"] == 256
    for row in rows.values():
        assert row["steps"] == 8
        assert row["joining_ms_per_step"] > 0 and row["ms_per_step"] > 0


@pytest.mark.slow
def test_the_hold_bench_shows_fewer_steps_with_a_prefill_and_bounded_waits(
    patched_0201, probe_python
):
    """bench/bench_join_hold.py on the fixed tree: with the batch kept full at 16, a hold of
    4 steps leaves fewer steps with a prefill than none, and no request waits more than 4."""
    rates = "0.74,0.55,0.45,0.33,0.27,0.20,0.18,0.17,0.17,0.15,0.14,0.13,0.13,0.13,0.12"
    args = ["--concurrent", "16", "--steps", "240", "--holds", "0,4", "--acceptance", rates]
    none, held = _bench("bench_join_hold.py", args, patched_0201, probe_python)
    assert (none["hold"], held["hold"]) == (0, 4)
    assert none["wait_most"] == 0 and 0 < held["wait_most"] <= 4
    assert held["prefill_share"] < none["prefill_share"]
