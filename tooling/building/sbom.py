"""An SPDX 2.3 SBOM for the patched wheel (PEP 770: ``.dist-info/sboms/``).

It names the distribution, the upstream vLLM release, the official wheel
whose compiled members it reuses (by sha256) and each patch applied, so a
scanner sees the patched build as vLLM plus the known changes it carries.
Each patch is an SPDX file entry (SHA1 and SHA256), valid SPDX 2.3 by spdx-tools.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..errors import BuildError
from .manifest import BuildManifest, PatchEntry

SBOM_NAME = "vllm-dflash.spdx.json"
NAMESPACE = "https://vllm-dflash.invalid/spdx"


def _spdx_id(text: str) -> str:
    return "SPDXRef-" + "".join(c if c.isalnum() or c in ".-" else "-" for c in text)


def _file_checksums(patch: PatchEntry) -> list[dict[str, str]]:
    # SPDX 2.3 (section 8.4) makes a SHA1 mandatory for every file entry.
    if patch.sha1 is None:
        raise BuildError(f"patch {patch.id}: the build manifest has no sha1, which SPDX requires")
    return [
        {"algorithm": "SHA1", "checksumValue": patch.sha1},
        {"algorithm": "SHA256", "checksumValue": patch.sha256},
    ]


def spdx_document(manifest: BuildManifest, wheel_filename: str) -> dict[str, Any]:
    """The SBOM as a JSON-ready dict; deterministic for a given manifest."""
    created = time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime(manifest.source_date_epoch or 315532800)
    )
    dist_id = _spdx_id(f"vllm-{manifest.version}")
    upstream_id = _spdx_id(f"vllm-upstream-{manifest.base_version}")
    packages: list[dict[str, Any]] = [
        {
            "SPDXID": dist_id,
            "name": "vllm",
            "versionInfo": manifest.version,
            "packageFileName": wheel_filename,
            "downloadLocation": "NOASSERTION",
            "licenseConcluded": "Apache-2.0",
            "licenseDeclared": "Apache-2.0",
            "copyrightText": "NOASSERTION",
            "supplier": "Organization: vLLM DFlash distribution",
            "comment": (
                f"vLLM {manifest.base_version} with the DFlash patch series "
                f"{manifest.series_digest[:12]} ({manifest.mode} build)"
            ),
            "externalRefs": [
                {
                    "referenceCategory": "PACKAGE-MANAGER",
                    "referenceType": "purl",
                    "referenceLocator": f"pkg:pypi/vllm@{manifest.version}",
                }
            ],
        },
        {
            "SPDXID": upstream_id,
            "name": "vllm",
            "versionInfo": manifest.base_version,
            "downloadLocation": "https://pypi.org/project/vllm/" + manifest.base_version,
            "licenseConcluded": "Apache-2.0",
            "licenseDeclared": "Apache-2.0",
            "copyrightText": "NOASSERTION",
            "supplier": "Organization: vLLM project",
            "externalRefs": [
                {
                    "referenceCategory": "PACKAGE-MANAGER",
                    "referenceType": "purl",
                    "referenceLocator": f"pkg:pypi/vllm@{manifest.base_version}",
                }
            ],
        },
    ]
    relationships: list[dict[str, str]] = [
        {
            "spdxElementId": "SPDXRef-DOCUMENT",
            "relationshipType": "DESCRIBES",
            "relatedSpdxElement": dist_id,
        },
        {
            "spdxElementId": dist_id,
            "relationshipType": "DESCENDANT_OF",
            "relatedSpdxElement": upstream_id,
        },
    ]
    for artifact in manifest.upstream:
        if "sha256" not in artifact:
            continue
        art_id = _spdx_id(f"artifact-{artifact['file']}")
        packages.append(
            {
                "SPDXID": art_id,
                "name": artifact["file"],
                "versionInfo": manifest.base_version,
                "packageFileName": artifact["file"],
                "downloadLocation": "https://pypi.org/project/vllm/" + manifest.base_version,
                "checksums": [{"algorithm": "SHA256", "checksumValue": artifact["sha256"]}],
                "licenseConcluded": "Apache-2.0",
                "licenseDeclared": "Apache-2.0",
                "copyrightText": "NOASSERTION",
                "comment": f"official {artifact['kind']} of vLLM {manifest.base_version}",
            }
        )
        relation = "GENERATED_FROM" if artifact["kind"] == "wheel" else "DEPENDS_ON"
        relationships.append(
            {"spdxElementId": dist_id, "relationshipType": relation, "relatedSpdxElement": art_id}
        )
    files: list[dict[str, Any]] = []
    for patch in manifest.patches:
        if patch.status != "applied":
            continue
        patch_id = _spdx_id(f"patch-{patch.id}")
        files.append(
            {
                "SPDXID": patch_id,
                "fileName": f"./patches/{patch.file}",
                "checksums": _file_checksums(patch),
                "licenseConcluded": "Apache-2.0",
                "copyrightText": "NOASSERTION",
                "comment": f"patch {patch.id}, verified by probe {patch.probe}",
            }
        )
        relationships.append(
            {
                "spdxElementId": patch_id,
                "relationshipType": "PATCH_APPLIED",
                "relatedSpdxElement": dist_id,
            }
        )
    return {
        "spdxVersion": "SPDX-2.3",
        "dataLicense": "CC0-1.0",
        "SPDXID": "SPDXRef-DOCUMENT",
        "name": f"vllm-{manifest.version}",
        "documentNamespace": f"{NAMESPACE}/vllm-{manifest.version}-{manifest.series_digest[:16]}",
        "creationInfo": {
            "created": created,
            "creators": [f"Tool: vllm-dflash-tooling-{manifest.toolchain.get('version', '?')}"],
        },
        "packages": packages,
        "files": files,
        "relationships": relationships,
    }


def sbom_bytes(manifest: BuildManifest, wheel_filename: str) -> bytes:
    return (
        json.dumps(spdx_document(manifest, wheel_filename), indent=2, sort_keys=True) + "\n"
    ).encode("utf-8")
