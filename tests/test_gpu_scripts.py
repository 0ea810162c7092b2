"""The GPU host's scripts (``ci/gpu``) under hostile or careless input, run here as on the
host (``helpers.run_gpu_script``): no value from the environment is evaluated by the shell,
and every script refuses what its usage line does not name before it does anything."""

from __future__ import annotations

from pathlib import Path

from .helpers import run_gpu_script


def test_time_limit_is_never_evaluated_by_the_shell(tmp_path: Path) -> None:
    """bash arithmetic runs the command substitution in an array subscript: the value is
    refused as what it is, a setting that is not a number, before anything runs."""
    marker, out = tmp_path / "PWNED", tmp_path / "out"
    done = run_gpu_script(
        "production-smoke.sh",
        "default",
        work=tmp_path / "work",
        out=out,
        PATCHED_SITE=str(tmp_path / "site"),
        TIME_LIMIT=f"PATH[$(touch {marker})]",
    )
    assert not marker.exists()
    assert (done.returncode, done.stderr) == (
        2,
        "error: production-smoke.sh: TIME_LIMIT must be a whole number (at most 9 digits), "
        f"not 'PATH[$(touch {marker})]'\n",
    )
    assert not out.exists() and not (tmp_path / "work").exists()
