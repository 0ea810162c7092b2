"""The ``tooling`` command line: thin Click commands over the library.

Every command takes ``--json`` and then prints one JSON document on stdout.
Errors are mapped to exit codes in one place (``ToolingGroup.invoke``); a
ToolingError prints as a single line on stderr.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import click
import git

from . import __version__
from .apply import ApplyOptions, SeriesReport, apply_series, reusable_report
from .bases import Base, BaseCatalog, load_bases
from .build import BuildOptions, BuildResult, build_precompiled
from .errors import (
    BuildError,
    EnvironmentProblem,
    PatchConflictError,
    SeriesError,
    ToolingError,
    VerifyFixMissingError,
    VerifyIntegrityError,
    exit_code_for,
)
from .export import check_export, export_patches
from .fetch import DEFAULT_INDEX_URL, FetchOptions
from .fsutil import locked
from .paths import CacheLayout, default_cache_dir, default_patches_dir
from .probe_env import (
    check_probe_python,
    ensure_probe_env,
    ensure_reference_dflash,
    env_dir,
    probe_python_from_env,
    python_of,
)
from .probes import ProbeTarget, run_probes
from .registry import registry
from .registry_options import probe_option, require_option
from .report import human_size, table
from .series import Series, load_series
from .status import status_matrix
from .upstream import GitRequest, Upstream, fetch_upstream

#: A command function the shared option decorators wrap and hand back.
F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class Settings:
    """What the group options decided, shared by every command through the Click context."""

    cache: CacheLayout = field(default_factory=lambda: CacheLayout(default_cache_dir()))
    patches_dir_option: Path | None = None
    index_url: str = DEFAULT_INDEX_URL
    offline: bool = False
    progress: bool = True
    json: bool = False
    debug: bool = False
    emitted: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    """Options of a command group, read by its subcommands."""

    @property
    def patches_dir(self) -> Path:
        return self.patches_dir_option or default_patches_dir()

    def catalog(self) -> BaseCatalog:
        return load_bases(self.patches_dir / "bases.toml")

    def series(self, skip: tuple[str, ...] = ()) -> Series:
        series = load_series(self.patches_dir / "series.toml")
        return series.without(list(skip)) if skip else series

    def fetch_options(self) -> FetchOptions:
        return FetchOptions(
            cache=self.cache, index_url=self.index_url, offline=self.offline, progress=self.progress
        )

    def probe_python(self, explicit: Path | None) -> Path | None:
        """--probe-python, else $TOOLING_PROBE_PYTHON, else a completed cached probe env.

        One that cannot start is a ProbeError now, not an "unknown" probe later.
        """
        if explicit:
            return check_probe_python(explicit)
        from_env = probe_python_from_env()
        if from_env:
            return check_probe_python(from_env)
        env = env_dir(self.cache)
        return python_of(env) if (env / ".complete").is_file() else None


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the program stands so cleanup (temp files) runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _interrupted(signum: int, _frame: object) -> None:
    # A second signal while cleaning up ends the process at once.
    signal.signal(signum, signal.SIG_DFL)
    raise Interrupted(signum)


class ToolingGroup(click.Group):
    """Maps every failure to its exit code and a one-line message (or JSON).

    A ToolingError has its own code; a signal exits 128 + its number; anything
    else is a bug: one line and exit 1, the traceback only under --debug.
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ToolingError as e:
            _fail(ctx, str(e), exit_code_for(e))
        except git.GitCommandNotFound:
            problem = EnvironmentProblem(
                "git is not installed (not found on PATH); the work tree needs it"
            )
            _fail(ctx, str(problem), problem.exit_code)
        except KeyboardInterrupt as e:
            signum = getattr(e, "signum", signal.SIGINT)
            _fail(ctx, f"interrupted ({signal.Signals(signum).name})", 128 + signum)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as e:
            settings = ctx.find_object(Settings)
            if settings is not None and settings.debug:
                traceback.print_exc()
                ctx.exit(1)
            first = (str(e).strip().splitlines() or [""])[0][:300]
            _fail(
                ctx,
                f"unexpected {type(e).__name__}: {first} (rerun with --debug for the traceback)",
                1,
            )


def _fail(ctx: click.Context, message: str, code: int) -> None:
    settings = ctx.find_object(Settings)
    if settings is not None and settings.json and not settings.emitted:
        click.echo(
            json.dumps(
                {"ok": False, "error": message, "exit_code": code, **settings.extra},
                indent=2,
                default=str,
            )
        )
    click.echo(f"error: {message}", err=True)
    ctx.exit(code)


