"""Build the patched CUDA wheel from the official one (precompiled mode).

Every unchanged member of the official wheel is copied as stored, so the
compiled kernels in the output are the official bytes; the patched Python
files replace their originals; METADATA, WHEEL and RECORD are rewritten for
the new version; a build manifest and an SBOM are added. The refusals come
first: a patch that touches compiled code, or a touched file whose copy in
the official wheel is not the pinned source's, means the kernels would not
belong to the patched source.
"""

from __future__ import annotations

import csv
import hashlib
import io
import logging
import time
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import git
from packaging.utils import parse_wheel_filename

from .. import __version__
from ..errors import ArchiveError, BuildError
from ..fetching import unpacked
from ..fetching.fetch import verify_artifact
from ..fetching.upstream import Upstream
from ..fsutil import atomic_output, sha256_bytes
from ..patching import worktree
from ..patching.apply import forgotten_on_error
from ..patching.outcome import SeriesReport
from ..patching.series import Patch, Series, is_compiled_path
from .identity import (
    VERSION_FILE,
    WheelIdentity,
    parse_record,
    plan_identity,
    rewrite_metadata,
    rewrite_wheel_file,
    runtime_version,
    version_stamp,
)
from .manifest import MANIFEST_NAME, BuildManifest, ChangedFile, PatchEntry
from .sbom import SBOM_NAME, sbom_bytes
from .wheelfile import (
    CopiedMember,
    Member,
    NewMember,
    dos_datetime,
    open_wheel,
    read_member,
    record_hash,
    write_wheel,
)

logger = logging.getLogger(__name__)


@dataclass
class BuildResult:
    path: Path
    filename: str
    version: str
    sha256: str
    size: int
    mode: str
    seconds: float
    manifest: BuildManifest
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class BuildOptions:
    dist_dir: Path
    build_tag: str | None = None
    source_date_epoch: int | None = None


def patch_owners(repo: git.Repo) -> dict[str, list[str]]:
    """Path -> patch files (by trailer) of the series commits that touch it, in order."""
    owners: dict[str, list[str]] = {}
    for commit in worktree.series_commits(repo):
        touched = repo.git.diff_tree("--no-commit-id", "--name-only", "-r", commit.sha)
        for path in touched.splitlines():
            owners.setdefault(path, []).append(commit.patch_file or commit.sha[:12])
    return owners


def check_compiled(series: Series, changed: dict[str, list[str]]) -> None:
    for patch in series.patches:
        if patch.touches_compiled_code:
            raise BuildError(
                f"patch {patch.id} touches compiled code (series.toml says so); "
                "build with --mode source"
            )
    for path, owners in changed.items():
        if is_compiled_path(path):
            raise BuildError(
                f"patch {', '.join(owners)} touches compiled code ({path}); "
                "the official kernels would not match: build with --mode source"
            )


