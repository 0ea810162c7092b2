"""``tooling fuzz gpu``: the differential fuzzer on a GPU, DFlash against plain vLLM on drawn
settings and step-by-step workloads (stage: ``tooling.fuzzing``)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from ..errors import FuzzFindingError, ProbeError
from ..fsutil import sha256_bytes
from ..fuzzing.gpu import GIB, GpuPlan, run_gpu_campaign
from ..fuzzing.gpu_case import read_gpu_case_file
from ..fuzzing.gpu_oracles import MODES, Mode
from ..fuzzing.gpu_pair import GpuTarget, check_interpreter, check_pair
from ..fuzzing.gpu_report import SUMMARY_MD, CampaignReport
from ..report import table
from .options import absolute, emit, fuzz_campaign_options, json_option, settings_of

#: Bounds on what a campaign may ask for before anything starts.
MAX_SETTINGS = 100_000
MAX_WORKLOADS = 10_000


@click.command("gpu")
@click.option(
    "--pair",
    type=click.Path(path_type=Path, file_okay=False),
    required=True,
    help="A folder holding target/ and drafter/: the trained pair, or a seed-shaped one.",
)
@click.option(
    "--python",
    "python",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    callback=absolute,
    help="The interpreter of the vLLM under test (default: the probe interpreter).",
)
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True)
@click.option(
    "--settings",
    "settings_count",
    type=click.IntRange(1, MAX_SETTINGS),
    default=4,
    show_default=True,
    help="Engine pairs, each of settings drawn anew.",
)
@click.option(
    "--workloads",
    type=click.IntRange(1, MAX_WORKLOADS),
    default=16,
    show_default=True,
    help="Workloads each engine pair serves.",
)
@click.option(
    "--pair-seconds",
    type=click.FloatRange(60, 24 * 3600),
    default=1800.0,
    show_default=True,
    help="Stop an engine pair's processes after this long: a step that never returns.",
)
@click.option(
    "--mode",
    type=click.Choice(MODES),
    default="lossless",
    show_default=True,
    help="lossless: greedy outputs equal but at plain's near ties (a trained pair); noise: "
    "top-k logprobs within --noise (a random-weight pair).",
)
@click.option(
    "--noise",
    type=click.FloatRange(0, 10, min_open=True),
    default=None,
    help="With --mode noise: the plain engine's own logprob noise between batches.",
)
@click.option(
    "--reference-acceptance",
    type=click.FloatRange(1, 64),
    default=None,
    help="The drafter's mean acceptance length elsewhere: under half of it is a finding.",
)
@click.option(
    "--kv-cache-memory-bytes",
    type=click.IntRange(1 << 26, 1 << 40),
    default=8 * GIB,
    show_default=True,
    help="Each engine's KV cache (fixed, so two engines share the GPU).",
)
@click.option(
    "--one-engine-at-a-time",
    "one_at_a_time",
    is_flag=True,
    help="Each pair's DFlash engine serves alone, then its plain engine the same workloads: "
    "for a GPU that holds one engine of the pair only (twice the GPU time a pair).",
)
@fuzz_campaign_options(
    Path("build/fuzz/gpu"),
    "Start no engine pair after this long (each finishes its workloads and shrinks).",
    "Where the findings, summary.json and summary.md go.",
)
@json_option
@click.pass_context
def gpu_command(
    ctx: click.Context,
    pair: Path,
    python: Path | None,
    seed: int,
    settings_count: int,
    workloads: int,
    seconds: float | None,
    pair_seconds: float,
    mode: str,
    noise: float | None,
    reference_acceptance: float | None,
    kv_cache_memory_bytes: int,
    one_at_a_time: bool,
    no_shrink: bool,
    replay: tuple[Path, ...],
    out_dir: Path,
) -> None:
    """Serve drawn settings and workloads on a DFlash engine and a plain engine at once
    (or one after the other, with --one-engine-at-a-time).

    Every request must finish within a step bound with the engine making progress, no
    engine may crash or hang, greedy DFlash output must equal plain's but at plain's near
    ties (each listed), no first-pass KV slot may lie outside its request's blocks, and
    acceptance must not collapse. Exit 0 when nothing failed, 25 when something did (each
    saved as a case file, shrunk), 26 for a replay file that is not a case, 29 for a pair
    it cannot serve, 30 when the interpreter sees no GPU.
    """
    settings = settings_of(ctx)
    cases = tuple(read_gpu_case_file(p) for p in replay)
    shape = check_pair(pair)
    if mode == "noise" and noise is None:
        raise click.UsageError("--mode noise compares within --noise: give it")
    interpreter = python or settings.probe_python(None)
    if interpreter is None:
        raise ProbeError("no interpreter of a vLLM to fuzz: give --python")
    env = dict(os.environ)
    found = check_interpreter(interpreter, env)
    vllm_at = found.vllm
    plan = GpuPlan(
        seed=seed,
        settings=settings_count,
        workloads=workloads,
        seconds=seconds,
        pair_seconds=pair_seconds,
        shrink=not no_shrink,
        replay=cases,
        mode=Mode(kind=mode, noise=noise or 0.0, reference_acceptance=reference_acceptance),
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        max_k=shape.max_k,
        join_hold=found.join_hold,
        drafter_graphs=found.drafter_graphs,
        one_at_a_time=one_at_a_time,
    )
    install_key = sha256_bytes(vllm_at.encode())[:12]
    target = GpuTarget(
        python=interpreter,
        pair=pair.absolute(),
        env=env,
        vocab_size=shape.vocab_size,
        # One compile cache per vLLM install: campaigns of two installs can run at once.
        cache_root=settings.cache.root / "gpu-fuzz" / "vllm-cache" / install_key,
    )
    report = run_gpu_campaign(target, plan, out_dir, f"{interpreter} ({vllm_at})")
    emit(settings, report.to_json(), _text(report, out_dir))
    if report.findings:
        kinds = sorted({f.kind for f in report.findings})
        raise FuzzFindingError(
            f"{len(report.findings)} finding(s) ({', '.join(kinds)}) in {report.pairs} engine "
            f"pairs; saved in {out_dir}"
        )


def _text(report: CampaignReport, out_dir: Path) -> str:
    lines = [
        f"{report.pairs} engine pairs x {report.workloads} workloads x {report.requests} "
        f"requests in {report.gpu_seconds / 60:.1f} GPU minutes "
        f"({report.requests_per_gpu_minute:.1f} requests a GPU minute) on {report.found_on}"
        + (" (stopped early)" if report.stopped else "")
    ]
    if report.findings:
        rows = [[kind, str(n)] for kind, n in report.by_oracle().items()]
        lines.append(table(["oracle", "findings"], rows))
    for f in report.findings:
        lines.append(f"{f.kind}: {f.detail}\n  case: {f.file}")
    if not report.findings:
        lines.append(f"nothing failed; report in {out_dir / SUMMARY_MD}")
    return "\n".join(lines)
