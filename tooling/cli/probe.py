"""``tooling probe`` (the behavioural probes on a tree or an environment) and ``tooling
probe-env`` (the CPU interpreter they run in); the probes are ``tooling.probes``."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import ProbeError
from ..patching.registry import registry
from ..probes.result import UNKNOWN
from ..probing import probe_requested
from ..probing.env import ensure_probe_setup
from ..report import table
from . import environ
from .environ import CACHED_NOTE
from .options import absolute, emit, json_option, settings_of
from .registry_options import probe_option


@click.command("probe")
@click.option(
    "--root",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    help="A folder holding vllm/ (default: the interpreter's installed vLLM).",
)
@click.option(
    "--python",
    "python",
    type=click.Path(path_type=Path, exists=True),
    callback=absolute,
    help="Interpreter to probe with (default: the probe environment).",
)
@probe_option
@json_option
@click.pass_context
def probe_command(
    ctx: click.Context, root: Path | None, python: Path | None, names: tuple[str, ...]
) -> None:
    """Run the behavioural probes against a vLLM tree or environment."""
    settings = settings_of(ctx)
    results = probe_requested(
        root, python, names or registry().probes, settings.cache, environ.probe_python(None)
    )
    rows = [[r.probe, r.status, r.evidence] for r in results.values()]
    text = table(["probe", "status", "evidence"], rows)
    if any(r.cached for r in results.values()):
        text += "\n" + CACHED_NOTE
    # Present and absent are answers; a probe that reached none is no answer, not a pass.
    unknown = [r for r in results.values() if r.status == UNKNOWN]
    emit(settings, {"ok": not unknown, "results": [r.to_json() for r in results.values()]}, text)
    if unknown:
        raise ProbeError(
            f"{len(unknown)} of {len(results)} probes reached no verdict; "
            f"{unknown[0].probe}: {unknown[0].evidence}"
        )


@click.command("probe-env")
@click.option(
    "--dflash-path", is_flag=True, help="Print the folder of the reference dflash package instead."
)
@json_option
@click.pass_context
def probe_env_command(ctx: click.Context, dflash_path: bool) -> None:
    """Create (once) the cached CPU interpreter for the probes and print its path."""
    settings = settings_of(ctx)
    python, reference = ensure_probe_setup(settings.cache, offline=settings.offline)
    emit(
        settings,
        {"ok": True, "python": str(python), "dflash_path": str(reference)},
        str(reference if dflash_path else python),
    )
