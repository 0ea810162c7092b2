"""``tooling bundle``: an offline wheelhouse for air-gapped GPU hosts.

Three stages, each returning plain data the CLI can print as JSON:

1. ``download.resolve`` runs ``uv pip compile`` (``python -m uv``) on the patched
   wheel (which pins its own torch), for CPython 3.12 on
   ``manylinux_2_35_x86_64``, with ``--exclude-newer`` at the base's release, so
   every dependency has the version vLLM was released against; ``lock`` reads it.
2. ``bundle_plan.plan_bundle`` (pure) leaves out what the caller asked to skip (and
   what only those need), what the host already has (``--exclude-present``),
   puts the patched wheel in vLLM's place and adds extra wheels (the reference
   ``dflash`` package the smoke compares against).
3. ``download.download`` (``pip download --no-deps --only-binary=:all:`` with the
   target's tags, hash-checked) and :func:`write_bundle` write the folder:
   ``wheels/``, ``requirements.lock`` (the full resolution), ``install.txt``
   (what is in ``wheels/``, with sha256), ``install.sh``, ``SHA256SUMS``,
   ``bundle.json``; optionally split into parts no larger than N bytes, with
   ``join.py`` (python3, stdlib only) that checks every sha256 and unpacks
   (``split.split_bundle``).

This module writes the folder and runs the stages in order.

Every folder is written beside its final place and renamed into it, so an
interrupted run leaves nothing that looks like a bundle.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import BundleError
from ..fsutil import (
    atomic_write_text,
    check_creatable,
    discard,
    locked,
    read_bounded,
    run_scratch,
    sha256_file,
    staging_dir,
)
from ..progress import progress_bar
from .bundle_plan import (
    BundleConfig,
    BundlePlan,
    PlanEntry,
    default_bundle_name,
    parse_present,
    pinned_extras,
    plan_bundle,
)
from .download import download, resolve
from .files import BundleFile, bundle_file, describe, sums_text
from .lock import Resolution
from .split import check_part_count, split_bundle, tar_bytes_at_most

logger = logging.getLogger(__name__)

#: install.txt, install.sh, bundle.json, the lock and SHA256SUMS together, at most: what a
#: bundle holds beside its wheels, for the part count checked before it is written.
BUNDLE_FILES_AT_MOST = 4 << 20


@dataclass
class BundleResult:
    """What :func:`write_bundle` wrote."""

    bundle_dir: Path
    files: list[BundleFile]
    total_bytes: int
    parts_dir: Path | None = None
    parts: list[BundleFile] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "bundle_dir": str(self.bundle_dir),
            "total_bytes": self.total_bytes,
            "files": [asdict(f) for f in self.files],
            "parts_dir": str(self.parts_dir) if self.parts_dir else None,
            "parts": [asdict(p) for p in self.parts],
        }


def write_bundle(
    plan: BundlePlan,
    wheels: dict[str, Path],
    config: BundleConfig,
    resolution: Resolution | None = None,
) -> BundleResult:
    """Write the bundle folder (and its parts when ``config.split_bytes`` is set).

    ``wheels`` maps every non-patched plan entry to its downloaded file.
    """
    name = config.name or default_bundle_name(config)
    final = config.out_dir / name
    logger.debug("write the bundle %s: %d wheels", final, len(plan.include))
    sources: list[tuple[PlanEntry, Path]] = []
    for entry in plan.include:
        path = config.wheel if entry.source == "patched" else wheels.get(entry.name)
        if path is None or not path.is_file():
            raise BundleError(f"{entry.name}=={entry.version}: its wheel was not downloaded")
        sources.append((entry, path))
    total = sum(p.stat().st_size for _, p in sources)
    if config.split_bytes:
        # Before anything is written: the wheels are most of the stream.
        sizes = [p.stat().st_size for _, p in sources] + [BUNDLE_FILES_AT_MOST]
        check_part_count(tar_bytes_at_most(sizes, len(sources) + 8), config.split_bytes, "--split")
    # Locked: the staging folder a killed run left beside it is removed by the next.
    with locked(final), staging_dir(final) as tmp:
        (tmp / "wheels").mkdir()
        install_lines = []
        with progress_bar(total, "bundle", config.progress) as bar:
            for entry, path in sources:
                target = tmp / "wheels" / path.name
                shutil.copyfile(path, target)
                bar.update(target.stat().st_size)
                digest = sha256_file(target)
                if entry.hashes and digest not in entry.hashes:
                    raise BundleError(
                        f"{path.name}: sha256 {digest} is none of the index's for "
                        f"{entry.name}=={entry.version}"
                    )
                install_lines.append(f"{entry.name}=={entry.version} --hash=sha256:{digest}")
        header = (
            f"# vLLM runtime closure for CPython {config.python_version} on {config.platform},\n"
            f"# resolved with --exclude-newer {config.exclude_newer} (uv pip compile).\n"
        )
        if resolution is not None:
            (tmp / "requirements.lock").write_text(header + resolution.lock_text)
        (tmp / "install.txt").write_text("\n".join(sorted(install_lines)) + "\n")
        # What was left out as the host's, at the versions the closure was resolved with:
        # install.sh checks the host has them before it installs (a bare name in
        # --exclude-present matched any version here).
        present = [f"{n}=={v}\n" for n, v in sorted(plan.present)]
        (tmp / "present.txt").write_text("".join(present))
        (tmp / "install.sh").write_text(bundle_file("install.sh"))
        (tmp / "check_present.py").write_text(bundle_file("check_present.py"))
        (tmp / "install.sh").chmod(0o755)
        manifest = {
            "name": name,
            "wheel": config.wheel.name,
            "python_version": config.python_version,
            "platform": config.platform,
            "exclude_newer": config.exclude_newer,
            "resolve_command": list(resolution.command) if resolution else None,
            "plan": plan.to_json(),
        }
        (tmp / "bundle.json").write_text(json.dumps(manifest, indent=2) + "\n")
        files = describe(tmp)
        (tmp / "SHA256SUMS").write_text(sums_text(files))
    result = BundleResult(bundle_dir=final, files=files, total_bytes=sum(f.size for f in files))
    if config.split_bytes:
        parts_dir = config.out_dir / f"{name}-parts"
        try:
            with locked(parts_dir):
                result.parts_dir, result.parts = split_bundle(
                    final, parts_dir, config.split_bytes, config.progress
                )
        except BaseException:
            # Asked for parts, a run without them made nothing: the folder it made goes too.
            discard(final)
            raise
    return result


#: The largest exclude-present list read: a host's pip freeze is a few kB.
PRESENT_LIMIT = 16 << 20


def read_present(path: Path) -> dict[str, str | None]:
    """:func:`parse_present` over a file (its size bounded: /dev/zero is not read whole)."""
    raw = read_bounded(path, PRESENT_LIMIT, "the exclude-present list", BundleError)
    try:
        return parse_present(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise BundleError(f"{path}: the exclude-present list is not UTF-8 text ({e})") from None


def resolve_and_plan(
    config: BundleConfig, scratch: Path | None = None
) -> tuple[Resolution, BundlePlan]:
    """resolve -> plan, without downloading anything (``--lock-only`` stops here)."""
    # What the caller gave is checked before uv runs: a malformed pin, an unreadable list.
    pinned_extras(config.extras)
    present = read_present(config.exclude_present) if config.exclude_present else {}
    resolution = resolve(config, scratch)
    plan = plan_bundle(
        resolution.requirements,
        wheel=config.wheel,
        present=present,
        skip=config.skip,
        keep=config.keep,
        extras=config.extras,
    )
    # Never resolved, so never in the plan's own account: said here, where it is read.
    unresolved = tuple(
        (name, "", "not resolved (the base's bundle_excludes)") for name in config.excludes
    )
    return resolution, replace(plan, skipped=plan.skipped + unresolved)


def refuse_existing(config: BundleConfig) -> None:
    """An earlier bundle of the same name in ``--out`` is refused before any work: the
    folder is the user's now, and a finished bundle would not replace it."""
    name = config.name or default_bundle_name(config)
    for folder in (config.out_dir / name, config.out_dir / f"{name}-parts"):
        if folder.exists():
            raise BundleError(f"{folder} exists (an earlier bundle?): move it away, or give --out")


