"""``tooling train``: the small target and DFlash drafter the acceptance smoke measures,
trained offline and seeded (``tooling.trainer``), in a child interpreter with torch."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..trainer.api import TrainRequest, train_in
from .options import absolute, emit, json_option, settings_of


@click.command("train")
@click.option(
    "--preset",
    default="full",
    show_default=True,
    help="Settings: full (the GPU recipe, minutes on one GPU) or smoke (tiny, CPU).",
)
@click.option(
    "--arch",
    type=click.Choice(["qwen3", "hybrid"]),
    help="Target architecture: qwen3 (attention only, the default presets) or hybrid "
    "(Qwen3.5/3.6's Gated DeltaNet family at the seed's head geometry); picks that "
    "architecture's preset of the --preset size.",
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
    callback=absolute,
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
    arch: str | None,
    overrides: tuple[str, ...],
    python: Path | None,
    out_dir: Path | None,
    device: str | None,
    export: Path | None,
    force: bool,
) -> None:
    """Train the small target and DFlash drafter the acceptance smoke measures (offline, seeded)."""
    settings = settings_of(ctx)
    request = TrainRequest(
        preset=preset,
        arch=arch,
        overrides=overrides,
        cache_dir=settings.cache.root,
        out_dir=out_dir,
        device=device,
        export=export,
        force=force,
    )
    pair = train_in(python or Path(sys.executable), request)
    emit(settings, {"ok": True, **pair.to_json()}, pair.describe())