def build_precompiled(
    upstream: Upstream, series: Series, report: SeriesReport, options: BuildOptions
) -> BuildResult:
    """Write the patched wheel into ``options.dist_dir`` and return what was built."""
    started = time.perf_counter()
    if upstream.wheel is None or upstream.base.wheel is None:
        raise BuildError(
            f"vLLM {upstream.base.version} has no pinned official wheel in bases.toml; "
            "precompiled mode needs one (use --mode source)"
        )
    if not report.ok:
        raise BuildError("the patch series did not apply cleanly; see `tooling patch`")
    # The official wheel is hashed against its pin on a second core while this
    # one builds; the output is renamed into place only if the digest holds.
    checker = ThreadPoolExecutor(max_workers=1)
    wheel_check = checker.submit(verify_artifact, upstream.wheel, upstream.base.wheel)
    checker.shutdown(wait=False)
    repo = git.Repo(report.work_dir)
    paths = worktree.changed_files(repo, report.baseline, report.head)
    owners_by_path = patch_owners(repo)
    changed = {p: owners_by_path.get(p, []) for p in paths}
    check_compiled(series, changed)

    if VERSION_FILE in changed:
        raise BuildError(
            f"patch {', '.join(changed[VERSION_FILE])} edits {VERSION_FILE}, "
            "which the build stamps with the series label"
        )
    try:
        official = open_wheel(upstream.wheel)
    except ArchiveError:
        # A damaged cached wheel: its pin check says so, and that it was removed.
        wheel_check.result()
        raise
    by_name = {info.filename: info for info in official.infolist()}
    identity = plan_identity(upstream.wheel.name, series, options.build_tag)
    stamped = runtime_version(upstream.base.version, series)
    epoch = options.source_date_epoch
    version_file, stamp_entry = version_stamp(official, stamped)
    new_content: dict[str, bytes | None] = {VERSION_FILE: version_file}
    files: list[ChangedFile] = [stamp_entry]
    notes: list[str] = []
    for path, owners in changed.items():
        before = _blob(repo, report.baseline, path)
        after = _blob(repo, report.head, path)
        shipped = path in by_name or (path.split("/", 1)[0] + "/__init__.py") in by_name
        if not shipped:
            notes.append(f"{path}: not part of the wheel, left out")
            continue
        if before is not None:
            in_wheel = read_member(official, path) if path in by_name else None
            if in_wheel != before:
                # The tree the build was patched from, not the wheel, may be at fault; the
                # work tree made from it is then made again by the next run.
                if upstream.sdist is not None:
                    with forgotten_on_error(Path(report.work_dir)):
                        unpacked.blame_changed(upstream.sdist, upstream.source_dir, path, before)
                got = sha256_bytes(in_wheel) if in_wheel is not None else "missing"
                raise BuildError(
                    f"{path}: the official wheel's copy ({got[:16]}) is not the pinned "
                    f"source's ({sha256_bytes(before)[:16]}); the wheel's binaries would not "
                    "belong to the patched source"
                )
        new_content[path] = after
        files.append(
            ChangedFile(
                path=path,
                patches=owners,
                sha256_before=sha256_bytes(before) if before is not None else None,
                sha256_after=sha256_bytes(after) if after is not None else None,
            )
        )

    manifest = make_manifest(
        upstream, series, report, identity, stamped, "precompiled", files, epoch, notes
    )
    target = options.dist_dir / identity.filename
    logger.debug("write %s: %d files from the patched tree", target, len(files) - 1)
    try:
        digest = assemble(
            official,
            identity,
            new_content,
            manifest,
            epoch,
            target,
            check_source=wheel_check.result,
        )
    except BuildError:
        # A wheel that fails its pin is moved out of the cache while this thread copies
        # from it, so the copy can fail first: the pin's failure is the cause to report.
        wheel_check.result()
        raise
    return BuildResult(
        path=target,
        filename=identity.filename,
        version=identity.version,
        sha256=digest,
        size=target.stat().st_size,
        mode="precompiled",
        seconds=time.perf_counter() - started,
        manifest=manifest,
        notes=notes,
    )


def make_manifest(
    upstream: Upstream,
    series: Series,
    report: SeriesReport,
    identity: WheelIdentity,
    stamped_version: str,
    mode: str,
    files: list[ChangedFile],
    epoch: int | None,
    notes: list[str],
) -> BuildManifest:
    """What went into a build: upstream artifacts, each patch's status and probes, each file."""
    return BuildManifest(
        version=identity.version,
        runtime_version=stamped_version,
        base_version=upstream.base.version,
        mode=mode,
        source=upstream.source,
        upstream=upstream.artifacts(),
        series_digest=series.digest,
        validated_base=series.validated_base,
        patches=[
            PatchEntry(
                id=o.patch_id,
                file=o.patch_file,
                sha256=o.sha256,
                status=o.status,
                probe=patch.probe if patch else None,
                probe_before=(o.probe_before or {}).get("status"),
                probe_after=(o.probe_after or {}).get("status"),
                commit=o.commit,
                sha1=hashlib.sha1(patch.file.read_bytes()).hexdigest() if patch else None,
            )
            for o in report.outcomes
            for patch in [_series_patch(series, o.patch_id)]
        ],
        skipped=list(series.skipped),
        files=files,
        toolchain={"name": "vllm-dflash-tooling", "version": __version__},
        build_tag=identity.build_tag,
        source_date_epoch=epoch,
        notes=notes,
    )


def identity_of(filename: str) -> WheelIdentity:
    """The identity a wheel file name already states (no relabelling)."""
    _, version, build, _ = parse_wheel_filename(filename)
    stem = filename.removesuffix(".whl").split("-")
    return WheelIdentity(
        stem[0], str(version), f"{build[0]}{build[1]}" if build else None, "-".join(stem[-3:])
    )


def assemble(
    source: zipfile.ZipFile,
    identity: WheelIdentity,
    new_content: dict[str, bytes | None],
    manifest: BuildManifest,
    epoch: int | None,
    target: Path,
    check_source: Callable[[], None] | None = None,
) -> str:
    """Write ``target`` from ``source`` with ``new_content`` swapped in; returns its sha256.

    ``check_source`` runs after writing and before the rename: if it raises,
    nothing is left in the output folder.
    """
    by_name = {info.filename: info for info in source.infolist()}
    members = _members(source, by_name, identity, new_content, manifest, epoch)
    # Both callers open the wheel by path (open_wheel), so ZipFile keeps its name.
    assert source.filename is not None
    try:
        with atomic_output(target, durable=False) as out:
            digest = write_wheel(out, Path(source.filename), members)
            if check_source is not None:
                check_source()
            return digest
    except OSError as e:
        raise BuildError(f"cannot write {target}: {e.strerror or e}") from None


def _series_patch(series: Series, patch_id: str) -> Patch | None:
    return next((p for p in series.patches if p.id == patch_id), None)


