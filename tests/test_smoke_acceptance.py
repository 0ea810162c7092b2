"""The acceptance table's two sides: ``tooling.trained.acceptance`` (toolchain) starts
``tooling.trained.serving.acceptance`` (serving interpreter) once per engine folder, that folder
first on PYTHONPATH, and turns each child's result into a row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tooling.trained.acceptance import figures, measure_engines, table_markdown
from tooling.trained.serving.acceptance import SPEC


def _trained(folder: Path) -> Path:
    folder.mkdir()
    reference = {
        "mean_acceptance_length": 2.0,
        "num_accepted_tokens": 3,
        "num_draft_tokens": 9,
        "acceptance_per_position": [0.5, 0.3, 0.2],
    }
    (folder / "summary.json").write_text(json.dumps({"reference": reference}))
    prompts = {"prompts": [{"token_ids": [1, 2, 3]}], "max_new_tokens": 4}
    (folder / "prompts.json").write_text(json.dumps({**prompts, "num_speculative_tokens": 3}))
    (folder / "reference.json").write_text(json.dumps({"prompts": [{"output_ids": [5, 6]}]}))
    return folder


def test_each_engine_runs_in_a_serving_child_with_its_folder_first(tmp_path: Path) -> None:
    # An engine folder whose vllm cannot be imported: the child, started from the serving
    # package, must import exactly this one and report its failure as the engine's row.
    engine = tmp_path / "engine"
    (engine / "vllm").mkdir(parents=True)
    (engine / "vllm" / "__init__.py").write_text("raise ImportError('engine folder vllm')\n")
    reference, rows = measure_engines(
        _trained(tmp_path / "trained"), {"broken": engine}, tmp_path / "out", timeout_s=120
    )
    assert reference["mean_acceptance_length"] == 2.0
    [row] = rows
    assert row.engine == "broken"
    assert row.error == "ImportError: engine folder vllm"
    table = (tmp_path / "out" / "acceptance.md").read_text()
    assert "| broken | error: ImportError: engine folder vllm |" in table
    assert json.loads((tmp_path / "out" / "acceptance.json").read_text())["engines"][0]["error"]


def test_the_serving_child_refuses_a_wrong_command_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tooling.trained.serving.acceptance", "measure"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "usage: python -m tooling.trained.serving.acceptance run" in result.stderr


def test_a_row_reads_the_serving_sides_counters() -> None:
    result = {
        "vllm_version": "0.20.1",
        "startup_s": 1.5,
        "outputs": [[5, 6]],
        "spec": {
            f"{SPEC}num_drafts": 4,
            f"{SPEC}num_draft_tokens": 12,
            f"{SPEC}num_accepted_tokens": 6,
            f"{SPEC}num_accepted_tokens_per_pos": [3, 2, 1],
        },
        "prefix_repeat": {"cached_tokens": 0, "full_block_tokens": 0},
    }
    row = figures("patched", result, [[5, 6]])
    assert row.acceptance_length == 2.5
    assert row.per_position == [0.75, 0.5, 0.25]
    assert row.outputs_equal_reference == 1
    assert "| patched | 2.500 | 0.500 | 0.75, 0.50, 0.25 | 1.250 | 1/1 | - |" in table_markdown(
        {"mean_acceptance_length": 2.0}, [row]
    )
