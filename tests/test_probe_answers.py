"""A probe interpreter's answer (``out.json``) read with every value checked: one that writes
something else (a broken install, a wrapper that prints its own JSON) leaves the probes
without a verdict, one line naming the file and the key (exit 12), never an "unexpected
JSONDecodeError/KeyError"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tooling.cli import main
from tooling.errors import ProbeError
from tooling.patching.registry import registry

from .helpers import answering_interpreter


def _answer(**entry: Any) -> str:
    base = {"probe": "layer_offset", "status": "present", "evidence": "e"}
    return json.dumps({"vllm_version": "0.20.1", "results": [{**base, **entry}]})


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        ("{not json", "not the probes' answer (not JSON: "),
        ('{"results": 5}', "results 5 is not a list of tables"),
        ('{"vllm_version": 1, "results": []}', "vllm_version 1 is not a string"),
        (json.dumps({"results": [{"probe": "layer_offset"}]}), "results[0]: missing key 'status'"),
        (_answer(status="maybe"), "results[0]: status 'maybe' is none of present, absent, "),
        (_answer(probe="nope"), "results[0]: probe 'nope' was not asked for ("),
        (_answer(evidence=None), "results[0]: evidence None is not a string"),
        (_answer(details=[1]), "results[0]: details [1] is not a table"),
        (_answer(form=3), "results[0]: form 3 is not a string"),
    ],
)
def test_an_answer_that_is_not_the_probes_is_one_line(
    tmp_path: Path, payload: str, why: str
) -> None:
    python, env = answering_interpreter(tmp_path, payload)
    (tmp_path / "tree" / "vllm").mkdir(parents=True)
    env["VLLM_DFLASH_CACHE"] = str(tmp_path / "cache")
    args = ["probe", "--python", str(python), "--root", str(tmp_path / "tree")]
    result = CliRunner(env=env).invoke(main, args)
    count = len(registry().probes)
    assert result.exit_code == ProbeError.exit_code, result.output
    assert result.stderr.startswith(
        f"error: {count} of {count} probes reached no verdict; layer_offset: "
    )
    assert f"out.json: {why}" in result.stderr and result.stderr.count("\n") == 1, result.stderr
