"""``tooling bundle``: the offline wheelhouse for an air-gapped GPU host (stage:
``tooling.release``)."""

from __future__ import annotations

from pathlib import Path

import click

from ..report import human_size, table
from .options import emit, json_option, nonblank, settings_of, wheel_options


@click.command("bundle")
@wheel_options("The vLLM wheel to ship")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=Path("build/bundle"),
    show_default=True,
)
@click.option(
    "--base",
    "base_version",
    metavar="VERSION",
    callback=nonblank,
    help="Resolve dependencies as of this base's release date (default base).",
)
@click.option("--exclude-newer", help="Override the resolution cut-off (YYYY-MM-DD).")
@click.option("--python-version", default="3.12", show_default=True)
@click.option("--platform", default="manylinux_2_35_x86_64", show_default=True)
@click.option(
    "--extra",
    "extras",
    multiple=True,
    help="Add a wheel without its dependencies (repeatable; default dflash==0.1.0).",
)
@click.option(
    "--exclude-present",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="Packages the host already has (pip freeze, pip list or names).",
)
@click.option("--split", "split", help="Split into parts of at most this size (e.g. 60M).")
@click.option(
    "--lock-only",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Only resolve, and write the lock file here.",
)
@json_option
@click.pass_context
def bundle_command(
    ctx: click.Context,
    wheel: Path | None,
    dist_dir: Path,
    out_dir: Path,
    base_version: str | None,
    exclude_newer: str | None,
    python_version: str,
    platform: str,
    extras: tuple[str, ...],
    exclude_present: Path | None,
    split: str | None,
    lock_only: Path | None,
) -> None:
    """An offline wheelhouse for an air-gapped GPU host: wheel, dependencies, lock, scripts."""
    from ..release.request import BundleRequest, bundle_requested

    settings = settings_of(ctx)
    outcome = bundle_requested(
        BundleRequest(
            wheel=wheel,
            dist_dir=dist_dir,
            out_dir=out_dir,
            base=settings.catalog().get(base_version),
            index_url=settings.index_url,
            download_dir=settings.cache.root / "wheels",
            exclude_newer=exclude_newer,
            python_version=python_version,
            platform=platform,
            extras=extras,
            exclude_present=exclude_present,
            split=split,
            lock_only=lock_only,
            progress=settings.progress,
            offline=settings.offline,
        )
    )
    if outcome.result is None:
        text = (
            f"{outcome.lock}: {len(outcome.plan.include)} packages resolved as of "
            f"{outcome.config.exclude_newer}"
        )
    else:
        result = outcome.result
        rows = [[f.path, human_size(f.size)] for f in (result.parts or result.files)[:60]]
        text = (
            table(["file", "size"], rows)
            + f"\n{result.bundle_dir} ({human_size(result.total_bytes)})"
        )
    emit(settings, outcome.to_json(), text)
