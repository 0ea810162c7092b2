"""``tooling release``: the release files beside the wheel (stage: ``tooling.release``)."""

from __future__ import annotations

from pathlib import Path

import click

from .options import emit, json_option, settings_of, wheel_options


@click.command("release")
@wheel_options("The built wheel")
@click.option(
    "--status-json",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="Output of `tooling patch status --json` for the upstream columns.",
)
@click.option(
    "--include",
    "extra",
    multiple=True,
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="Further files in --dist to list in SHA256SUMS (e.g. the runtime lock).",
)
@json_option
@click.pass_context
def release_command(
    ctx: click.Context,
    wheel: Path | None,
    dist_dir: Path,
    status_json: Path | None,
    extra: tuple[Path, ...],
) -> None:
    """Write RELEASE_NOTES.md, the manifest and SHA256SUMS beside the wheel."""
    from ..release.release import release_in

    settings = settings_of(ctx)
    files = release_in(dist_dir, wheel, settings.series(), status_json, list(extra))
    emit(
        settings,
        {
            "ok": True,
            "notes": str(files.notes),
            "checksums": str(files.checksums),
            "manifest": str(files.manifest),
        },
        f"{files.notes}\n{files.manifest}\n{files.checksums}",
    )
