"""Click options whose help text and accepted values come from the patch registry.

The registry is read when a command parses its options or shows its help, not
when the CLI is imported: a broken ledger is then the one-line error of the
command that needs it, and ``tooling --help`` still works.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from ..patching.registry import Registry, registry

F = TypeVar("F", bound=Callable[..., Any])


class RegistryHelpOption(click.Option):
    """An option whose help is ``help_from(registry)``, computed when the help is shown."""

    def __init__(self, *args: Any, help_from: Callable[[Registry], str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.help_from = help_from

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        self.help = self.help_from(registry())
        return super().get_help_record(ctx)


def _known_probes(
    _ctx: click.Context, _param: click.Parameter, value: tuple[str, ...]
) -> tuple[str, ...]:
    known = registry().probes
    for name in value:
        if name not in known:
            raise click.BadParameter(f"{name!r} is not one of {', '.join(known)}")
    return value


def probe_option(f: F) -> F:
    """``--probe NAME`` (repeatable): one of the ledger's probes."""
    return click.option(
        "--probe",
        "names",
        multiple=True,
        metavar="PROBE",
        callback=_known_probes,
        cls=RegistryHelpOption,
        help_from=lambda r: f"Run only this probe (repeatable): {', '.join(r.probes)}.",
    )(f)


def _required_fixes(_ctx: click.Context, _param: click.Parameter, value: str) -> list[int]:
    fixes = registry().select(value)
    if not fixes:
        # Requiring nothing would pass any vLLM, stock included.
        raise click.BadParameter(f"{value!r} names no fix (all, or some of {registry().numbers})")
    return fixes


def require_option(f: F) -> F:
    """``--require SPEC``: the fix numbers verify must find present."""
    return click.option(
        "--require",
        "required",
        default="all",
        show_default=True,
        callback=_required_fixes,
        cls=RegistryHelpOption,
        help_from=lambda r: (
            f"Fixes that must be present: all, or some of {r.numbers} (numbers, patch ids, probes)."
        ),
    )(f)
