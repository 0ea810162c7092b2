"""The DFlash server on the executor asked for, and a Ray executor the serving
interpreter cannot start refused before any engine."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tooling.smoke import run_smoke

from .smoke_runner_helpers import _config, standin_vllm_fixture  # noqa: F401 (fixture)


def _standin_ray(site: Path, version: str) -> None:
    """A Ray package on the serving interpreter's path, as far as vLLM's checks look."""
    (site / "ray" / "experimental").mkdir(parents=True)
    (site / "ray" / "__init__.py").write_text(f'__version__ = "{version}"\n')
    (site / "ray" / "experimental" / "__init__.py").write_text("")
    (site / "ray" / "experimental" / "compiled_dag_ref.py").write_text("")
    info = site / f"ray-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: ray\nVersion: {version}\n")


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_the_dflash_server_runs_on_the_executor_asked_for(
    tmp_path, standin_vllm, monkeypatch, backend
) -> None:
    monkeypatch.setenv("STANDIN_MODE", "fixed")
    monkeypatch.setenv("STANDIN_GPUS", "2")
    # A cluster elsewhere: a Ray server starts an instance of its own instead.
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    _standin_ray(tmp_path / "site", "2.48.0")
    config = _config(tmp_path, *standin_vllm)
    engine = replace(
        config.engine,
        tensor_parallel_size=2,
        disable_custom_all_reduce=True,
        distributed_executor_backend=backend,
    )
    report = run_smoke(replace(config, engine=engine), notify=lambda m: None)
    assert report.passed, report.summary_line()
    assert report.engine["distributed_executor_backend"] == backend
    logs = tmp_path / "smoke" / "logs"
    text = (logs / "serve-dflash.log").read_text()
    assert f"--distributed-executor-backend {backend}" in text.splitlines()[0]
    assert f"RAY_ADDRESS={'local' if backend == 'ray' else '10.0.0.1:6379'}" in text
    # The control keeps vLLM's choice: one Ray instance a run.
    text = (logs / "serve-plain.log").read_text()
    assert "--distributed-executor-backend" not in text.splitlines()[0]
    assert "RAY_ADDRESS=10.0.0.1:6379" in text
    # Only a Ray run asks the serving interpreter about Ray.
    assert report.vllm.get("ray_version") == ("2.48.0" if backend == "ray" else None)


@pytest.mark.parametrize(
    ("ray", "why"),
    [
        (None, "ValueError: Failed to import Ray: No module named 'ray'."),
        ("2.40.0", "ValueError: Ray version 2.43.0 is required, but found 2.40.0"),
    ],
)
def test_the_ray_executor_without_a_usable_ray_is_refused_before_any_engine(
    tmp_path, standin_vllm, monkeypatch, ray, why
) -> None:
    """The serving interpreter (this one, whose environment has no Ray, or one with a Ray
    too old for vLLM's executor) is refused in one line naming it, why and the fix."""
    from click.testing import CliRunner

    from tooling.cli import main

    assert importlib.util.find_spec("ray") is None, "this test needs an environment without Ray"
    if ray is not None:
        _standin_ray(tmp_path / "site", ray)
    monkeypatch.setenv("STANDIN_GPUS", "2")
    target, drafter = standin_vllm
    args = ["--no-progress", "smoke", "--target", str(target), "--drafter", str(drafter)]
    args += ["--workdir", str(tmp_path / "w"), "--no-fidelity", "--tensor-parallel-size", "2"]
    args += ["--distributed-executor-backend", "ray", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 17, result.output
    error = json.loads(result.stdout)["error"]
    assert "\n" not in error and result.stderr.splitlines()[-1] == f"error: {error}"
    assert error.startswith(
        f"--distributed-executor-backend ray: vLLM's Ray executor cannot start for "
        f"{sys.executable} ({why}"
    )
    assert "install ray==2.48.0 there (the bundle's --extra ray==2.48.0" in error
    assert not (tmp_path / "w" / "logs" / "serve-dflash.log").exists()
