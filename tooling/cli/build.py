"""``tooling build``: the patched wheel into dist/ (stage: ``tooling.building``)."""

from __future__ import annotations

from pathlib import Path

import click

from ..building.build import BuildResult
from ..building.request import WheelRequest, build_requested
from ..fetching.upstream import SourceRequest
from ..patching.outcome import SeriesReport
from ..report import human_size, table
from . import environ
from .environ import CACHED_NOTE
from .options import (
    absolute,
    base_options,
    emit,
    json_option,
    probe_python_option,
    settings_of,
)
from .patch import tell_saved


def _build_text(result: BuildResult, report: SeriesReport) -> str:
    rows = [
        [o.patch_id, o.status, (o.probe_after or {}).get("status", "-")] for o in report.outcomes
    ]
    return "\n".join(
        [
            table(["patch", "status", "probe"], rows),
            table(
                ["wheel", "version", "sha256", "size", "time"],
                [
                    [
                        str(result.path),
                        result.version,
                        result.sha256,
                        human_size(result.size),
                        f"{result.seconds:.2f}s",
                    ]
                ],
            ),
        ]
        + ([f"{CACHED_NOTE}: {', '.join(cached)}"] if (cached := report.cached_probes()) else [])
    )


@click.command("build")
@base_options
@click.option(
    "--mode",
    type=click.Choice(["precompiled", "source"]),
    default="precompiled",
    show_default=True,
    help="Reuse the official kernels, or run vLLM's own build.",
)
@click.option(
    "--skip",
    multiple=True,
    metavar="PATCH_ID",
    help="Build without this patch (ablation); recorded in version and manifest.",
)
@click.option("--build-tag", metavar="N", help="Keep the base version; mark with build tag N.")
@click.option(
    "--dist", "dist_dir", type=click.Path(path_type=Path), default=Path("dist"), show_default=True
)
@click.option("--work-dir", type=click.Path(path_type=Path, file_okay=False))
@probe_python_option
@click.option("--no-probes", is_flag=True, help="Build without behavioural checks.")
@click.option(
    "--use-precompiled-kernels",
    is_flag=True,
    help="Source mode: vLLM's Python-only build against the cached official wheel.",
)
@click.option(
    "--build-python",
    type=click.Path(path_type=Path, exists=True),
    callback=absolute,
    help="Source mode: interpreter with a CUDA torch that runs vLLM's build.",
)
@click.option(
    "--max-jobs", type=click.IntRange(min=1), help="Source mode: MAX_JOBS for the compiler."
)
@click.option(
    "--cuda-arch-list", default="9.0", show_default=True, help="Source mode: TORCH_CUDA_ARCH_LIST."
)
@json_option
@click.pass_context
def build_command(
    ctx: click.Context,
    request: SourceRequest,
    mode: str,
    skip: tuple[str, ...],
    build_tag: str | None,
    dist_dir: Path,
    work_dir: Path | None,
    probe_python: Path | None,
    no_probes: bool,
    use_precompiled_kernels: bool,
    build_python: Path | None,
    max_jobs: int | None,
    cuda_arch_list: str,
) -> None:
    """Build the patched CUDA wheel into dist/."""
    settings = settings_of(ctx)
    built = build_requested(
        WheelRequest(
            source=request,
            series=settings.series(skip, request.base_version or settings.catalog().default),
            catalog=settings.catalog(),
            fetch=settings.fetch_options(),
            dist_dir=dist_dir,
            mode=mode,
            work_dir=work_dir,
            build_tag=build_tag,
            probe_python=environ.probe_python(probe_python),
            probes=not no_probes,
            use_precompiled_kernels=use_precompiled_kernels,
            build_python=build_python,
            max_jobs=max_jobs,
            cuda_arch_list=cuda_arch_list,
            source_date_epoch=environ.source_date_epoch(),
        ),
        on_applied=tell_saved,
    )
    emit(settings, built.to_json(), _build_text(built.result, built.report))
