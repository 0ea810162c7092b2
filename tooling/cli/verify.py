"""``tooling verify``: an installed vLLM checked like ``rpm -V`` and by behaviour (stage:
``tooling.verifying``)."""

from __future__ import annotations

from pathlib import Path

import click

from ..report import table
from . import environ
from .environ import CACHED_NOTE
from .options import absolute, emit, json_option, probe_python_option, settings_of
from .registry_options import require_option


@click.command("verify")
@click.option(
    "--python",
    "python",
    type=click.Path(path_type=Path, exists=True),
    callback=absolute,
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
    required: list[int],
    probe_python: Path | None,
) -> None:
    """Check an installed vLLM: files against RECORD, and each fix by behaviour."""
    from ..verifying.request import VerifyRequest, verify_requested

    # Each names the install to check: with two, one of them would go unchecked.
    given = {"--python": python, "--site-packages": site, "--wheel": wheel}
    named = [flag for flag, value in given.items() if value is not None]
    if len(named) > 1:
        raise click.UsageError(f"{' and '.join(named)} each name an install to verify; give one")
    settings = settings_of(ctx)
    report = verify_requested(
        VerifyRequest(
            cache=settings.cache,
            required=required,
            python=python,
            site=site,
            wheel=wheel,
            probe_python=probe_python,
            default_probe_python=environ.probe_python(None),
        )
    )
    dist = report.dist
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
    if report.probes_cached:
        lines.append(CACHED_NOTE)
    emit(settings, report.to_json(), "\n".join(lines))
    report.raise_unless_ok()
