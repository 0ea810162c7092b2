"""Release artifacts: checksums, the manifest beside the wheel, and release notes.

The notes are generated from data, never written by hand: the series ledger
says what each patch is for, the wheel's manifest says what this build
carries, and the status matrix (``tooling patch status --json``) says where
upstream caught up, so a patch is listed as carried, as dropped (now
upstream) or as superseded on later releases.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import Version

from ..building.build import single_wheel
from ..building.manifest import MANIFEST_NAME, BuildManifest
from ..building.wheelfile import check_members, open_wheel, read_member
from ..errors import ReleaseError
from ..fsutil import atomic_write_text, read_bounded, sha256_bytes, sha256_file
from ..patching.series import Series
from ..report import STATUS_LEGEND, markdown_table, status_cells

logger = logging.getLogger(__name__)

UPSTREAM_STATUSES = ("superseded", "already-applied")
#: The largest status matrix read: every pinned release's is under a megabyte.
STATUS_LIMIT = 64 << 20
#: What the notes read of each outcome in the status matrix.
_OUTCOME_KEYS = ("patch_id", "status")


#: The largest manifest read from a wheel: a build's is a few kB.
MANIFEST_LIMIT = 16 << 20


def read_wheel_manifest(wheel: Path) -> BuildManifest:
    """The build manifest in ``wheel``: a ReleaseError naming the wheel when there is none,
    or one that is not a manifest (its size bounded before it is read)."""
    with open_wheel(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(f".dist-info/{MANIFEST_NAME}")]
        if not names:
            raise ReleaseError(
                f"{wheel.name} has no {MANIFEST_NAME}: not a wheel this toolchain built"
            )
        if zf.getinfo(names[0]).file_size > MANIFEST_LIMIT:
            raise ReleaseError(f"{wheel.name}: its {MANIFEST_NAME} is over {MANIFEST_LIMIT} bytes")
        manifest = _manifest(wheel, read_member(zf, names[0]))
        dist_info = names[0].split("/", 1)[0]
        wheel_file = f"{dist_info}/WHEEL"
        if wheel_file not in zf.namelist() or zf.getinfo(wheel_file).file_size > MANIFEST_LIMIT:
            raise ReleaseError(f"{wheel.name}: no {wheel_file} of a sane size")
        tags = {
            line.split(":", 1)[1].strip()
            for line in read_member(zf, wheel_file).decode("utf-8", "replace").splitlines()
            if line.startswith("Tag:")
        }
    check_wheel_name(wheel, manifest, dist_info, tags)
    return manifest


def _manifest(wheel: Path, raw: bytes) -> BuildManifest:
    try:
        manifest = BuildManifest.from_json(json.loads(raw))
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ReleaseError(
            f"{wheel.name}: its {MANIFEST_NAME} is not a build manifest ({e})"
        ) from None
    if not isinstance(manifest.version, str) or not isinstance(manifest.build_tag, str | None):
        raise ReleaseError(f"{wheel.name}: its {MANIFEST_NAME} is not a build manifest")
    return manifest


def check_wheel_name(wheel: Path, manifest: BuildManifest, dist_info: str, tags: set[str]) -> None:
    """``wheel``'s file name is the one its build gave it: its name and version are its
    manifest's and its dist-info's, its build tag the manifest's, its tags its WHEEL file's.
    A renamed wheel would have its notes and SHA256SUMS published under a name, version or
    platform it is not."""
    try:
        name, version, build, named_tags = parse_wheel_filename(wheel.name)
    except InvalidWheelFilename as e:
        raise ReleaseError(f"{wheel.name}: not a wheel's file name ({e})") from None
    tag = f"{build[0]}{build[1]}" if build else None
    said = f"{canonicalize_name(name)} {version}" + (f" build {tag}" if tag else "")
    built = f"vllm {manifest.version}" + (
        f" build {manifest.build_tag}" if manifest.build_tag else ""
    )
    expected = f"vllm-{manifest.version}.dist-info"
    if said != built or dist_info != expected:
        raise ReleaseError(
            f"{wheel}: its name says {said}, but the build made {built} ({dist_info} inside): "
            "a renamed wheel; release the file under the name the build gave it"
        )
    if {str(t) for t in named_tags} != tags:
        raise ReleaseError(
            f"{wheel}: its name says tags {', '.join(sorted(str(t) for t in named_tags))}, "
            f"its WHEEL file {', '.join(sorted(tags))}: a renamed wheel; release the file under "
            "the name the build gave it"
        )


def upstream_since(status: dict[str, Any], patch_id: str) -> str | None:
    """The first release in the matrix where ``patch_id`` is no longer needed (pure)."""
    hits = []
    for entry in status.get("bases", []):
        report = entry.get("report")
        if not report:
            continue
        for outcome in report["outcomes"]:
            if outcome["patch_id"] == patch_id and outcome["status"] in UPSTREAM_STATUSES:
                hits.append(entry["base"])
    return min(hits, key=Version) if hits else None


def release_notes(
    series: Series,
    manifest: BuildManifest,
    wheel_name: str,
    wheel_sha256: str,
    status: dict[str, Any] | None,
) -> str:
    """Markdown release notes (pure)."""
    carried = [p for p in manifest.patches if p.status == "applied"]
    upstream_here = [p for p in manifest.patches if p.status in UPSTREAM_STATUSES]
    lines = [
        f"# vLLM {manifest.version}",
        "",
        f"vLLM {manifest.base_version} with the DFlash fixes ({manifest.mode} build, "
        f"series {manifest.series_digest[:12]}).",
        "",
        f"- wheel: `{wheel_name}`",
        f"- sha256: `{wheel_sha256}`",
    ]
    if manifest.runtime_version:
        # What vLLM keys its compiled-graph caches by: never stock's version.
        lines.append(f"- `vllm.__version__`: `{manifest.runtime_version}`")
    lines += [
        f"- upstream {a['kind']}: `{a.get('file') or a.get('commit')}` (sha256 `{a['sha256']}`)"
        for a in manifest.upstream
        if "sha256" in a
    ]
    lines += ["", "## Patches carried", ""]
    for entry in carried:
        patch = series.get(entry.id)
        since = upstream_since(status, entry.id) if status else None
        drop = f" Upstream from {since}: drop when upgrading." if since else ""
        lines.append(
            f"- **{patch.title}** (`{patch.file.name}`, probe `{patch.probe}` "
            f"{entry.probe_before} -> {entry.probe_after}). "
            f"{' '.join(patch.why.split())}{drop}"
        )
    lines += ["", "## Dropped: already upstream in this base", ""]
    lines += [f"- `{p.id}`: {p.status} on {manifest.base_version}" for p in upstream_here] or [
        "- none"
    ]
    if manifest.skipped:
        lines += ["", "## Left out on request", ""]
        lines += [f"- `{s}` (--skip): this build does not carry it" for s in manifest.skipped]
    if status:
        ids = [p.id for p in series.patches]
        rows = [[entry["base"], *status_cells(entry, ids)] for entry in status["bases"]]
        lines += ["", "## Status on other releases", ""]
        lines += markdown_table(["release", *ids], rows)
        lines += ["", STATUS_LEGEND]
    return "\n".join(lines) + "\n"


@dataclass
class ReleaseFiles:
    notes: Path
    checksums: Path
    manifest: Path


def _absolute(path: Path) -> Path:
    return Path(os.path.abspath(path))


def write_release(
    dist: Path,
    wheel: Path,
    series: Series,
    status: dict[str, Any] | None,
    extra_files: Sequence[Path] = (),
) -> ReleaseFiles:
    """RELEASE_NOTES.md, the manifest as JSON, and SHA256SUMS over everything released.

    Everything is checked and computed before the first file is written, so a
    refusal leaves --dist as it was.
    """
    # Lexical absolute paths: a file in --dist may be a link to the build's output.
    dist, wheel = _absolute(dist), _absolute(wheel)
    extra_files = [_absolute(f) for f in extra_files]
    for f in (wheel, *extra_files):
        if not f.is_relative_to(dist):
            raise ReleaseError(f"{f} is not inside --dist {dist}: SHA256SUMS lists --dist only")
    # SHA256SUMS would vouch for whatever bytes the wheel has now: they must still read back.
    check_members(wheel)
    manifest = read_wheel_manifest(wheel)
    digest = sha256_file(wheel)
    notes = dist / "RELEASE_NOTES.md"
    notes_text = release_notes(series, manifest, wheel.name, digest, status)
    manifest_path = dist / f"{wheel.name}.manifest.json"
    manifest_text = manifest.to_bytes().decode()
    digests = {
        wheel: digest,
        manifest_path: sha256_bytes(manifest_text.encode()),
        notes: sha256_bytes(notes_text.encode()),
        **{f: sha256_file(f) for f in extra_files},
    }
    sums = "".join(f"{digests[f]}  {f.relative_to(dist)}\n" for f in sorted(digests))
    checksums = dist / "SHA256SUMS"
    logger.debug("release files of %s: %s", wheel.name, ", ".join(f.name for f in sorted(digests)))
    atomic_write_text(notes, notes_text)
    atomic_write_text(manifest_path, manifest_text)
    atomic_write_text(checksums, sums)
    return ReleaseFiles(notes=notes, checksums=checksums, manifest=manifest_path)


def release_in(
    dist: Path,
    wheel: Path | None,
    series: Series,
    status_json: Path | None,
    extra_files: Sequence[Path] = (),
) -> ReleaseFiles:
    """``tooling release``: :func:`write_release` for ``wheel``, else the one vllm-*.whl in
    ``dist``, with the upstream columns from ``status_json`` (``patch status --json``)."""
    wheel = wheel or single_wheel(dist)
    status = read_status(status_json) if status_json else None
    return write_release(dist, wheel, series, status, extra_files)


def read_status(path: Path) -> dict[str, Any]:
    """``patch status --json``'s matrix from ``path``, the shape the notes read checked first;
    one that is not, or was made without the probes (its conflicts may be superseded
    patches), is a ReleaseError naming the file."""
    raw = read_bounded(path, STATUS_LIMIT, "a status matrix", ReleaseError)
    try:
        status = json.loads(raw)
    except ValueError as e:
        raise ReleaseError(f"{path}: cannot read the status matrix (not JSON: {e})") from None
    if not _is_status(status):
        raise ReleaseError(
            f"{path}: not the output of `tooling patch status --json` (no bases, each with "
            "its base and a report of outcomes)"
        )
    if status.get("probed") is False:
        raise ReleaseError(
            f"{path}: made with --no-probes, so a patch upstream superseded reads as a "
            "conflict; make it again with the probes"
        )
    return status


def _is_status(data: Any) -> bool:
    def outcome(o: Any) -> bool:
        return isinstance(o, dict) and all(isinstance(o.get(k), str) for k in _OUTCOME_KEYS)

    def report(r: Any) -> bool:
        outcomes = r.get("outcomes") if isinstance(r, dict) else None
        return r is None or (isinstance(outcomes, list) and all(outcome(o) for o in outcomes))

    def entry(e: Any) -> bool:
        return isinstance(e, dict) and isinstance(e.get("base"), str) and report(e.get("report"))

    bases = data.get("bases") if isinstance(data, dict) else None
    return isinstance(bases, list) and all(entry(e) for e in bases)
