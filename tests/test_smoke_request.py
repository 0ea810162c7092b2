"""``smoke_requested``: the branches the command takes, without a GPU (a dry run, and what is
refused before anything is installed or trained)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tooling.cli.smoke_request import SmokeRequest, smoke_requested
from tooling.errors import SmokeError
from tooling.smoke import GpuFacts, SmokeConfig


def test_a_dry_run_returns_the_plan_and_writes_nothing(tmp_path: Path) -> None:
    workdir = tmp_path / "w"
    config = SmokeConfig(workdir=workdir, tiny=True, gpus=GpuFacts(1, 141 * 2**30))
    # A wheel that is not there: a plan does not install it.
    request = SmokeRequest(config, tmp_path, wheel=tmp_path / "absent.whl", dry_run=True)
    outcome = smoke_requested(request)
    assert list(tmp_path.iterdir()) == []
    assert outcome.failure is None
    assert outcome.data["ok"] is True
    plan = outcome.data["plan"]
    assert plan["workdir"] == str(workdir)
    assert plan["steps"][0]["step"] == "models"
    # The text is the same plan for people: what runs where, and why.
    assert outcome.text.splitlines()[0] == f"full smoke of {workdir}/models/target with " + (
        f"{workdir}/models/drafter"
    )
    assert "engines side by side: all 5 engines fit at once" in outcome.text


def test_a_stock_site_and_a_stock_wheel_together_are_refused(tmp_path: Path) -> None:
    config = SmokeConfig(workdir=tmp_path / "w", tiny=True, other_site=str(tmp_path))
    request = SmokeRequest(config, tmp_path, stock_wheel=tmp_path / "x.whl", dry_run=True)
    with pytest.raises(SmokeError, match=r"^give --stock-site or --stock-wheel, not both$"):
        smoke_requested(request)


@pytest.mark.parametrize("which", ["trained", "trained_hybrid"])
def test_a_dry_run_of_the_trained_pairs_is_refused_before_anything_runs(
    tmp_path: Path, which: str
) -> None:
    request = SmokeRequest(
        SmokeConfig(workdir=tmp_path / "w"), tmp_path / "cache", dry_run=True, **{which: True}
    )
    with pytest.raises(SmokeError, match=r"^--dry-run prints a smoke's plan, which --trained "):
        smoke_requested(request)
    assert list(tmp_path.iterdir()) == []


def test_a_bad_engine_is_refused_before_training(tmp_path: Path) -> None:
    request = SmokeRequest(
        SmokeConfig(workdir=tmp_path / "w"), tmp_path / "cache", trained=True, engines=("bad",)
    )
    with pytest.raises(SmokeError, match=r"^--engine 'bad': expected NAME=DIR"):
        smoke_requested(request)
    assert not (tmp_path / "cache").exists()


def test_a_dry_run_that_cannot_see_gpus_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    """This interpreter has no GPU (or no torch): the query's own log is gone with its scratch
    folder, so the line carries its reason."""
    config = SmokeConfig(workdir=tmp_path / "w", tiny=True)
    with pytest.raises(SmokeError, match=r"cannot query the GPUs \(.+\): give --gpus COUNTxGIB"):
        smoke_requested(SmokeRequest(config, tmp_path, dry_run=True))
    assert list(tmp_path.iterdir()) == []


def test_engines_are_installs_named_once_and_only_for_the_trained_pairs(tmp_path: Path) -> None:
    install = tmp_path / "install"
    (install / "vllm").mkdir(parents=True)
    (install / "vllm" / "__init__.py").write_text("")
    config = SmokeConfig(workdir=tmp_path / "w")
    cases = [
        # A folder without vllm in it is no install.
        ({"trained": True, "engines": (f"a={tmp_path}",)}, r"^--engine 'a=.*': expected NAME=DIR"),
        (
            {"trained": True, "engines": (f"a={install}", f"a={install}")},
            r"^--engine a: named twice",
        ),
        # Without a trained pair --engine would be ignored.
        ({"engines": (f"a={install}",)}, r"^--engine names installs for --trained or "),
    ]
    for kw, message in cases:
        with pytest.raises(SmokeError, match=message):
            smoke_requested(SmokeRequest(config, tmp_path / "cache", **kw))
    assert not (tmp_path / "cache").exists()