def json_option(f: F) -> F:
    def callback(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
        ctx.ensure_object(Settings).json = value
        return value

    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        expose_value=False,
        callback=callback,
        help="Print one JSON document on stdout.",
    )(f)


def emit(settings: Settings, data: dict[str, Any], human: str) -> None:
    """Print a command's result; a failure raised afterwards adds only its stderr line."""
    settings.emitted = True
    if settings.json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        click.echo(human)


def cache_options(f: F) -> F:
    """--offline and --cache-dir after the command name too (`tooling fetch --offline`)."""

    def offline(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
        if value:
            ctx.ensure_object(Settings).offline = True
        return value

    def cache_dir(ctx: click.Context, _param: click.Parameter, value: Path | None) -> None:
        if value is not None:
            ctx.ensure_object(Settings).cache = CacheLayout(value)

    f = click.option(
        "--offline",
        "offline_here",
        is_flag=True,
        expose_value=False,
        callback=offline,
        help="Use only the cache; never touch the network.",
    )(f)
    return click.option(
        "--cache-dir",
        "cache_dir_here",
        type=click.Path(path_type=Path),
        expose_value=False,
        callback=cache_dir,
        help="Artifact cache (as the group option).",
    )(f)


def probe_python_option(f: F) -> F:
    return click.option(
        "--probe-python",
        type=click.Path(path_type=Path, exists=True),
        help="Interpreter that runs the probes: it must import torch and vLLM's dependencies "
        "(default: $TOOLING_PROBE_PYTHON, else the cached probe environment).",
    )(f)


def base_options(f: F) -> F:
    f = cache_options(f)
    f = click.option(
        "--base",
        "base_version",
        metavar="VERSION",
        help="Pinned upstream vLLM release (default: bases.toml's default).",
    )(f)
    f = click.option(
        "--source",
        type=click.Choice(["pypi", "git"]),
        default="pypi",
        show_default=True,
        help="Where the upstream source comes from.",
    )(f)
    f = click.option("--git-url", metavar="URL", help="git remote (default: bases.toml's).")(f)
    f = click.option("--ref", metavar="REF", help="git tag or commit (default: the base's tag).")(f)
    f = click.option(
        "--allow-moving-ref", is_flag=True, help="Accept a branch name as --ref (not reproducible)."
    )(f)
    return f


def _fetch(
    settings: Settings,
    base_version: str | None,
    source: str,
    git_url: str | None,
    ref: str | None,
    allow_moving_ref: bool,
    with_wheel: bool = True,
    verify_wheel: bool = True,
) -> Upstream:
    catalog = settings.catalog()
    base = catalog.get(base_version)
    git_request = None
    if source == "git":
        git_request = GitRequest(
            url=git_url or catalog.git_url, ref=ref, allow_moving_ref=allow_moving_ref
        )
    return fetch_upstream(
        base,
        settings.fetch_options(),
        git=git_request,
        with_wheel=with_wheel,
        verify_wheel=verify_wheel,
    )


@click.group(cls=ToolingGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tooling")
@click.option(
    "--cache-dir",
    type=click.Path(path_type=Path),
    envvar="VLLM_DFLASH_CACHE",
    help="Artifact cache (default: $XDG_CACHE_HOME/vllm-dflash).",
)
@click.option(
    "--patches-dir",
    type=click.Path(path_type=Path),
    help="Folder with bases.toml, series.toml and the patches.",
)
@click.option(
    "--index-url",
    default=DEFAULT_INDEX_URL,
    show_default=True,
    envvar="TOOLING_INDEX_URL",
    help="PEP 503/691 simple index.",
)
@click.option("--offline", is_flag=True, help="Use only the cache; never touch the network.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@click.option("--debug", is_flag=True, help="Show the traceback of an unexpected error.")
@click.pass_context
def main(
    ctx: click.Context,
    cache_dir: Path | None,
    patches_dir: Path | None,
    index_url: str,
    offline: bool,
    no_progress: bool,
    debug: bool,
) -> None:
    """Fetch, patch, build, verify and smoke-test vLLM with the DFlash fixes."""
    # CI cancels and closed terminals end the run like Ctrl-C: temp files are removed.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupted)
    settings = ctx.ensure_object(Settings)
    settings.debug = debug
    settings.cache = CacheLayout(cache_dir or default_cache_dir())
    settings.index_url = index_url
    settings.offline = offline
    settings.progress = not no_progress
    settings.patches_dir_option = patches_dir


def _settings(ctx: click.Context) -> Settings:
    # main() made it; ensure_object finds that one.
    return ctx.ensure_object(Settings)


@main.command()
@base_options
@click.option("--no-wheel", is_flag=True, help="Fetch only the source, not the official wheel.")
@json_option
@click.pass_context
def fetch(
    ctx: click.Context,
    base_version: str | None,
    source: str,
    git_url: str | None,
    ref: str | None,
    allow_moving_ref: bool,
    no_wheel: bool,
) -> None:
    """Bring a pinned upstream vLLM (wheel + sdist, or git) into the cache, verified."""
    settings = _settings(ctx)
    upstream = _fetch(
        settings, base_version, source, git_url, ref, allow_moving_ref, with_wheel=not no_wheel
    )
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


def _work_dir(work_dir: Path | None, upstream: Upstream, series: Series) -> Path:
    """build/work/vllm-<base>[-git-<commit>][-skip-<ids>]: one tree per distinct series."""
    if work_dir:
        return work_dir.resolve()
    suffix = f"-git-{upstream.git.commit[:12]}" if upstream.git else ""
    suffix += "".join(f"-skip-{s}" for s in series.skipped)
    return (Path("build") / "work" / f"vllm-{upstream.base.version}{suffix}").resolve()


def _apply_options(
    settings: Settings,
    probe_python: Path | None,
    three_way: bool,
    keep_going: bool,
    series: Series,
    *,
    probes: bool = True,
) -> ApplyOptions:
    preimages: tuple[bytes, ...] = ()
    if three_way and series.validated_base:
        validated = fetch_upstream(
            settings.catalog().get(series.validated_base),
            settings.fetch_options(),
            with_wheel=False,
        )
        preimages = tuple(
            (validated.source_dir / f).read_bytes()
            for p in series.patches
            for f in p.files
            if (validated.source_dir / f).is_file()
        )
    return ApplyOptions(
        probe_python=settings.probe_python(probe_python) if probes else None,
        three_way=three_way,
        keep_going=keep_going,
        preimages=preimages,
        pycache=settings.cache.root / "pycache",
    )


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
    return "\n".join(lines)


def _tell_saved(report: SeriesReport) -> None:
    if report.saved_work:
        click.echo(
            f"note: the earlier work tree held work of yours; it was moved to "
            f"{report.saved_work} (`tooling patch --work-dir {report.saved_work} export` "
            "exports it)",
            err=True,
        )


def _fail_unless_ok(report: SeriesReport, settings: Settings) -> None:
    if report.ok:
        return
    bad = [o for o in report.outcomes if not o.ok]
    first = bad[0]
    raise PatchConflictError(
        f"patch {first.patch_id} ({first.patch_file}): {first.problem or first.message}"
        + (f" (+{len(bad) - 1} more)" if len(bad) > 1 else "")
    )


@main.group(cls=ToolingGroup, invoke_without_command=True)
@base_options
@click.option(
    "--work-dir",
    type=click.Path(path_type=Path),
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
def patch(
    ctx: click.Context,
    base_version: str | None,
    source: str,
    git_url: str | None,
    ref: str | None,
    allow_moving_ref: bool,
    work_dir: Path | None,
    three_way: bool,
    keep_going: bool,
    skip: tuple[str, ...],
    probe_python: Path | None,
) -> None:
    """Apply the patch series to a pinned base in a git work tree (one commit per patch)."""
    if ctx.invoked_subcommand is not None:
        ctx.obj.extra = {
            "base": base_version,
            "source": source,
            "work_dir": work_dir,
            "probe_python": probe_python,
            "three_way": three_way,
        }
        return
    settings = _settings(ctx)
    series = settings.series(skip)
    upstream = _fetch(
        settings, base_version, source, git_url, ref, allow_moving_ref, with_wheel=False
    )
    options = _apply_options(settings, probe_python, three_way, keep_going, series)
    work = _work_dir(work_dir, upstream, series)
    ctx.with_resource(locked(work))
    report = apply_series(upstream, series, work, options)
    _tell_saved(report)
    emit(settings, report.to_json(), _report_text(report))
    _fail_unless_ok(report, settings)


def _parse_bases(catalog: BaseCatalog, spec: str) -> list[Base]:
    if spec == "all":
        return list(catalog.bases.values())
    return catalog.select([v.strip() for v in spec.split(",") if v.strip()])


@patch.command("status")
@click.option(
    "--bases",
    "bases_spec",
    default="all",
    show_default=True,
    help="Comma-separated releases, or all pinned ones.",
)
@click.option("--workers", type=int, default=os.cpu_count() or 2, show_default=True)
@json_option
@click.pass_context
def patch_status(ctx: click.Context, bases_spec: str, workers: int) -> None:
    """The status of every patch on every release: the forward canary."""
    settings = _settings(ctx)
    series = settings.series()
    bases = _parse_bases(settings.catalog(), bases_spec)
    extra = settings.extra
    options = _apply_options(
        settings, extra.get("probe_python"), extra.get("three_way", False), True, series
    )
    started = time.perf_counter()
    results = status_matrix(
        bases,
        series,
        settings.fetch_options(),
        options,
        workers=workers,
        on_done=lambda r: click.echo(f"  {r.base}: done", err=True) if not settings.json else None,
    )
    seconds = time.perf_counter() - started
    ids = [p.id for p in series.patches]
    rows = [[r.base, *(r.cell(i) for i in ids)] for r in results]
    notes = [f"{r.base}: {r.error}" for r in results if r.error]
    human = table(["base", *ids], rows) + "".join(f"\n{n}" for n in notes)
    human += f"\n{len(bases)} releases in {seconds:.1f}s (! = applied but its probe is not present)"
    validated = next((r for r in results if r.base == series.validated_base), None)
    ok = validated is None or (validated.report is not None and validated.report.ok)
    emit(
        settings,
        {"ok": ok, "seconds": seconds, "patches": ids, "bases": [r.to_json() for r in results]},
        human,
    )
    if not ok:
        # Newer releases only report (the canary); the validated base must stay clean.
        raise PatchConflictError(
            f"the series does not apply cleanly on its validated base {series.validated_base}"
        )


@patch.command("export")
@click.option(
    "--check",
    is_flag=True,
    help="Apply the series to a scratch tree and fail if patches/ would change.",
)
@json_option
@click.pass_context
def patch_export(ctx: click.Context, check: bool) -> None:
    """Regenerate patches/ from the work tree's commits (or check it is current)."""
    settings = _settings(ctx)
    extra = settings.extra
    if check:
        series = settings.series()
        upstream = _fetch(
            settings,
            extra.get("base") or series.validated_base,
            extra.get("source", "pypi"),
            None,
            None,
            False,
            with_wheel=False,
        )
        result = check_export(upstream, series)
    else:
        series = load_series(settings.patches_dir / "series.toml", check_digests=False)
        upstream_version = extra.get("base") or series.validated_base
        work = extra.get("work_dir") or Path("build") / "work" / f"vllm-{upstream_version}"
        ctx.with_resource(locked(Path(work).resolve()))
        if not Path(work).is_dir():
            raise SeriesError(f"{work}: no work tree to export (run `tooling patch` first)")
        result = export_patches(Path(work), series)
    rows = [[p.file, p.state, p.sha256[:16]] for p in result.patches]
    emit(
        settings,
        {
            "ok": not (check and result.drifted),
            "check": check,
            "patches": [vars(p) for p in result.patches],
        },
        table(["patch file", "state", "sha256"], rows),
    )
    if check and result.drifted:
        names = ", ".join(f"{p.file} ({p.state})" for p in result.drifted)
        raise SeriesError(f"patches/ is out of date: {names}; run `tooling patch export`")


def ensure_patched(
    settings: Settings,
    upstream: Upstream,
    series: Series,
    work_dir: Path | None,
    probe_python: Path | None,
    require_probes: bool,
) -> SeriesReport:
    """The applied series for ``upstream``: reused when the work tree is current, else applied."""
    work = _work_dir(work_dir, upstream, series)
    # Held until the command ends: the build reads the tree's commits after this returns.
    click.get_current_context().with_resource(locked(work))
    # --no-probes means none: not even the interpreter the environment configures.
    options = _apply_options(settings, probe_python, False, False, series, probes=require_probes)
    if require_probes and options.probe_python is None:
        raise BuildError(
            "no probe interpreter: run `tooling probe-env`, set "
            "TOOLING_PROBE_PYTHON or pass --probe-python (or --no-probes)"
        )
    if work.is_dir():
        report = reusable_report(work, upstream, series)
        if report is not None and (report.probe_python or not require_probes):
            return report
    report = apply_series(upstream, series, work, options)
    _tell_saved(report)
    _fail_unless_ok(report, settings)
    return report


#: A zip entry's date holds years 1980-2107.
_ZIP_LAST_EPOCH = 4354819199


def _source_date_epoch() -> int | None:
    """``$SOURCE_DATE_EPOCH`` as the seconds a wheel's dates can hold, or None when unset."""
    value = os.environ.get("SOURCE_DATE_EPOCH")
    if not value:
        return None
    if not value.strip().isdigit():
        raise BuildError(f"SOURCE_DATE_EPOCH {value!r} is not a whole number of seconds")
    if int(value) > _ZIP_LAST_EPOCH:
        raise BuildError(f"SOURCE_DATE_EPOCH {value!r} is past 2107, the last year a zip can hold")
    return int(value)


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
    )


@main.command()
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
def build(
    ctx: click.Context,
    base_version: str | None,
    source: str,
    git_url: str | None,
    ref: str | None,
    allow_moving_ref: bool,
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
    _source_date_epoch()  # refused before any work, not after the tree is made
    settings = _settings(ctx)
    series = settings.series(skip)
    # Precompiled mode re-verifies the official wheel while it copies (build.py).
    upstream = _fetch(
        settings,
        base_version,
        source,
        git_url,
        ref,
        allow_moving_ref,
        verify_wheel=mode == "source",
    )
    report = ensure_patched(
        settings,
        upstream,
        series,
        work_dir,
        None if no_probes else probe_python,
        require_probes=not no_probes,
    )
    epoch = _source_date_epoch()
    if mode == "source":
        from .source_build import SourceBuildOptions, build_from_source

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
            BuildOptions(
                dist_dir=dist_dir,
                build_tag=build_tag,
                source_date_epoch=epoch,
            ),
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


@main.command()
@click.option(
    "--root",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    help="A folder holding vllm/ (default: the interpreter's installed vLLM).",
)
@click.option(
    "--python",
    "python",
    type=click.Path(path_type=Path, exists=True),
    help="Interpreter to probe with (default: the probe environment).",
)
@probe_option
@json_option
@click.pass_context
def probe(
    ctx: click.Context, root: Path | None, python: Path | None, names: tuple[str, ...]
) -> None:
    """Run the behavioural probes against a vLLM tree or environment."""
    settings = _settings(ctx)
    interpreter = python or settings.probe_python(None) or Path(sys.executable)
    results = run_probes(
        ProbeTarget(python=interpreter, root=root, pycache=settings.cache.root / "pycache"),
        names or registry().probes,
    )
    rows = [[r.probe, r.status, r.evidence] for r in results.values()]
    emit(
        settings,
        {"ok": True, "results": [r.to_json() for r in results.values()]},
        table(["probe", "status", "evidence"], rows),
    )


@main.command("probe-env")
@click.option(
    "--dflash-path", is_flag=True, help="Print the folder of the reference dflash package instead."
)
@json_option
@click.pass_context
def probe_env(ctx: click.Context, dflash_path: bool) -> None:
    """Create (once) the cached CPU interpreter for the probes and print its path."""
    settings = _settings(ctx)
    python = ensure_probe_env(settings.cache)
    reference = ensure_reference_dflash(settings.cache, python)
    emit(
        settings,
        {"ok": True, "python": str(python), "dflash_path": str(reference)},
        str(reference if dflash_path else python),
    )


@main.command("verify")
@click.option(
    "--python",
    "python",
    type=click.Path(path_type=Path, exists=True),
    help="Interpreter of the environment to verify (default: this one).",
)
@click.option(
    "--site-packages",
    "site",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    help="A site-packages folder to verify instead.",
)
@click.option(
    "--wheel",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="pip-install this wheel into a fresh virtualenv and verify that.",
)
@require_option
@probe_python_option
@json_option
@click.pass_context
def verify_command(
    ctx: click.Context,
    python: Path | None,
    site: Path | None,
    wheel: Path | None,
    require_spec: str,
    probe_python: Path | None,
) -> None:
    """Check an installed vLLM: files against RECORD, and each fix by behaviour."""
    import tempfile

    from .verify import (
        install_into_fresh_env,
        locate_in_site,
        locate_with_python,
        verify,
    )

    settings = _settings(ctx)
    required = registry().select(require_spec)
    pycache = settings.cache.root / "pycache"
    scratch = tempfile.TemporaryDirectory(prefix="dflash-verify-")
    ctx.call_on_close(scratch.cleanup)
    if wheel is not None:
        interpreter = settings.probe_python(probe_python)
        if interpreter is None:
            raise BuildError("--wheel needs the probe environment: run `tooling probe-env`")
        python = install_into_fresh_env(wheel.resolve(), interpreter, Path(scratch.name) / "venv")
    if site is not None:
        dist = locate_in_site(site.resolve())
        interpreter = settings.probe_python(probe_python) or Path(sys.executable)
        target = ProbeTarget(python=interpreter, root=site.resolve(), pycache=pycache)
        runtime = None  # which interpreter runs that folder is not known: the probes' one checks
    else:
        interpreter = python or Path(sys.executable)
        dist = locate_with_python(interpreter)
        target = ProbeTarget(python=interpreter, pycache=pycache)
        runtime = interpreter
        if python is not None and wheel is None and probe_python is not None:
            # --python names the vLLM, --probe-python what questions it: a --no-deps
            # install has no torch of its own, so every probe would read unknown.
            questioner = settings.probe_python(probe_python)
            assert questioner is not None  # given explicitly: checked, or an error
            target = ProbeTarget(python=questioner, root=dist.site, pycache=pycache)
    report = verify(dist, target, required, runtime_python=runtime)
    built = (
        f"built by this toolchain ({report.manifest.mode}, series "
        f"{report.manifest.series_digest[:12]})"
        if report.manifest
        else "not built by us"
    )
    lines = [
        f"vllm {dist.version} at {dist.site} ({built})",
        report.identity.describe(),
        report.bytecode.describe(),
    ]
    lines += [
        f"{p.kind}: {p.path}"
        + (f" ({p.detail})" if p.detail else "")
        + (f" [patch {', '.join(p.patches)}]" if p.patches else "")
        for p in report.problems
    ]
    lines.append(
        table(
            ["fix", "patch", "state", "evidence"],
            [[f.number, f.patch_id, f.state, f.evidence[:100]] for f in report.fixes],
        )
    )
    emit(settings, report.to_json(), "\n".join(lines))
    if report.identity.problem:
        raise VerifyIntegrityError(report.identity.problem)
    if not report.integrity_ok:
        first = report.problems[0]
        raise VerifyIntegrityError(
            f"{len(report.problems)} file(s) differ from RECORD, first: {first.kind} {first.path}"
            + (f" (patch {', '.join(first.patches)})" if first.patches else "")
        )
    if report.missing_fixes:
        names = ", ".join(f"{f.number} {f.patch_id} ({f.state})" for f in report.missing_fixes)
        raise VerifyFixMissingError(f"required fix not present: {names}")


def single_wheel(dist_dir: Path) -> Path:
    """The one vllm-*.whl in ``dist_dir`` (a build's output), or a clear error."""
    wheels = sorted(dist_dir.glob("vllm-*.whl"))
    if len(wheels) != 1:
        names = ", ".join(w.name for w in wheels) or "none"
        raise BuildError(f"{dist_dir}: expected one vllm-*.whl, found {len(wheels)} ({names})")
    return wheels[0]


@main.command("release")
@click.option(
    "--wheel",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="The built wheel (default: the one vllm-*.whl in --dist).",
)
@click.option(
    "--dist",
    "dist_dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=Path("dist"),
    show_default=True,
)
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
    from .release import write_release

    settings = _settings(ctx)
    wheel = wheel or single_wheel(dist_dir)
    status = json.loads(status_json.read_text()) if status_json else None
    files = write_release(dist_dir, wheel, settings.series(), status, list(extra))
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


def _install_wheel_for_smoke(wheel: Path, folder: Path) -> Path:
    """pip-install ``wheel`` into ``folder`` (--target, no deps) for the smoke to import."""
    from .errors import SmokeError
    from .install import pip_install

    failure = pip_install(wheel, target=folder)
    if failure is not None:
        raise SmokeError(f"pip could not install {wheel.name} for the smoke: {failure}")
    return folder


def _parse_engines(specs: tuple[str, ...]) -> dict[str, Path]:
    from .errors import SmokeError

    engines: dict[str, Path] = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not Path(folder).is_dir():
            raise SmokeError(f"--engine {spec!r}: expected NAME=DIR with DIR a folder holding vllm")
        engines[name] = Path(folder).resolve()
    return engines


@main.command("smoke")
@click.option("--tiny", is_flag=True, help="Generate a seeded tiny target, tokenizer and drafter.")
@click.option("--target", help="Target model: a local folder or a hub id.")
@click.option("--drafter", help="DFlash drafter: a local folder or a hub id.")
@click.option(
    "--wheel",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="pip-install this vLLM wheel (no deps) and smoke-test it.",
)
@click.option(
    "--workdir",
    type=click.Path(path_type=Path),
    default=None,
    help="Where models, logs and the report go (default: build/smoke/<time>).",
)
@click.option(
    "--expect",
    type=click.Choice(["fixed", "stock"]),
    default="fixed",
    show_default=True,
    help="stock: a negative control (checks 2-5 must fail).",
)
@click.option("--min-acceptance-length", type=float)
@click.option("--fidelity-gate", type=float, default=0.99, show_default=True)
@click.option("--no-fidelity", is_flag=True, help="Skip the in-process reference comparison.")
@click.option("--num-speculative-tokens", type=int, default=3, show_default=True)
@click.option("--gpu-memory-utilization", type=float, default=0.3, show_default=True)
@click.option(
    "--kv-cache-memory-bytes",
    type=int,
    help="Fixed KV-cache size per engine, no memory profiling (for runs sharing a GPU).",
)
@click.option(
    "--time-limit",
    type=float,
    default=540,
    show_default=True,
    help="Seconds for the whole run; every step is bounded.",
)
@click.option(
    "--tiny-arch",
    type=click.Choice(["hybrid", "qwen3"]),
    default="hybrid",
    show_default=True,
    help="--tiny target: Qwen3.5/3.6-family hybrid, or attention-only Qwen3.",
)
@click.option("--enforce-eager", is_flag=True, help="Eager mode (default: compiled + CUDA graphs).")
@click.option("--kv-cache-dtype", default="auto", show_default=True, help="e.g. fp8.")
@click.option("--tensor-parallel-size", type=int, default=1, show_default=True)
@click.option("--no-load", is_flag=True, help="Skip the concurrent bursts against the servers.")
@click.option("--no-audit", is_flag=True, help="Skip the concurrent audited in-process batch.")
@click.option(
    "--warm-cache",
    is_flag=True,
    help="Check 7: another build compiles into the cache first (--stock-site/--stock-wheel).",
)
@click.option(
    "--stock-site",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    help="A folder where another vLLM build is installed (pip --target), for --warm-cache.",
)
@click.option(
    "--stock-wheel",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="Another vLLM wheel to install (no deps) for --warm-cache.",
)
@click.option(
    "--sequential",
    is_flag=True,
    help="Start the two servers and the in-process engine one after another "
    "(default with --tiny: at once, on one GPU, each with a fixed KV cache; "
    "always so without --tiny).",
)
@click.option("--dry-run", is_flag=True, help="Print the commands a run would start.")
@click.option(
    "--trained",
    is_flag=True,
    help="Acceptance table on the trained pair (trains it when not cached).",
)
@click.option(
    "--engine",
    "engines",
    multiple=True,
    metavar="NAME=DIR",
    help="With --trained: a vLLM install to measure (repeatable).",
)
@json_option
@click.pass_context
def smoke_command(
    ctx: click.Context,
    tiny: bool,
    target: str | None,
    drafter: str | None,
    wheel: Path | None,
    workdir: Path | None,
    expect: str,
    min_acceptance_length: float | None,
    fidelity_gate: float,
    no_fidelity: bool,
    num_speculative_tokens: int,
    gpu_memory_utilization: float,
    kv_cache_memory_bytes: int | None,
    time_limit: float,
    tiny_arch: str,
    enforce_eager: bool,
    kv_cache_dtype: str,
    tensor_parallel_size: int,
    no_load: bool,
    no_audit: bool,
    warm_cache: bool,
    stock_site: Path | None,
    stock_wheel: Path | None,
    sequential: bool,
    dry_run: bool,
    trained: bool,
    engines: tuple[str, ...],
) -> None:
    """Serve a target with a DFlash drafter on a GPU and check every fix at run time."""
    from .errors import SmokeError
    from .smoke import (
        EngineSettings,
        SmokeConfig,
        Timeouts,
        describe_plan,
        format_table,
        run_smoke,
    )

    settings = _settings(ctx)
    workdir = (workdir or Path("build") / "smoke" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if wheel is not None:
        site = _install_wheel_for_smoke(wheel.resolve(), workdir / "site")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        sys.path.insert(0, str(site))
    if trained:
        _smoke_trained(settings, workdir, _parse_engines(engines))
        return
    if stock_wheel is not None and stock_site is not None:
        raise SmokeError("give --stock-site or --stock-wheel, not both")
    if stock_wheel is not None and not dry_run:
        stock_site = _install_wheel_for_smoke(stock_wheel.resolve(), workdir / "stock-site")
    config = SmokeConfig(
        workdir=workdir,
        target=target,
        drafter=drafter,
        tiny=tiny,
        engine=EngineSettings(
            num_speculative_tokens=num_speculative_tokens,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enforce_eager=enforce_eager,
            kv_cache_dtype=kv_cache_dtype,
            tensor_parallel_size=tensor_parallel_size,
        ),
        timeouts=Timeouts(total=time_limit),
        fidelity_gate=fidelity_gate,
        min_acceptance_length=min_acceptance_length,
        run_fidelity=not no_fidelity,
        expect=expect,
        tiny_arch=tiny_arch,
        load=not no_load,
        audit=not no_audit,
        warm_cache=warm_cache,
        other_site=str(stock_site.resolve()) if stock_site else None,
        overlap_engines=False if sequential else None,
    )
    if dry_run:
        plan = describe_plan(config)
        emit(settings, {"ok": True, "plan": plan}, json.dumps(plan, indent=2, default=str))
        return
    report = run_smoke(config, notify=None if settings.json else lambda m: click.echo(m, err=True))
    emit(settings, report.to_json(), format_table(report))
    if not report.passed:
        raise SmokeError(report.summary_line())


def _smoke_trained(settings: Settings, workdir: Path, engines: dict[str, Path]) -> None:
    """Train (or reuse) the recipe's pair, then measure each engine against the reference."""
    from .errors import SmokeError
    from .smoke.acceptance import measure_engines, table_markdown
    from .trainer.api import TrainRequest, train_in

    # In a child of this interpreter: its GPU memory is free again when the engines start.
    # Training takes about 5 minutes on an H200; its progress goes to this terminal.
    request = TrainRequest(cache_dir=settings.cache.root, export=workdir)
    pair = train_in(Path(sys.executable), request)
    if not engines:
        import vllm  # the interpreter's own vLLM

        engines = {"this": Path(vllm.__file__).parent.parent}
    # One engine at a time: vLLM profiles free GPU memory at start-up and fails
    # when another engine grows or shrinks beside it.
    reference, rows = measure_engines(pair.output_dir, engines, workdir, workers=1)
    emit(
        settings,
        json.loads((workdir / "acceptance.json").read_text()),
        table_markdown(reference, rows),
    )
    failed = [r.engine for r in rows if r.error]
    if failed:
        raise SmokeError(f"engines failed to run: {', '.join(failed)} (logs in {workdir})")


@main.command("bundle")
@click.option(
    "--wheel",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="The vLLM wheel to ship (default: the one vllm-*.whl in dist/).",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(path_type=Path),
    default=Path("build/bundle"),
    show_default=True,
)
@click.option(
    "--base",
    "base_version",
    metavar="VERSION",
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
    from . import bundle

    settings = _settings(ctx)
    wheel = wheel or single_wheel(Path("dist"))
    base = settings.catalog().get(base_version)
    config = bundle.BundleConfig(
        wheel=wheel.resolve(),
        out_dir=out_dir.resolve(),
        exclude_newer=exclude_newer or bundle.exclude_newer_for(base),
        python_version=python_version,
        platform=platform,
        extras=extras or bundle.DEFAULT_EXTRAS,
        exclude_present=exclude_present,
        split_bytes=bundle.parse_size(split) if split else None,
        index_url=settings.index_url,
        download_dir=settings.cache.root / "wheels",
        progress=settings.progress,
    )
    if lock_only is not None:
        resolution, plan = bundle.resolve_and_plan(config)
        bundle.write_lock(resolution, lock_only)
        emit(
            settings,
            {"ok": True, "lock": str(lock_only), "plan": plan.to_json()},
            f"{lock_only}: {len(plan.include)} packages resolved as of {config.exclude_newer}",
        )
        return
    plan, result = bundle.make_bundle(config)
    rows = [[f.path, human_size(f.size)] for f in (result.parts or result.files)[:60]]
    emit(
        settings,
        {"ok": True, "plan": plan.to_json(), "result": result.to_json()},
        table(["file", "size"], rows) + f"\n{result.bundle_dir} ({human_size(result.total_bytes)})",
    )


@main.command("train")
@click.option(
    "--preset",
    default="full",
    show_default=True,
    help="Settings: full (the GPU recipe, about 5 minutes on an H200) or smoke (tiny, CPU).",
)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a setting of the preset (repeatable; tuples as comma lists).",
)
@click.option(
    "--python",
    "python",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="Interpreter to train in: it must import torch, transformers, tokenizers and "
    "dflash (default: this one).",
)
@click.option(
    "--out-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="This exact run folder (default: <cache>/trained/<recipe digest>).",
)
@click.option("--device", help="Torch device (default: cuda:0, else the CPU).")
@click.option(
    "--export",
    type=click.Path(path_type=Path, file_okay=False),
    help="Also copy summary, prompts, reference and log here.",
)
@click.option("--force", is_flag=True, help="Retrain even when a finished run folder exists.")
@json_option
@click.pass_context
def train_command(
    ctx: click.Context,
    preset: str,
    overrides: tuple[str, ...],
    python: Path | None,
    out_dir: Path | None,
    device: str | None,
    export: Path | None,
    force: bool,
) -> None:
    """Train the small target and DFlash drafter the acceptance smoke measures (offline, seeded)."""
    from .trainer.api import TrainRequest, train_in

    settings = _settings(ctx)
    request = TrainRequest(
        preset=preset,
        overrides=overrides,
        cache_dir=settings.cache.root,
        out_dir=out_dir,
        device=device,
        export=export,
        force=force,
    )
    pair = train_in(python or Path(sys.executable), request)
    emit(settings, {"ok": True, **pair.to_json()}, pair.describe())