def _blob(repo: git.Repo, rev: str, path: str) -> bytes | None:
    try:
        return worktree.read_blob(repo, rev, path)
    except git.GitCommandError:
        return None


def _members(
    official: zipfile.ZipFile,
    by_name: dict[str, zipfile.ZipInfo],
    identity: WheelIdentity,
    new_content: dict[str, bytes | None],
    manifest: BuildManifest,
    epoch: int | None,
) -> list[Member]:
    """The output members in order: package files, then .dist-info with RECORD last."""
    dist_infos = {n.split("/", 1)[0] for n in by_name if n.split("/", 1)[0].endswith(".dist-info")}
    if len(dist_infos) != 1:
        found = sorted(dist_infos)
        raise BuildError(f"{official.filename}: expected one .dist-info, found {found}")
    old_info = dist_infos.pop()
    record = parse_record(read_member(official, f"{old_info}/RECORD"))
    members: list[Member] = []
    dist_members: list[Member] = []
    hashes: dict[str, tuple[str, str]] = {}

    def stamp(info: zipfile.ZipInfo | None) -> tuple[int, int, int, int, int, int]:
        if epoch is not None:
            return dos_datetime(epoch)
        return info.date_time if info else by_name[f"{old_info}/RECORD"].date_time

    def add_new(name: str, data: bytes, info: zipfile.ZipInfo | None, into: list[Member]) -> None:
        if info is None:
            into.append(NewMember(name, data, stamp(info)))
        else:
            into.append(NewMember(name, data, stamp(info), info.external_attr, info.create_system))
        hashes[name] = (record_hash(data), str(len(data)))

    for info in official.infolist():
        name = info.filename
        if name.startswith(old_info + "/"):
            new_name = identity.dist_info + name[len(old_info) :]
            leaf = name[len(old_info) + 1 :]
            if leaf == "RECORD":
                continue
            if leaf == "METADATA":
                text = rewrite_metadata(read_member(official, name).decode(), identity.version)
                add_new(new_name, text.encode(), info, dist_members)
            elif leaf == "WHEEL":
                text = rewrite_wheel_file(read_member(official, name).decode(), identity)
                add_new(new_name, text.encode(), info, dist_members)
            else:
                dist_members.append(CopiedMember(new_name, info))
                hashes[new_name] = _recorded(record, name)
            continue
        if name in new_content:
            data = new_content[name]
            if data is not None:
                add_new(name, data, info, members)
            continue
        members.append(CopiedMember(name, info))
        hashes[name] = _recorded(record, name)
    for path, data in new_content.items():
        if path not in by_name and data is not None:
            add_new(path, data, None, members)
    add_new(f"{identity.dist_info}/{MANIFEST_NAME}", manifest.to_bytes(), None, dist_members)
    add_new(
        f"{identity.dist_info}/sboms/{SBOM_NAME}",
        sbom_bytes(manifest, identity.filename),
        None,
        dist_members,
    )
    record_name = f"{identity.dist_info}/RECORD"
    lines = io.StringIO()
    writer = csv.writer(lines, lineterminator="\n")
    for member in members + dist_members:
        writer.writerow([member.name, *hashes[member.name]])
    writer.writerow([record_name, "", ""])
    record_info = by_name[f"{old_info}/RECORD"]
    dist_members.append(
        NewMember(
            record_name,
            lines.getvalue().encode(),
            stamp(record_info),
            record_info.external_attr,
            record_info.create_system,
        )
    )
    return members + dist_members


def _recorded(record: dict[str, tuple[str, str]], name: str) -> tuple[str, str]:
    try:
        return record[name]
    except KeyError:
        raise BuildError(f"official RECORD does not list {name}; the wheel is not valid") from None


#: A zip entry's date holds years 1980-2107.
_ZIP_LAST_EPOCH = 4354819199


def source_date_epoch(value: str | None) -> int | None:
    """``$SOURCE_DATE_EPOCH`` (``value``, as the command line read it) as the seconds a
    wheel's dates can hold, or None when unset."""
    if not value:
        return None
    if not value.strip().isdigit():
        raise BuildError(f"SOURCE_DATE_EPOCH {value!r} is not a whole number of seconds")
    if int(value) > _ZIP_LAST_EPOCH:
        raise BuildError(f"SOURCE_DATE_EPOCH {value!r} is past 2107, the last year a zip can hold")
    return int(value)


def single_wheel(dist_dir: Path) -> Path:
    """The one vllm-*.whl in ``dist_dir`` (a build's output), or a clear error."""
    wheels = sorted(dist_dir.glob("vllm-*.whl"))
    if len(wheels) != 1:
        names = ", ".join(w.name for w in wheels) or "none"
        raise BuildError(f"{dist_dir}: expected one vllm-*.whl, found {len(wheels)} ({names})")
    return wheels[0]
