"""The ``tooling`` command line: the group here, one module per command, each a thin Click
layer that parses, calls its stage's library function and prints text or ``--json``.

Every command takes ``--json`` and then prints one JSON document on stdout. Errors are mapped
to exit codes in one place (``group.ToolingGroup.invoke``); a ToolingError prints as a single
line on stderr. Shared options live in ``options``.
"""

from __future__ import annotations

import signal
from pathlib import Path

import click

from .. import __version__
from ..fetching.fetch import DEFAULT_INDEX_URL
from . import environ
from .build import build_command
from .bundle import bundle_command
from .fetch import fetch_command
from .fuzz import fuzz_group
from .group import ToolingGroup, configure_logging, interrupted
from .options import settings_of
from .patch import patch_group
from .probe import probe_command, probe_env_command
from .release import release_command
from .smoke import smoke_command
from .train import train_command
from .verify import verify_command


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


for command in (
    fetch_command,
    patch_group,
    build_command,
    verify_command,
    probe_command,
    probe_env_command,
    smoke_command,
    train_command,
    bundle_command,
    release_command,
    fuzz_group,
):
    main.add_command(command)
