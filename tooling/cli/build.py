"""``tooling build``: the patched wheel into dist/ (stage: ``tooling.building``)."""

from __future__ import annotations

from pathlib import Path

import click

from ..building.build import BuildOptions, BuildResult, build_precompiled, source_date_epoch
from ..errors import BuildError
from ..fetching.upstream import SourceRequest
from ..fsutil import locked
from ..patching.apply import SeriesReport, ensure_patched
from ..patching.worktree import default_work_dir
from ..probe_cache import CACHED_NOTE
from ..report import human_size, table
from .options import base_options, emit, json_option, probe_python_option, settings_of
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
@click.option("--work-dir", type=click.Path(path_type=Path))
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
    help="Source mode: interpreter with a CUDA torch that runs vLLM's build.",
)
@click.option("--max-jobs", type=int, help="Source mode: MAX_JOBS for the compiler.")
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
    if dist_dir.exists() and not dist_dir.is_dir():
        raise BuildError(f"--dist {dist_dir.resolve()} is a file, not a folder")
    source_date_epoch()  # refused before any work, not after the tree is made
    settings = settings_of(ctx)
    series = settings.series(skip)
    # Precompiled mode re-verifies the official wheel while it copies (build.py).
    upstream = settings.fetch(request, verify_wheel=mode == "source")
    git_commit = upstream.git.commit if upstream.git else None
    work = (
        work_dir or default_work_dir(upstream.base.version, git_commit, series.skipped)
    ).resolve()
    # Held until the command ends: the build reads the tree's commits after it is patched.
    ctx.with_resource(locked(work))
    # --no-probes means none: not even the interpreter the environment configures.
    options = settings.apply_options(
        None if no_probes else probe_python, False, False, series, probes=not no_probes
    )
    report = ensure_patched(
        upstream, series, work, options, require_probes=not no_probes, on_applied=tell_saved
    )
    epoch = source_date_epoch()
    if mode == "source":
        from ..building.source_build import SourceBuildOptions, build_from_source

        result = build_from_source(
            upstream,
            series,
            report,
            SourceBuildOptions(
                dist_dir=dist_dir,
                use_precompiled_kernels=use_precompiled_kernels,
                build_tag=build_tag,
                source_date_epoch=epoch,
                build_python=build_python,
                max_jobs=max_jobs,
                cuda_arch_list=cuda_arch_list,
            ),
        )
    else:
        if use_precompiled_kernels:
            raise BuildError("--use-precompiled-kernels goes with --mode source")
        result = build_precompiled(
            upstream,
            series,
            report,
            BuildOptions(dist_dir=dist_dir, build_tag=build_tag, source_date_epoch=epoch),
        )
    data = {
        "ok": True,
        "wheel": str(result.path),
        "filename": result.filename,
        "version": result.version,
        "sha256": result.sha256,
        "size": result.size,
        "mode": result.mode,
        "seconds": result.seconds,
        "patches": [
            {"id": o.patch_id, "status": o.status, "probe": (o.probe_after or {}).get("status")}
            for o in report.outcomes
        ],
        "notes": result.notes,
    }
    emit(settings, data, _build_text(result, report))
