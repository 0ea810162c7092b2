"""The wheel's SBOM against the reference SPDX 2.3 parser and validator (spdx-tools)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
from spdx_tools.spdx.parser.parse_anything import parse_file
from spdx_tools.spdx.validation.document_validator import validate_full_spdx_document

from tooling.building.build import make_manifest
from tooling.building.identity import WheelIdentity
from tooling.building.manifest import BuildManifest, ChangedFile, PatchEntry
from tooling.building.sbom import SBOM_NAME, sbom_bytes
from tooling.errors import BuildError
from tooling.fetching.upstream import Upstream
from tooling.patching.outcome import APPLIED, PatchOutcome, SeriesReport

WHEEL = "vllm-0.20.1+dflash.6.0123456789ab-1-cp38-abi3-manylinux_2_35_x86_64.whl"


def _patch(n: int, name: str, status: str) -> PatchEntry:
    file = f"{n:04d}-{name}.patch"
    return PatchEntry(
        id=name,
        file=file,
        sha256=hashlib.sha256(file.encode()).hexdigest(),
        sha1=hashlib.sha1(file.encode()).hexdigest(),
        status=status,
        probe=name.replace("-", "_"),
        probe_before="absent",
        probe_after="present",
        commit="0" * 40,
    )


@pytest.fixture
def manifest() -> BuildManifest:
    """A precompiled build of two applied patches and one upstream already carries."""
    return BuildManifest(
        version="0.20.1+dflash.6.0123456789ab",
        runtime_version="0.20.1+dflash.6.0123456789ab",
        base_version="0.20.1",
        mode="precompiled",
        source="pypi",
        upstream=[
            {"kind": "sdist", "file": "vllm-0.20.1.tar.gz", "sha256": "a" * 64},
            {
                "kind": "wheel",
                "file": "vllm-0.20.1-1-cp38-abi3-manylinux_2_35_x86_64.whl",
                "sha256": "b" * 64,
            },
        ],
        series_digest="c" * 64,
        validated_base="0.20.1",
        patches=[
            _patch(1, "dflash-layer-id-offset", "applied"),
            _patch(2, "dflash-swa-config", "present"),
            _patch(3, "eagle-cache-drop", "applied"),
        ],
        skipped=[],
        files=[ChangedFile("vllm/x.py", ["0001-dflash-layer-id-offset.patch"], "d" * 64, "e" * 64)],
        toolchain={"name": "vllm-dflash-tooling", "version": "0.1.0"},
        build_tag="1",
        source_date_epoch=1795910400,
    )


def test_sbom_is_valid_spdx_2_3(tmp_path, manifest):
    path = tmp_path / SBOM_NAME
    path.write_bytes(sbom_bytes(manifest, WHEEL))
    document = parse_file(str(path))
    problems = [m.validation_message for m in validate_full_spdx_document(document)]
    assert problems == []
    # The content the build tests rely on survives the round trip.
    assert document.creation_info.spdx_version == "SPDX-2.3"
    assert sorted(f.name for f in document.files) == [
        "./patches/0001-dflash-layer-id-offset.patch",
        "./patches/0003-eagle-cache-drop.patch",
    ]
    applied = [r for r in document.relationships if r.relationship_type.name == "PATCH_APPLIED"]
    assert len(applied) == 2


def test_sbom_is_deterministic_and_names_every_patch_digest(manifest):
    first = sbom_bytes(manifest, WHEEL)
    assert first == sbom_bytes(manifest, WHEEL)
    checksums = {f["fileName"]: f["checksums"] for f in json.loads(first)["files"]}
    assert checksums == {
        f"./patches/{p.file}": [
            {"algorithm": "SHA1", "checksumValue": p.sha1},
            {"algorithm": "SHA256", "checksumValue": p.sha256},
        ]
        for p in manifest.patches
        if p.status == "applied"
    }


def test_sbom_refuses_a_manifest_without_patch_sha1(manifest):
    """A manifest written before sha1 was recorded cannot give a valid SPDX file entry."""
    manifest.patches[0].sha1 = None
    with pytest.raises(BuildError, match="^patch dflash-layer-id-offset: .* no sha1"):
        sbom_bytes(manifest, WHEEL)


def _validate(path: Path) -> list[str]:
    return [m.validation_message for m in validate_full_spdx_document(parse_file(str(path)))]


def test_a_build_manifest_of_the_real_series_gives_a_valid_sbom(tmp_path, catalog, series):
    """make_manifest records each patch file's sha1 and not the builder's zlib (the wheel would
    then differ by machine); the SBOM built on it validates."""
    base = catalog.get("0.20.1")
    upstream = Upstream(base, "pypi", tmp_path, Path(base.wheel.filename), Path("sdist"))
    outcomes = [
        PatchOutcome(
            p.id, p.file.name, p.sha256, APPLIED, "applied", probe_before={"status": "absent"}
        )
        for p in series.patches
    ]
    report = SeriesReport(
        "0.20.1", "pypi", upstream.identity, series.digest, "", "", "", outcomes, None
    )
    identity = WheelIdentity("vllm", "0.20.1+dflash.6.abc", None, "cp38-abi3-manylinux_2_35_x86_64")
    manifest = make_manifest(
        upstream, series, report, identity, identity.version, "precompiled", [], 1795910400, []
    )
    assert [p.sha1 for p in manifest.patches] == [
        hashlib.sha1(p.file.read_bytes()).hexdigest() for p in series.patches
    ]
    assert manifest.zlib_version is None and manifest.schema == 3
    path = tmp_path / SBOM_NAME
    path.write_bytes(sbom_bytes(manifest, identity.filename))
    assert _validate(path) == []


def test_a_manifest_written_before_sha1_and_zlib_still_reads(manifest):
    old = json.loads(manifest.to_bytes())
    for entry in old["patches"]:
        del entry["sha1"]
    del old["zlib_version"]
    again = BuildManifest.from_json(old)
    assert again.zlib_version is None and {p.sha1 for p in again.patches} == {None}
    # Schema 2 recorded the zlib that deflated the written members.
    schema2 = BuildManifest.from_json({**old, "schema": 2, "zlib_version": "1.2.13"})
    assert schema2.zlib_version == "1.2.13"
    assert again == dataclasses.replace(
        manifest, patches=[dataclasses.replace(p, sha1=None) for p in manifest.patches]
    )
