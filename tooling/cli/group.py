"""The error -> exit-code mapping, in one place: every failure is one line (or a JSON document
under --json) and its exit code; signals end the run as Ctrl-C does. And where the library's
log lines go: stderr (INFO, as plain lines; DEBUG too with --verbose) and --log-file."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import click

from ..entry import PACKAGE_LOG, package_logging
from ..errors import EnvironmentProblem, LogFileError, ToolingError, exit_code_for
from ..gitutil import git_commands_logged
from ..progress import BarSafeHandler
from .options import Settings

#: The logger every module's ``logging.getLogger(__name__)`` sits under.
log = PACKAGE_LOG

#: --log-file's lines: when, how severe and which module, then the message.
LOG_FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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


@contextlib.contextmanager
def logging_for_run() -> Iterator[None]:
    """The package's log lines on stderr, INFO and above, bare (the text as printed before
    there was logging), for one run of the command line, the git commands GitPython runs
    among them; the handlers this run added (--log-file's too) are closed and removed when
    it ends."""
    with package_logging(BarSafeHandler(logging.INFO)), git_commands_logged():
        yield


class LogFile(logging.FileHandler):
    """--log-file's handler: a write that fails (a full disk, /dev/full) stops its lines, once,
    instead of logging's traceback for every line and a failing close; the run goes on, and
    ``failure`` says why its log is not whole."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, encoding="utf-8")
        self.path = path
        self.failure: str | None = None

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if self.failure is None:
            self.failure = getattr(error, "strerror", None) or str(error)

    def emit(self, record: logging.LogRecord) -> None:
        if self.failure is None:
            super().emit(record)

    def flush(self) -> None:
        try:
            super().flush()
        except OSError as e:
            self.failure = self.failure or e.strerror or str(e)

    def close(self) -> None:
        # The stream's own close flushes once more: a full disk is no error of closing.
        with contextlib.suppress(OSError):
            super().close()


def log_file_failure() -> LogFileError | None:
    """Why --log-file holds less than the run logged, once it could not be written."""
    for handler in log.handlers:
        if isinstance(handler, LogFile) and handler.failure is not None:
            return LogFileError(
                f"--log-file {handler.path}: cannot write ({handler.failure}); the log stops "
                "where it failed"
            )
    return None


def configure_logging(verbose: bool, log_file: Path | None) -> None:
    """--verbose: DEBUG lines on stderr too; --log-file: every line, DEBUG included, with
    its time, level and module, appended to that file."""
    if verbose:
        for handler in log.handlers:
            if isinstance(handler, BarSafeHandler):
                handler.setLevel(logging.DEBUG)
        log.setLevel(logging.DEBUG)
    if log_file is None:
        return
    try:
        to_file = LogFile(log_file)
    except OSError as e:
        raise click.BadParameter(
            f"cannot write {log_file}: {e.strerror or e}", param_hint="'--log-file'"
        ) from None
    to_file.setFormatter(logging.Formatter(LOG_FILE_FORMAT))
    log.addHandler(to_file)
    log.setLevel(logging.DEBUG)


class ToolingGroup(click.Group):
    """Maps every failure to its exit code and a one-line message (or JSON).

    A ToolingError has its own code; a usage error keeps Click's (2); a signal
    exits 128 + its number; anything else is a bug: one line and exit 1, the
    traceback only under --debug.
    """

    def main(self, *args: Any, **kwargs: Any) -> Any:
        # Before parsing: a usage error's line goes through the same handler.
        with logging_for_run():
            return super().main(*args, **kwargs)

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
            done = super().invoke(ctx)
        except ToolingError as e:
            fail(ctx, str(e), exit_code_for(e))
        except KeyboardInterrupt as e:
            signum = getattr(e, "signum", signal.SIGINT)
            fail(ctx, f"interrupted ({signal.Signals(signum).name})", 128 + signum)
        except click.UsageError as e:
            usage_failed(ctx, e)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as e:
            if not _git_missing(e):
                unexpected(ctx, e)
            problem = EnvironmentProblem(
                "git is not installed (not found on PATH); the work tree needs it"
            )
            fail(ctx, str(problem), problem.exit_code)
        # The command's own answer stands; a log asked for and not kept is its own failure.
        incomplete = log_file_failure()
        if incomplete is not None and ctx.parent is None:
            fail(ctx, str(incomplete), incomplete.exit_code)
        return done


def _git_missing(error: Exception) -> bool:
    """Whether ``error`` is GitPython's "no git executable". Looked up only once GitPython is
    imported (a command that has not imported it cannot have raised it): `tooling host` runs
    on a GPU host's python3, which has no GitPython before the bundle is installed."""
    git = sys.modules.get("git")
    return git is not None and isinstance(error, git.GitCommandNotFound)


def unexpected(ctx: click.Context, error: Exception) -> NoReturn:
    """A bug: one line and exit 1, the traceback only under --debug."""
    settings = ctx.find_object(Settings)
    if settings is not None and settings.debug:
        traceback.print_exc()
        ctx.exit(1)
    first = (str(error).strip().splitlines() or [""])[0][:300]
    fail(
        ctx,
        f"unexpected {type(error).__name__}: {first} (rerun with --debug for the traceback)",
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
    log.error("error: %s", message)
    ctx.exit(code)
