"""``tooling fuzz scheduler``: the liveness and slot-safety fuzzer over vLLM's real
Scheduler, on the CPU (stage: ``tooling.fuzzing``)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from ..errors import FuzzFindingError, ProbeError
from ..fuzzing.cases import read_case_file
from ..fuzzing.scheduler import CampaignPlan, CampaignResult, run_campaign
from ..patching.worktree import default_work_dir
from ..probing.launch import ProbeTarget
from ..report import table
from .options import (
    Settings,
    emit,
    fuzz_campaign_options,
    json_option,
    probe_python_option,
    settings_of,
)

#: Bounds on what a campaign may ask for before anything starts.
MAX_CASES = 100_000_000
MAX_JOBS = 64


@click.group("fuzz")
def fuzz_group() -> None:
    """Seeded campaigns over serving settings and workloads, looking for what fails."""


@fuzz_group.command("scheduler")
@click.option(
    "--root",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    help="A folder holding vllm/ (default: the patched work tree, build/work/vllm-<base>).",
)
@click.option(
    "--python",
    "python",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="Fuzz this interpreter's installed vLLM instead of a tree.",
)
@click.option("--cases", type=click.IntRange(1, MAX_CASES), default=1000, show_default=True)
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True)
@click.option(
    "--jobs",
    type=click.IntRange(1, MAX_JOBS),
    default=None,
    help="Interpreters side by side (default: one a CPU core, at most 8).",
)
@fuzz_campaign_options(
    Path("build/fuzz/scheduler"),
    "Stop drawing cases after this long (each job finishes its case and shrink).",
    "Where the findings and summary.json go.",
)
@probe_python_option
@json_option
@click.pass_context
def scheduler_command(
    ctx: click.Context,
    root: Path | None,
    python: Path | None,
    cases: int,
    seed: int,
    jobs: int | None,
    seconds: float | None,
    no_shrink: bool,
    replay: tuple[Path, ...],
    out_dir: Path,
    probe_python: Path | None,
) -> None:
    """Drive vLLM's Scheduler for the seed's geometry with drawn settings and workloads.

    Every request must finish within a step bound, no step may schedule nothing while work
    waits, no KV slot may be written outside its request's blocks, no block may leak, and a
    setting that cannot serve must be refused before the weights load. Exit 0 when no case
    failed, 25 when one did (each saved as a case file, shrunk), 26 for a replay file that
    is not a case.
    """
    if root is not None and python is not None:
        raise click.UsageError("--root and --python each name the vLLM to fuzz; give one")
    settings = settings_of(ctx)
    plan = CampaignPlan(
        seed=seed,
        cases=cases,
        jobs=jobs or min(os.cpu_count() or 1, 8),
        seconds=seconds,
        shrink=not no_shrink,
        replay=tuple(read_case_file(p) for p in replay),
    )
    target = _target(settings, root, python, probe_python)
    result = run_campaign(target, plan, out_dir)
    emit(settings, result.to_json(), _text(result, out_dir))
    if result.errors:
        raise ProbeError(f"the fuzzer could not run: {result.errors[0]}")
    if result.findings:
        kinds = sorted({f.kind for f in result.findings})
        raise FuzzFindingError(
            f"{len(result.findings)} failing case(s) ({', '.join(kinds)}) in {result.cases} "
            f"cases; saved in {out_dir}"
        )


def _target(
    settings: Settings, root: Path | None, python: Path | None, probe_python: Path | None
) -> ProbeTarget:
    cache = settings.cache
    if python is not None:
        return ProbeTarget(python=python, pycache=cache.root / "pycache")
    if root is None:
        root = default_work_dir(settings.catalog().default)
        if not (root / "vllm").is_dir():
            raise ProbeError(
                f"no vLLM tree to fuzz at {root}: run `tooling patch` to make it, "
                "or give --root or --python"
            )
    interpreter = settings.probe_python(probe_python)
    if interpreter is None:
        raise ProbeError("no probe interpreter: run `tooling probe-env` or give --probe-python")
    return ProbeTarget(python=interpreter, root=root, pycache=cache.root / "pycache")


def _text(result: CampaignResult, out_dir: Path) -> str:
    rows = [[kind, str(n)] for kind, n in sorted(result.outcomes.items())]
    lines = [
        f"{result.cases} cases in {result.seconds:.0f} s ({result.cases_per_second:.1f} cases/s) "
        f"on {result.found_on}" + (" (stopped early)" if result.stopped else ""),
        table(["outcome", "cases"], rows),
    ]
    for f in result.findings:
        lines.append(f"{f.kind}: {f.detail}\n  case: {f.saved}")
    if not result.findings:
        lines.append(f"no failing case; summary in {out_dir / 'summary.json'}")
    return "\n".join(lines)


def _register() -> None:
    """The GPU fuzzer's command and its findings' referee, each from its own module, under
    this group."""
    from .fuzz_gpu import gpu_command
    from .fuzz_referee import referee_command

    fuzz_group.add_command(gpu_command)
    fuzz_group.add_command(referee_command)


_register()
