"""``tooling release`` under hostile or careless input: a wheel published only under the
name its build gave it, a status matrix read with its size bounded, a manifest that is not
one named. Each refusal is one line (exit 13) and leaves --dist as it was."""

from __future__ import annotations

import json
import zipfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tooling.building.manifest import MANIFEST_NAME
from tooling.cli import main
from tooling.errors import ReleaseError

from .helpers import plain_manifest

VERSION = "0.20.1+dflash.12.3ab8ddb5"
BUILT = f"vllm-{VERSION}-1-cp38-abi3-manylinux_2_35_x86_64.whl"


def _manifest(**changed: Any) -> dict[str, Any]:
    manifest = plain_manifest(VERSION, build_tag="1")
    return {**asdict(manifest), **changed}


def _wheel(dist: Path, name: str = BUILT, manifest: Any = None) -> Path:
    """A wheel as the build names and stamps it: its dist-info, its WHEEL tags, its
    manifest (``manifest``: another document in its place)."""
    dist.mkdir(exist_ok=True)
    info = f"vllm-{VERSION}.dist-info"
    with zipfile.ZipFile(dist / name, "w") as zf:
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: vllm\nVersion: {VERSION}\n")
        zf.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nRoot-Is-Purelib: false\nBuild: 1\n"
            "Tag: cp38-abi3-manylinux_2_35_x86_64\n",
        )
        body = manifest if isinstance(manifest, str) else json.dumps(manifest or _manifest())
        zf.writestr(f"{info}/{MANIFEST_NAME}", body)
    return dist / name


def _release(dist: Path, *args: str) -> Any:
    return CliRunner().invoke(main, ["release", "--dist", str(dist), *args])


def test_the_wheel_under_its_own_name_is_released(tmp_path: Path) -> None:
    result = _release(_wheel(tmp_path / "d").parent)
    assert result.exit_code == 0, result.stderr
    assert f"{BUILT}" in (tmp_path / "d" / "SHA256SUMS").read_text()


@pytest.mark.parametrize(
    "renamed",
    [
        "vllm-9.9.9-py3-none-any.whl",
        f"vllm-{VERSION}-1-py3-none-any.whl",
        f"vllm-{VERSION}-2-cp38-abi3-manylinux_2_35_x86_64.whl",
        f"vllm-{VERSION}-cp38-abi3-manylinux_2_35_x86_64.whl",
        "vllm-0.20.1+dflash.12.ffffffff-1-cp38-abi3-manylinux_2_35_x86_64.whl",
        f"other-{VERSION}-1-cp38-abi3-manylinux_2_35_x86_64.whl",
        f"vllm-{VERSION}-1-cp38-abi3-manylinux_2_28_aarch64.whl",
    ],
)
def test_a_renamed_wheel_is_not_released(tmp_path: Path, renamed: str) -> None:
    """vllm-9.9.9-py3-none-any.whl had its notes and SHA256SUMS published under that name and
    version."""
    dist = tmp_path / "d"
    _wheel(dist, renamed)
    result = _release(dist, "--wheel", str(dist / renamed))
    assert result.exit_code == ReleaseError.exit_code, result.stderr
    assert result.stderr.startswith(f"error: {dist / renamed}: its name says ")
    assert (
        result.stderr.endswith(
            "a renamed wheel; release the file under the name the build gave it\n"
        )
        and result.stderr.count("\n") == 1
    )
    assert [p.name for p in dist.iterdir()] == [renamed]


def test_a_status_matrix_that_never_ends_is_refused_after_its_bound(tmp_path: Path) -> None:
    """/dev/zero reached 11.9 GB in 9 s."""
    dist = _wheel(tmp_path / "d").parent
    result = _release(dist, "--status-json", "/dev/zero")
    assert (result.exit_code, result.stderr) == (
        ReleaseError.exit_code,
        "error: /dev/zero: over 67108864 bytes: not a status matrix\n",
    )
    assert [p.name for p in dist.iterdir()] == [BUILT]


@pytest.mark.parametrize(
    ("manifest", "why"),
    [
        ("not json", "is not a build manifest ("),
        ("[]", "is not a build manifest ("),
        (_manifest(version=7), "is not a build manifest"),
        (_manifest(patches="all"), "is not a build manifest ("),
        ({**_manifest(), "surprise": 1}, "is not a build manifest ("),
    ],
)
def test_a_manifest_that_is_not_one_is_named(tmp_path: Path, manifest: Any, why: str) -> None:
    dist = _wheel(tmp_path / "d", manifest=manifest).parent
    result = _release(dist)
    assert result.exit_code == ReleaseError.exit_code, result.stderr
    assert result.stderr.startswith(f"error: {BUILT}: its {MANIFEST_NAME} {why}")
    assert result.stderr.count("\n") == 1 and [p.name for p in dist.iterdir()] == [BUILT]
