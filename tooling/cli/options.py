"""What every command shares: the settings the group options decide, the option decorators
that replace per-command copies, and how a result is printed (text, or one JSON document)."""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import click

from ..fetching.bases import BaseCatalog, load_bases
from ..fetching.fetch import DEFAULT_INDEX_URL, FetchOptions
from ..patching.series import Series, load_ledger
from ..paths import CacheLayout
from ..probing.env import resolve_probe_python
from . import environ

if TYPE_CHECKING:
    from ..fetching.upstream import SourceRequest, Upstream
    from ..patching.apply import ApplyOptions

#: A command function the shared option decorators wrap and hand back.
F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class Settings:
    """What the group options decided, shared by every command through the Click context."""

    cache: CacheLayout = field(default_factory=lambda: environ.cache_layout(None, checked=False))
    patches_dir_option: Path | None = None
    index_url: str = DEFAULT_INDEX_URL
    offline: bool = False
    progress: bool = True
    json: bool = False
    debug: bool = False
    emitted: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    """Options of a command group, read by its subcommands (and echoed in a JSON error)."""

    @property
    def patches_dir(self) -> Path:
        return self.patches_dir_option or environ.patches_dir()

    def catalog(self) -> BaseCatalog:
        return load_bases(self.patches_dir / "bases.toml")

    def series(self, skip: tuple[str, ...] = (), base: str | None = None) -> Series:
        """The ledger less ``skip``, whose requirements are read on ``base`` where given."""
        series = load_ledger(self.patches_dir)
        return series.without(list(skip), base) if skip else series

    def fetch_options(self) -> FetchOptions:
        return FetchOptions(
            cache=self.cache, index_url=self.index_url, offline=self.offline, progress=self.progress
        )

    def fetch(
        self, request: SourceRequest, *, with_wheel: bool = True, verify_wheel: bool = True
    ) -> Upstream:
        # Imported here, as GitPython is: `tooling host` runs on a GPU host's python3 that
        # has no GitPython until the bundle it installs brings it (tests/test_host_python.py).
        from ..fetching.upstream import fetch_requested

        return fetch_requested(
            self.catalog(),
            request,
            self.fetch_options(),
            with_wheel=with_wheel,
            verify_wheel=verify_wheel,
        )

    def probe_python(self, explicit: Path | None) -> Path | None:
        """The probes' interpreter (``probing.env.resolve_probe_python``)."""
        return resolve_probe_python(environ.probe_python(explicit), self.cache)

    def apply_options(
        self,
        probe_python: Path | None,
        three_way: bool,
        keep_going: bool,
        series: Series,
        *,
        probes: bool = True,
    ) -> ApplyOptions:
        from ..patching.request import apply_options

        return apply_options(
            series,
            self.catalog(),
            self.fetch_options(),
            environ.probe_python(probe_python),
            three_way=three_way,
            keep_going=keep_going,
            probes=probes,
        )


def settings_of(ctx: click.Context) -> Settings:
    # main() made it; ensure_object finds that one.
    return ctx.ensure_object(Settings)


def emit(settings: Settings, data: dict[str, Any], human: str) -> None:
    """Print a command's result; a failure raised afterwards adds only its stderr line."""
    settings.emitted = True
    if settings.json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        click.echo(human)


def nonblank(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A value given as an empty string names nothing: a usage error, not the default the
    option falls back to when it is left out."""
    if value is not None and not value.strip():
        raise click.BadParameter("it is empty: give a value, or leave the option out")
    return value


def json_option(f: F) -> F:
    def callback(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
        ctx.ensure_object(Settings).json = value
        return value

    # Eager: decided before any other option's callback can fail, so that failure is JSON too.
    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        is_eager=True,
        expose_value=False,
        callback=callback,
        help="Print one JSON document on stdout.",
    )(f)


def cache_options(f: F) -> F:
    """--offline and --cache-dir after the command name too (`tooling fetch --offline`)."""

    def offline(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
        if value:
            ctx.ensure_object(Settings).offline = True
        return value

    def cache_dir(ctx: click.Context, _param: click.Parameter, value: Path | None) -> None:
        if value is not None:
            ctx.ensure_object(Settings).cache = environ.cache_layout(value)

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


def wheel_options(wheel_help: str) -> Callable[[F], F]:
    """--wheel, else the one vllm-*.whl in --dist (default dist/, where `tooling build` puts it)."""

    def decorate(f: F) -> F:
        f = click.option(
            "--dist",
            "dist_dir",
            type=click.Path(path_type=Path, file_okay=False),
            default=Path("dist"),
            show_default=True,
            help="Where the build put the wheel.",
        )(f)
        return click.option(
            "--wheel",
            type=click.Path(path_type=Path, exists=True, dir_okay=False),
            help=f"{wheel_help} (default: the one vllm-*.whl in --dist).",
        )(f)

    return decorate


class FiniteRange(click.FloatRange):
    """Click's FloatRange without ``nan`` and ``inf``, which it lets through (no comparison
    with nan fails) and which no limit or share can be."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


