"""``tooling fuzz referee``: the lossless findings of ``tooling fuzz gpu`` settled by the target
in float32 on the CPU (stage: ``tooling.fuzzing``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from ..errors import FuzzFindingError
from ..fuzzing.referee import NOISE, read_entries, referee
from .options import FiniteRange, absolute, emit, json_option, settings_of


@click.command("referee")
@click.argument(
    "findings",
    metavar="FINDING...",
    nargs=-1,
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
)
@click.option(
    "--target",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    required=True,
    help="The target the findings were served with: a Hugging Face model folder (the pair's "
    "target/).",
)
@click.option(
    "--python",
    "python",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    callback=absolute,
    help="An interpreter with torch and transformers that runs the target (default: this one; "
    "the probe interpreter has both).",
)
@click.option(
    "--noise",
    type=FiniteRange(0, 10),
    default=NOISE,
    show_default=True,
    help="How far float32 may prefer plain's token and the difference still be rounding: "
    "plain's own noise against itself.",
)
@json_option
@click.pass_context
def referee_command(
    ctx: click.Context, findings: tuple[Path, ...], target: Path, python: Path | None, noise: float
) -> None:
    """Settle each token difference of lossless FINDING files with the target in float32.

    For every difference a finding keeps (its prompt, the tokens both engines agreed on,
    DFlash's token, plain's token and plain's top logprobs), the target's float32 logprobs
    after that context, on the CPU: a defect when float32 prefers plain's token over
    DFlash's by more than --noise, rounding otherwise. One line a difference, with plain's
    bf16 top-2 margin and float32's margin of plain's token over DFlash's. Exit 0 when every
    difference is rounding, 25 when one is a defect, 26 for a file that is not a case, 31
    for a case with no evidence, 32 when the interpreter cannot import torch or
    transformers, 33 when the target cannot be run.
    """
    settings = settings_of(ctx)
    entries = read_entries(findings)
    interpreter = python or Path(sys.executable)
    report = referee(entries, target, interpreter, dict(os.environ), noise)
    emit(settings, report.to_json(), report.text())
    if report.defects:
        first = report.defects[0]
        raise FuzzFindingError(
            f"{len(report.defects)} of {len(report.judged)} difference(s) a defect in float32 "
            f"(first: {first.entry.file.name} {first.entry.evidence.request} position "
            f"{first.entry.evidence.position}, margin {first.float32.margin:+.6f} over the "
            f"noise {noise:g})"
        )
