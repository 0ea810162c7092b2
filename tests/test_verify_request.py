"""``verify_requested``: the install a request names, resolved and verified. The --wheel way,
end to end on a minimal wheel: pip installs it into a scratch virtualenv, the probes (here an
interpreter without torch, so they read unknown at once) question it, and the scratch goes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tooling.errors import BuildError, VerifyFixMissingError
from tooling.patching.registry import registry
from tooling.paths import CacheLayout
from tooling.verifying.request import VerifyRequest, verify_requested
from tooling.verifying.verify import FixState

from .wheels import build_wheel


def test_a_wheel_is_verified_in_a_scratch_env_that_goes_afterwards(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path, "vllm", "0.20.1")
    fixes = registry().fixes
    report = verify_requested(
        VerifyRequest(
            cache=CacheLayout(tmp_path / "cache"),
            required=[fixes[0].number],
            wheel=wheel,
            probe_python=Path(sys.executable),
        )
    )
    assert report.dist.version == "0.20.1"
    assert report.dist.dist_info == "vllm-0.20.1.dist-info"
    assert "dflash-verify-" in str(report.dist.site)
    assert not report.dist.site.exists()  # the scratch virtualenv is removed
    # and the bytecode its imports left under the cache's prefix, which nothing reads again
    scratch = next(p for p in report.dist.site.parents if p.name.startswith("dflash-verify-"))
    assert (tmp_path / "cache" / "pycache").is_dir()
    assert not (tmp_path / "cache" / "pycache" / scratch.relative_to(scratch.anchor)).exists()
    assert report.integrity_ok, report.problems
    assert report.files_checked >= 4  # the wheel's own four, and what pip added
    assert report.manifest is None
    assert [f.state for f in report.fixes] == [FixState.UNKNOWN] * len(fixes)
    with pytest.raises(VerifyFixMissingError, match=r"^required fix not present: "):
        report.raise_unless_ok()


def test_a_wheel_without_a_probe_environment_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TOOLING_PROBE_PYTHON", raising=False)
    request = VerifyRequest(
        cache=CacheLayout(tmp_path / "empty-cache"), wheel=build_wheel(tmp_path, "vllm", "0.20.1")
    )
    with pytest.raises(BuildError, match=r"^--wheel needs the probe environment"):
        verify_requested(request)