def absolute(_ctx: click.Context, _param: click.Parameter, value: Path | None) -> Path | None:
    """An interpreter given relative to where the command runs, made absolute here: its
    children start in folders of their own, where ``py`` names nothing (a relative --python
    was "No such file or directory" for a file that exists). Not resolved: a virtualenv's
    python is a link whose own path finds its environment."""
    return Path(os.path.abspath(value)) if value is not None else None


def probe_python_option(f: F) -> F:
    return click.option(
        "--probe-python",
        type=click.Path(path_type=Path, exists=True),
        callback=absolute,
        help="Interpreter that runs the probes: it must import torch and vLLM's dependencies "
        "(default: $TOOLING_PROBE_PYTHON, else the cached probe environment).",
    )(f)


#: The parameters base_options declares, folded into the command's ``request``.
BASE_PARAMS = ("base_version", "source", "git_url", "ref", "allow_moving_ref")
#: The options only ``--source git`` reads, by parameter.
GIT_ONLY = {"git_url": "--git-url", "ref": "--ref", "allow_moving_ref": "--allow-moving-ref"}


def base_options(f: F) -> F:
    """--base, --source, --git-url, --ref, --allow-moving-ref (and the cache options), handed
    to the command as one ``request: SourceRequest``."""

    @functools.wraps(f)
    def command(*args: Any, **kwargs: Any) -> Any:
        from ..fetching.upstream import SourceRequest

        request = SourceRequest(*(kwargs.pop(name) for name in BASE_PARAMS))
        if request.source != "git":
            for name, flag in GIT_ONLY.items():
                if getattr(request, name) not in (None, False):
                    raise click.UsageError(
                        f"{flag} needs --source git; --source {request.source} would ignore it"
                    )
        return f(*args, request=request, **kwargs)

    g = cache_options(command)
    g = click.option(
        "--base",
        "base_version",
        metavar="VERSION",
        callback=nonblank,
        help="Pinned upstream vLLM release (default: bases.toml's default).",
    )(g)
    g = click.option(
        "--source",
        type=click.Choice(["pypi", "git"]),
        default="pypi",
        show_default=True,
        help="Where the upstream source comes from.",
    )(g)
    g = click.option(
        "--git-url", metavar="URL", callback=nonblank, help="git remote (default: bases.toml's)."
    )(g)
    g = click.option(
        "--ref",
        metavar="REF",
        callback=nonblank,
        help="git tag or commit (default: the base's tag).",
    )(g)
    g = click.option(
        "--allow-moving-ref", is_flag=True, help="Accept a branch name as --ref (not reproducible)."
    )(g)
    return cast(F, g)


def fuzz_campaign_options(out: Path, seconds_help: str, out_help: str) -> Callable[[F], F]:
    """--seconds, --no-shrink, --replay and --out, as every fuzz campaign takes them."""
    options = [
        click.option(
            "--seconds", type=click.FloatRange(1, 7 * 24 * 3600), default=None, help=seconds_help
        ),
        click.option("--no-shrink", is_flag=True, help="Save findings as found, not minimized."),
        click.option(
            "--replay",
            "replay",
            multiple=True,
            type=click.Path(path_type=Path, dir_okay=False),
            help="Run these saved cases again instead of drawing (repeatable).",
        ),
        click.option(
            "--out",
            "out_dir",
            type=click.Path(path_type=Path, file_okay=False),
            default=out,
            show_default=True,
            help=out_help,
        ),
    ]

    def decorate(f: F) -> F:
        for option in reversed(options):
            f = option(f)
        return f

    return decorate
