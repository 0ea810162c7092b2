"""``tooling verify``: an installed vLLM checked like ``rpm -V`` and by behaviour (stage:
``tooling.verifying``)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..errors import BuildError, VerifyFixMissingError, VerifyIntegrityError
from ..probe_cache import CACHED_NOTE
from ..probes import ProbeTarget
from ..registry import registry
from ..report import table
from .options import emit, json_option, probe_python_option, settings_of
from .registry_options import require_option


@click.command("verify")
@click.option(
    "--python",
    "python",
    type=click.Path(path_type=Path, exists=True),
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
    require_spec: str,
    probe_python: Path | None,
) -> None:
    """Check an installed vLLM: files against RECORD, and each fix by behaviour."""
    import tempfile

    from ..verifying.verify import (
        install_into_fresh_env,
        locate_in_site,
        locate_with_python,
        verify,
    )

    settings = settings_of(ctx)
    required = registry().select(require_spec)
    pycache, kept = settings.cache.root / "pycache", settings.cache.probes
    scratch = tempfile.TemporaryDirectory(prefix="dflash-verify-")
    ctx.call_on_close(scratch.cleanup)
    if wheel is not None:
        interpreter = settings.probe_python(probe_python)
        if interpreter is None:
            raise BuildError("--wheel needs the probe environment: run `tooling probe-env`")
        python = install_into_fresh_env(wheel.resolve(), interpreter, Path(scratch.name) / "venv")
    if site is not None:
        dist = locate_in_site(site.resolve())
        interpreter = settings.probe_python(probe_python) or Path(sys.executable)
        target = ProbeTarget(python=interpreter, root=site.resolve(), pycache=pycache, cache=kept)
        runtime = None  # which interpreter runs that folder is not known: the probes' one checks
    else:
        interpreter = python or Path(sys.executable)
        dist = locate_with_python(interpreter)
        target = ProbeTarget(python=interpreter, pycache=pycache, cache=kept)
        runtime = interpreter
        if python is not None and wheel is None and probe_python is not None:
            # --python names the vLLM, --probe-python what questions it: a --no-deps
            # install has no torch of its own, so every probe would read unknown.
            questioner = settings.probe_python(probe_python)
            assert questioner is not None  # given explicitly: checked, or an error
            target = ProbeTarget(python=questioner, root=dist.site, pycache=pycache, cache=kept)
    report = verify(dist, target, required, runtime_python=runtime)
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
    if report.identity.problem:
        raise VerifyIntegrityError(report.identity.problem)
    if not report.integrity_ok:
        first = report.problems[0]
        raise VerifyIntegrityError(
            f"{len(report.problems)} file(s) differ from RECORD, first: {first.kind} {first.path}"
            + (f" (patch {', '.join(first.patches)})" if first.patches else "")
        )
    if report.missing_fixes:
        names = ", ".join(f"{f.number} {f.patch_id} ({f.state})" for f in report.missing_fixes)
        raise VerifyFixMissingError(f"required fix not present: {names}")
