"""``tooling fetch``: the pinned upstream into the cache (stage: ``tooling.fetching``)."""

from __future__ import annotations

import click

from ..fetching.upstream import SourceRequest
from ..report import table
from .options import base_options, emit, json_option, settings_of


@click.command("fetch")
@base_options
@click.option("--no-wheel", is_flag=True, help="Fetch only the source, not the official wheel.")
@json_option
@click.pass_context
def fetch_command(ctx: click.Context, request: SourceRequest, no_wheel: bool) -> None:
    """Bring a pinned upstream vLLM (wheel + sdist, or git) into the cache, verified."""
    settings = settings_of(ctx)
    upstream = settings.fetch(request, with_wheel=not no_wheel)
    data = {
        "ok": True,
        "base": upstream.base.version,
        "source": upstream.source,
        "source_dir": str(upstream.source_dir),
        "wheel": str(upstream.wheel) if upstream.wheel else None,
        "sdist": str(upstream.sdist) if upstream.sdist else None,
        "commit": upstream.git.commit if upstream.git else None,
        "artifacts": upstream.artifacts(),
    }
    rows = [
        [a["kind"], a.get("file") or a.get("url"), (a.get("sha256") or a["commit"])[:16]]
        for a in upstream.artifacts()
    ]
    human = (
        f"vLLM {upstream.base.version} ({upstream.source}): source tree {upstream.source_dir}"
        + (f"\nofficial wheel {upstream.wheel}" if upstream.wheel else "")
        + "\n"
        + table(["artifact", "name", "digest"], rows)
    )
    emit(settings, data, human)
