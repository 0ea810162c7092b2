"""The ``tooling`` command line: the group here, one module per command, each a thin Click
layer that parses, calls its stage's library function and prints text or ``--json``.

Every command takes ``--json`` and then prints one JSON document on stdout. Errors are mapped
to exit codes in one place (``group.ToolingGroup.invoke``); a ToolingError prints as a single
line on stderr. Shared options live in ``options``.
"""

from __future__ import annotations

import importlib
import signal
from pathlib import Path

import click

from .. import __version__
from ..fetching.fetch import DEFAULT_INDEX_URL
from . import environ
from .group import ToolingGroup, configure_logging, interrupted
from .options import settings_of

#: Each command by name: its module here and the Click object in it, imported when the
#: command runs (or help lists it). ``tooling host`` runs on a GPU host's python3, which has
#: no GitPython before the bundle it installs brings it: the other commands' modules import
#: it, and are not imported for ``host``.
COMMANDS = {
    "fetch": ("fetch", "fetch_command"),
    "patch": ("patch", "patch_group"),
    "build": ("build", "build_command"),
    "verify": ("verify", "verify_command"),
    "probe": ("probe", "probe_command"),
    "probe-env": ("probe", "probe_env_command"),
    "smoke": ("smoke", "smoke_command"),
    "train": ("train", "train_command"),
    "bundle": ("bundle", "bundle_command"),
    "release": ("release", "release_command"),
    "fuzz": ("fuzz", "fuzz_group"),
    "host": ("host", "host_group"),
}


class MainGroup(ToolingGroup):
    """The top group: its commands from ``COMMANDS``, each module imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*COMMANDS, *(name for name in self.commands if name not in COMMANDS)]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in COMMANDS and cmd_name not in self.commands:
            module, name = COMMANDS[cmd_name]
            self.add_command(getattr(importlib.import_module(f".{module}", __name__), name))
        return super().get_command(ctx, cmd_name)


@click.group(cls=MainGroup, context_settings={"help_option_names": ["-h", "--help"]})
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
@click.option(
    "-v", "--verbose", is_flag=True, help="Debug lines on stderr too (each child process run)."
)
@click.option(
    "--log-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Append every log line, debug included, with its time, to this file.",
)
@click.pass_context
def main(
    ctx: click.Context,
    cache_dir: Path | None,
    patches_dir: Path | None,
    index_url: str,
    offline: bool,
    no_progress: bool,
    debug: bool,
    verbose: bool,
    log_file: Path | None,
) -> None:
    """Fetch, patch, build, verify and smoke-test vLLM with the DFlash fixes."""
    # CI cancels and closed terminals end the run like Ctrl-C: temp files are removed.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, interrupted)
    configure_logging(verbose, log_file)
    settings = settings_of(ctx)
    settings.debug = debug
    settings.cache = environ.cache_layout(cache_dir)
    settings.index_url = index_url
    settings.offline = offline
    settings.progress = not no_progress
    settings.patches_dir_option = patches_dir
