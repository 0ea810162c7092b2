"""``tooling patch`` (apply the series), ``patch status`` (the canary) and ``patch export``
(stage: ``tooling.patching``)."""

from __future__ import annotations

import os
from pathlib import Path

import click
from click.core import ParameterSource

from ..fetching.upstream import SourceRequest
from ..patching.outcome import SeriesReport
from ..patching.request import PatchRequest, export_requested, patch_requested
from ..patching.status import canary
from ..report import table
from . import environ
from .environ import CACHED_NOTE
from .group import ToolingGroup
from .options import (
    base_options,
    emit,
    json_option,
    nonblank,
    probe_python_option,
    settings_of,
)

#: The group's own options each subcommand honours; any other given with a subcommand is
#: refused, never silently ignored.
HONOURED = {
    "status": {"probe_python", "three_way"},
    "export": {"base_version", "source", "git_url", "ref", "allow_moving_ref", "work_dir"},
}
#: --offline and --cache-dir set the cache every subcommand uses.
_ALWAYS = {"offline_here", "cache_dir_here"}


def _outcome_rows(report: SeriesReport) -> list[list[str]]:
    rows = []
    for o in report.outcomes:
        before = (o.probe_before or {}).get("status", "-")
        after = (o.probe_after or {}).get("status", "-")
        detail = o.problem or o.message
        rows.append([o.patch_id, o.status, f"{before} -> {after}", detail[:110]])
    return rows


def _report_text(report: SeriesReport) -> str:
    text = table(["patch", "status", "probe", "detail"], _outcome_rows(report))
    lines = [f"vLLM {report.base} ({report.source}) work tree {report.work_dir}", text]
    for o in report.outcomes:
        lines += [f"  {o.patch_id}: {c}" for c in o.conflicts]
    if report.probe_python is None:
        lines.append("probes: not run (no probe interpreter; run `tooling probe-env`)")
    elif cached := report.cached_probes():
        lines.append(f"{CACHED_NOTE}: {', '.join(cached)}")
    return "\n".join(lines)


def tell_saved(report: SeriesReport) -> None:
    if report.saved_work:
        click.echo(
            f"note: the earlier work tree held work of yours; it was moved to "
            f"{report.saved_work} (`tooling patch --work-dir {report.saved_work} export` "
            "exports it)",
            err=True,
        )


def _refuse_unhonoured(ctx: click.Context, subcommand: str) -> None:
    given = [
        p
        for p in ctx.command.params
        if p.name and ctx.get_parameter_source(p.name) is ParameterSource.COMMANDLINE
    ]
    for param in given:
        if param.name not in HONOURED[subcommand] | _ALWAYS:
            flag = max(param.opts, key=len)
            raise click.UsageError(
                f"{flag} is an option of `tooling patch` itself; "
                f"`tooling patch {subcommand}` does not honour it"
            )


@click.group("patch", cls=ToolingGroup, invoke_without_command=True)
@base_options
@click.option(
    "--work-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="Work tree (default: build/work/vllm-<base>).",
)
@click.option(
    "--3way",
    "three_way",
    is_flag=True,
    help="Fall back to a 3-way merge; kept only if the patch's probe then passes.",
)
@click.option("--keep-going", is_flag=True, help="Report every later patch after a conflict.")
@click.option("--skip", multiple=True, metavar="PATCH_ID", help="Leave a patch out.")
@probe_python_option
@json_option
@click.pass_context
def patch_group(
    ctx: click.Context,
    request: SourceRequest,
    work_dir: Path | None,
    three_way: bool,
    keep_going: bool,
    skip: tuple[str, ...],
    probe_python: Path | None,
) -> None:
    """Apply the patch series to a pinned base in a git work tree (one commit per patch)."""
    settings = settings_of(ctx)
    if ctx.invoked_subcommand is not None:
        _refuse_unhonoured(ctx, ctx.invoked_subcommand)
        settings.extra = {
            "base": request.base_version,
            "source": request.source,
            "work_dir": work_dir,
            "probe_python": probe_python,
            "three_way": three_way,
        }
        ctx.meta["patch.request"] = request
        return
    report = patch_requested(
        PatchRequest(
            source=request,
            series=settings.series(skip, request.base_version or settings.catalog().default),
            catalog=settings.catalog(),
            fetch=settings.fetch_options(),
            work_dir=work_dir,
            probe_python=environ.probe_python(probe_python),
            three_way=three_way,
            keep_going=keep_going,
        )
    )
    tell_saved(report)
    emit(settings, report.to_json(), _report_text(report))
    report.raise_unless_ok()


@patch_group.command("status")
@click.option(
    "--bases",
    "bases_spec",
    default="all",
    show_default=True,
    callback=nonblank,
    help="Comma-separated releases, or all pinned ones.",
)
@click.option(
    "--workers", type=click.IntRange(min=1), default=os.cpu_count() or 2, show_default=True
)
@click.option(
    "--no-probes",
    is_flag=True,
    help="Text only, not probed: a patch upstream superseded reads conflict.",
)
@json_option
@click.pass_context
def patch_status(ctx: click.Context, bases_spec: str, workers: int, no_probes: bool) -> None:
    """The status of every patch on every release: the forward canary."""
    settings = settings_of(ctx)
    series = settings.series()
    bases = settings.catalog().selection(bases_spec)
    extra = settings.extra
    if no_probes and extra.get("probe_python") is not None:
        raise click.UsageError("--probe-python and --no-probes contradict each other; give one")
    options = settings.apply_options(
        extra.get("probe_python"), extra.get("three_way", False), True, series, probes=not no_probes
    )
    result = canary(
        bases,
        series,
        settings.fetch_options(),
        options,
        workers=workers,
        on_done=lambda r: (
            click.echo(f"  {r.base}: {'done' if r.report else 'no status'}", err=True)
            if not settings.json
            else None
        ),
        require_probes=not no_probes,
    )
    ids = [p.id for p in series.patches]
    rows = [[r.base, *(r.cell(i) for i in ids)] for r in result.results]
    notes = [f"{r.base}: {r.error}" for r in result.results if r.error]
    human = table(["base", *ids], rows) + "".join(f"\n{n}" for n in notes)
    human += (
        f"\n{len(bases)} releases in {result.seconds:.1f}s"
        " (! = applied but its probe is not present)"
    )
    if not result.probed:
        human += (
            "\nnot probed (--no-probes): text only; a patch upstream superseded reads "
            "conflict, and no applied patch was checked by behaviour"
        )
    emit(settings, result.to_json(), human)
    result.raise_unless_ok()


@patch_group.command("export")
@click.option(
    "--check",
    is_flag=True,
    help="Apply the series to a scratch tree and fail if patches/ would change.",
)
@json_option
@click.pass_context
def patch_export(ctx: click.Context, check: bool) -> None:
    """Regenerate patches/ from the work tree's commits (or check it is current)."""
    settings = settings_of(ctx)
    result = export_requested(
        ctx.meta["patch.request"],
        settings.fetch_options(),
        settings.patches_dir,
        settings.extra.get("work_dir"),
        check=check,
    )
    rows = [[p.file, p.state, p.sha256[:16]] for p in result.patches]
    emit(settings, result.to_json(), table(["patch file", "state", "sha256"], rows))
    result.raise_unless_ok()
