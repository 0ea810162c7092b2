"""The error -> exit-code mapping, in one place: every failure is one line (or a JSON document
under --json) and its exit code; signals end the run as Ctrl-C does."""

from __future__ import annotations

import json
import signal
import traceback
from typing import Any, NoReturn

import click
import git

from ..errors import EnvironmentProblem, ToolingError, exit_code_for
from .options import Settings


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the program stands so cleanup (temp files) runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def interrupted(signum: int, _frame: object) -> None:
    # A second signal while cleaning up ends the process at once.
    signal.signal(signum, signal.SIG_DFL)
    raise Interrupted(signum)


#: ``ctx.meta`` key: whether --json stands anywhere on the command line.
JSON_ASKED = "tooling.json_asked"


class ToolingGroup(click.Group):
    """Maps every failure to its exit code and a one-line message (or JSON).

    A ToolingError has its own code; a usage error keeps Click's (2); a signal
    exits 128 + its number; anything else is a bug: one line and exit 1, the
    traceback only under --debug.
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # An unknown option fails before --json is parsed: the words given decide. The
        # outermost group sees them all.
        ctx.meta.setdefault(JSON_ASKED, "--json" in args)
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as e:
            usage_failed(ctx, e)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ToolingError as e:
            fail(ctx, str(e), exit_code_for(e))
        except git.GitCommandNotFound:
            problem = EnvironmentProblem(
                "git is not installed (not found on PATH); the work tree needs it"
            )
            fail(ctx, str(problem), problem.exit_code)
        except KeyboardInterrupt as e:
            signum = getattr(e, "signum", signal.SIGINT)
            fail(ctx, f"interrupted ({signal.Signals(signum).name})", 128 + signum)
        except click.UsageError as e:
            usage_failed(ctx, e)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as e:
            settings = ctx.find_object(Settings)
            if settings is not None and settings.debug:
                traceback.print_exc()
                ctx.exit(1)
            first = (str(e).strip().splitlines() or [""])[0][:300]
            fail(
                ctx,
                f"unexpected {type(e).__name__}: {first} (rerun with --debug for the traceback)",
                1,
            )


def usage_failed(ctx: click.Context, error: click.UsageError) -> NoReturn:
    """Under --json, a usage error is one JSON document as any failure is; else Click's
    usage text."""
    settings = ctx.ensure_object(Settings)
    if settings.json or ctx.meta.get(JSON_ASKED):
        settings.json = True
        fail(ctx, error.format_message(), error.exit_code)
    raise error


def fail(ctx: click.Context, message: str, code: int) -> NoReturn:
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
