"""The build manifest stored inside the wheel's ``.dist-info``: what went into it.

``tooling verify`` reads it back from an installed environment to map a
modified file to the patch that owns it and to tell our fix from upstream's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

MANIFEST_NAME = "dflash_build.json"
#: 2: ``runtime_version``, the version stamped into vllm/_version.py.
#: 3: the members the build writes are stored, not deflated; ``zlib_version`` is no longer set.
SCHEMA = 3


@dataclass
class ChangedFile:
    path: str
    patches: list[str]
    sha256_before: str | None
    sha256_after: str | None


@dataclass
class PatchEntry:
    id: str
    file: str
    sha256: str
    status: str
    probe: str | None
    probe_before: str | None
    probe_after: str | None
    commit: str | None = None
    sha1: str | None = None
    """SHA1 of the patch file: SPDX 2.3 requires one for every file (None: written before it)."""


@dataclass
class BuildManifest:
    version: str
    base_version: str
    mode: str
    source: str
    upstream: list[dict[str, Any]]
    series_digest: str
    validated_base: str | None
    patches: list[PatchEntry]
    skipped: list[str]
    files: list[ChangedFile]
    toolchain: dict[str, str]
    build_tag: str | None = None
    source_date_epoch: int | None = None
    runtime_version: str | None = None
    """What ``vllm.__version__`` reports (None: a schema-1 build, not stamped)."""
    zlib_version: str | None = None
    """Schema 2 only: the zlib that deflated the members the build wrote, on which their
    bytes depended. From schema 3 they are stored and no zlib shapes them; recording the
    builder's zlib here would itself make the wheel differ by machine, so it is None (the
    build's ``--json`` output names it: ``builder``)."""
    schema: int = SCHEMA
    notes: list[str] = field(default_factory=list)

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self), indent=2, sort_keys=True) + "\n").encode("utf-8")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BuildManifest:
        data = dict(data)
        data["patches"] = [PatchEntry(**p) for p in data["patches"]]
        data["files"] = [ChangedFile(**f) for f in data["files"]]
        return cls(**data)

    def applied_patch_ids(self) -> set[str]:
        """Patches whose code this build carries (applied by us, not found upstream)."""
        return {p.id for p in self.patches if p.status == "applied"}

    def owners(self, path: str) -> list[str]:
        for f in self.files:
            if f.path == path:
                return f.patches
        return []
