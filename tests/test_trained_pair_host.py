"""The trained hybrid pair's commands as a GPU host runs them: one lacking engine installs names
them, before any training or serving spends the GPU's time."""

from __future__ import annotations

from pathlib import Path

import pytest

from tooling.trained import hybrid_plan as hp

from .helpers import run_gpu_script
from .trained_pair_helpers import K, _pair


def test_trained_hybrid_names_the_installs_it_lacks_before_training(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from tooling.cli import main
    from tooling.errors import SmokeError

    patched = tmp_path / "patched"
    (patched / "vllm").mkdir(parents=True)
    (patched / "vllm" / "__init__.py").write_text("")
    result = CliRunner().invoke(
        main,
        [
            "smoke",
            "--trained-hybrid",
            "--engine",
            f"patched={patched}",
            "--workdir",
            str(tmp_path / "work"),
        ],
    )
    assert result.exit_code == SmokeError.exit_code
    missing = ", ".join(sorted(s for s in hp.SITES if s != "patched"))
    assert result.stderr == f"error: --trained-hybrid needs --engine NAME=DIR for {missing}\n"
    # Refused before any training: nothing was written but the work folder.
    assert [p.name for p in (tmp_path / "work").iterdir()] == []


def test_a_call_on_a_host_names_the_installs_its_engines_folder_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tooling.errors import SmokeError
    from tooling.trained import measure as trained

    root = tmp_path / "engines"
    for site in ("patched", "stock", f"no-{hp.ABLATED[0]}"):
        (root / site).mkdir(parents=True)
    pair = _pair(tmp_path)
    work = tmp_path / "work"
    code = trained.main(["run-call", str(pair), str(work), "1", "--engines-root", str(root)])
    assert code == SmokeError.exit_code
    # Only the installs call 1's engines serve are named (the pair has one K here, so
    # call 1 also serves the ablations).
    have = {"patched", "stock", f"no-{hp.ABLATED[0]}"}
    served = {v.site for v in hp.chosen_variants(pair) if v.call == 1}
    lacking = ", ".join(sorted(served - have))
    assert f"no-{hp.STATE_FIX}" in lacking
    assert capsys.readouterr().err == f"error: {root} lacks {lacking}\n"
    assert not work.exists()
    # A call of only the engines the folder has runs: its plan is written.
    only = ["--only", f"plain,patched-k{K},patched-k{K}-replay", "--time-limit", "1"]
    trained.main(["run-call", str(pair), str(work), "1", "--engines-root", str(root), *only])
    assert "error" not in capsys.readouterr().err.split("\n")[0]
    assert (work / f"patched-k{K}-replay.in.json").is_file()


def test_the_host_chain_fails_when_a_call_fails(tmp_path: Path) -> None:
    # ci/gpu/trained-hybrid.sh chain, as a GPU session runs it, on a pair whose calls cannot
    # run here (no engine installs): each call's report fails, so the chain does too.
    work = tmp_path / "work"
    work.mkdir()
    _pair(tmp_path).rename(work / "hybrid-pair")
    done = run_gpu_script("trained-hybrid.sh", "chain", work=work)
    assert done.returncode != 0, done.stdout
    # No engines folder at all: each call names the installs its own engines serve, in one
    # line, and the calls together name every install.
    prefix = f"error: {work / 'engines'} lacks "
    lines = [line for line in done.stderr.splitlines() if line.startswith(prefix)]
    assert len(lines) == done.stdout.count(": done in ") >= 2
    named = {site for line in lines for site in line.removeprefix(prefix).split(", ")}
    assert named == set(hp.SITES)
    assert "Traceback" not in done.stderr