def make_bundle(config: BundleConfig) -> tuple[BundlePlan, BundleResult]:
    """resolve -> plan -> download -> write, as ``tooling bundle`` does. Every temp folder
    of the run, uv's and pip's too, is in one scratch folder that goes on any exit."""
    check_creatable(config.out_dir, "--out", BundleError)
    refuse_existing(config)
    with run_scratch("bundle") as scratch:
        resolution, plan = resolve_and_plan(config, scratch)
        if config.download_dir is not None:
            wheels = download(plan, config, config.download_dir, scratch)
            return plan, write_bundle(plan, wheels, config, resolution)
        config.out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".bundle-wheels-", dir=config.out_dir) as tmp:
            wheels = download(plan, config, Path(tmp), scratch)
            return plan, write_bundle(plan, wheels, config, resolution)


def write_lock(resolution: Resolution, path: Path) -> None:
    """Save a resolution's lock text atomically (for ``--lock-only``)."""
    atomic_write_text(path, resolution.lock_text)


def lock_bundle(config: BundleConfig, path: Path) -> BundlePlan:
    """resolve -> plan, and the lock written to ``path``; nothing downloaded (``--lock-only``)."""
    resolution, plan = resolve_and_plan(config)
    logger.debug("write the lock of %d requirements to %s", len(resolution.requirements), path)
    write_lock(resolution, path)
    return plan
