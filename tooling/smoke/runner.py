"""Run the smoke on a GPU host: plan it, then execute that plan wave by wave.

1. The pair's figures (``pair``): a user's folders are read (never written) and a pair
   the smoke cannot serve is refused in one line before anything starts.
2. The preflight (``preflight``): which vLLM, what would stop the run minutes later,
   and the GPUs; with ``--tiny`` the pair is generated in a child meanwhile.
3. The plan (``plan.plan_smoke``): the same object ``--dry-run`` prints; a pair too
   large for the GPUs is refused here, still before any engine starts.
4. Each wave of the plan: its reference children first (when they load beside the
   engines), then its servers, the first-token engines and the in-process engine,
   all started before any is waited for. Children loaded beside the engines get the
   in-process engine's proposals as soon as it has run; the servers are observed one at
   a time, then everything of the wave stops; the reference then takes the servers'
   divergences and gives its counts.

Every vLLM process of the run uses ``workdir/vllm-cache`` (cleared first) as
VLLM_CACHE_ROOT, so a run never reads another run's compiled graphs unless the
warm-cache check puts them there on purpose. A step that fails turns only the checks
that need it into errors; the others still run.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..errors import SmokeError
from ..procs import sigterm_as_interrupt
from . import checks
from .config import (
    GpuFacts,
    SmokeConfig,
)
from .logscan import aux_layers_from_log_file
from .metrics import SpecDecodeStats
from .observe import ServerObservations, observe_server
from .pair import PairFacts, read_drafter_info
from .plan import (
    TINY_MODULE,
    Role,
    SmokePlan,
    Step,
    models_draw,
    pair_to_run,
    plan_smoke,
    serve_options,
)
from .preflight import gpu_facts, run_preflight
from .report import SmokeReport, StepRecord, plot_acceptance
from .run_state import (
    Notify,
    Observed,
    SmokeRun,
)
from .run_steps import (
    engine_child,
    first_tokens_child,
    first_tokens_report,
    reference_result,
    reference_work,
    start_reference_pool,
    variant_name,
)
from .server import RunningServer, free_port, serve
from .serving.tiny import load_manifest
from .verdicts import evaluate

logger = logging.getLogger(__name__)

PREFLIGHT_S = 120.0


def _progress(message: str) -> None:
    """A progress line where the caller takes none (``smoke --json``): a log line on stderr,
    marked as the smoke's among the other lines there."""
    logger.info("[smoke] %s", message)


def run_smoke(config: SmokeConfig, notify: Notify | None = None) -> SmokeReport:
    """Run every planned check and return the report (also written to
    ``workdir/report.json``).

    Raises SmokeError only when nothing can run (bad options, a pair the smoke cannot
    serve or fit, no importable vLLM); failed checks are in the report, not raised.
    KeyboardInterrupt (and SIGTERM, turned into it) stops every child first and then
    propagates.
    """
    pair = pair_to_run(config)
    run = SmokeRun(config, notify or _progress)
    run.workdir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(run.cache, ignore_errors=True)
    # The report on disk is this run's from here on, partial while it goes on: an earlier
    # run's verdict left there would read as this one's if this one is cut short.
    (run.workdir / "report.json").unlink(missing_ok=True)
    with sigterm_as_interrupt():
        return _run_all(run, pair)


def _run_all(run: SmokeRun, pair: PairFacts) -> SmokeReport:
    config = run.config
    vllm_info: dict[str, Any] = {}
    # GPUs given: a pair too large for them is refused before the preflight too.
    early = plan_smoke(config, pair, config.gpus) if config.gpus else None
    with _models_started(run, pair) as models:
        with run.step("preflight", run.logs / "vllm-import.log") as step:
            vllm_info = run_preflight(
                run.python, run.workdir, run.environment(), run.deadline.limit(PREFLIGHT_S), config
            )
            step.extra = vllm_info
        if not run.steps[-1].ok:
            raise SmokeError(run.steps[-1].message)
        plan = run.plan = early or plan_smoke(config, pair, _seen_gpus(vllm_info))
        run.notify(f"plan: {plan.layout}: {plan.why}")
        if models is not None:
            # Only the wait is timed here: the tiny pair was written during the preflight.
            with run.step("models", run.logs / "tiny.log") as step:
                target, drafter = models()
                step.extra = {"target": target, "drafter": drafter}
            if not run.steps[-1].ok:
                raise SmokeError(f"no models to serve: {run.steps[-1].message}")

    state = Observed()
    try:
        state.info = read_drafter_info(plan.drafter)
    except SmokeError as e:
        state.info_error = str(e)
    if config.warm_cache:
        shutil.rmtree(run.workdir / "vllm-cache-warm", ignore_errors=True)
    waves = plan.waves()[1:]
    for done, wave in enumerate(waves, 1):
        logger.debug("wave %d of %d: %s", done, len(waves), ", ".join(s.name for s in wave))
        _wave(run, plan, wave, state)
        if done < len(waves):
            # A long run (the seed's width: a wave an engine) can be cut short with no
            # chance to report: what its finished waves decided is on disk meanwhile.
            _report(run, plan, state, vllm_info, f"wave {done} of {len(waves)} done", done)
    return _report(run, plan, state, vllm_info)


def _report(
    run: SmokeRun,
    plan: SmokePlan,
    state: Observed,
    vllm_info: dict[str, Any],
    incomplete: str = "",
    waves_done: int = 0,
) -> SmokeReport:
    """The report of what ``state`` holds, written to the workdir: the run's verdicts, or
    with ``incomplete`` those its first ``waves_done`` waves reached and which checks wait."""
    config = run.config
    engine_result, engine_error = state.engine.get("engine", (None, _not_run(plan)))
    fidelity, fidelity_error = state.fidelity.get("engine", (None, engine_error))
    warm = None
    if config.warm_cache:
        warm = {name[-1]: state.fidelity.get(name, (None, ""))[0] for name in ("warm-A", "warm-B")}
        warm["C"] = fidelity
    first_tokens, first_error = first_tokens_report(plan, state)
    results = evaluate(
        config=config,
        planned=plan.checks,
        info=state.info,
        info_error=state.info_error,
        spec=state.spec,
        plain=state.plain,
        engine_result=engine_result,
        engine_error=engine_error,
        fidelity=fidelity,
        fidelity_error=fidelity_error,
        warm=warm,
        first_tokens=first_tokens,
        first_tokens_error=first_error,
        block_size=plan.engine.block_size,
    )
    if incomplete:
        results = [_pending(plan, r, waves_done) for r in results]
    stats = state.spec.spec_stats if state.spec else None
    report = SmokeReport(
        checks=results,
        steps=run.steps,
        workdir=run.workdir,
        models={
            "target": plan.target,
            "drafter": plan.drafter,
            "tiny": config.tiny,
            "tiny_arch": config.tiny_arch if config.tiny else None,
            "target_info": asdict(plan.target_info),
            "drafter_info": asdict(state.info) if state.info else None,
        },
        engine=asdict(plan.engine),
        vllm=vllm_info,
        plot=_plot(run, stats) if config.plot and not incomplete else None,
        expect=config.expect,
        plan=plan.to_json(),
        incomplete=incomplete,
    )
    report.write_json()
    return report


def _pending(plan: SmokePlan, result: checks.CheckResult, waves_done: int) -> checks.CheckResult:
    """``result``, or pending where a step it reads has not run by wave ``waves_done``."""
    waits = plan.waits_for(result.id, waves_done) if plan.runs(result.id) else []
    if not waits:
        return result
    return checks.CheckResult(result.id, checks.PENDING, f"waits for {', '.join(waits)}")


def _seen_gpus(info: dict[str, Any]) -> GpuFacts:
    """The GPUs the preflight saw (it refuses a run that sees none)."""
    facts = gpu_facts(info)
    assert facts is not None
    return facts


def _not_run(plan: SmokePlan) -> str:
    return "skipped (--no-fidelity)" if plan.step(Role.ENGINE) is None else "did not run"


@contextmanager
def _models_started(
    run: SmokeRun, pair: PairFacts
) -> Iterator[Callable[[], tuple[str, str]] | None]:
    """Start writing the tiny pair (``--tiny``) in a child now, so it overlaps the
    preflight; the function yielded waits for it and returns (target, drafter), None when
    there is nothing to draw (the user's pair). The child is stopped on any way out."""
    draw = models_draw(run.config, pair)
    if draw is None:
        yield None
        return
    child = run.start_child(
        TINY_MODULE,
        list(draw.args),
        log=run.logs / "tiny.log",
        timeout_s=draw.limit_s,
        env=run.environment(),
    )

    def wait() -> tuple[str, str]:
        child.wait()
        tiny = load_manifest(draw.out)
        return str(tiny.target), str(tiny.drafter)

    try:
        yield wait
    finally:
        child.stop()


def _wave(run: SmokeRun, plan: SmokePlan, steps: list[Step], state: Observed) -> None:
    """Start every process of one wave, do their work, stop them, then compare."""
    by_role = {s.role: s for s in steps}
    ref = by_role.get(Role.REFERENCE)
    engine_step = by_role.get(Role.ENGINE)
    name = (engine_step or ref or steps[0]).run
    with contextlib.ExitStack() as outer:
        pool = None
        if ref is not None and ref.loads_before_the_engine:
            pool = outer.enter_context(start_reference_pool(run, ref))
        observed: list[tuple[Step, ServerObservations, RunningServer, StepRecord]] = []
        with contextlib.ExitStack() as inner:
            servers = {
                s.role: inner.enter_context(_serve(run, plan, s))
                for s in steps
                if s.role in (Role.SERVE_DFLASH, Role.SERVE_PLAIN)
            }
            children = []
            for s in steps:
                if s.role in (Role.FIRST_TOKENS_DFLASH, Role.FIRST_TOKENS_PLAIN):
                    child = first_tokens_child(run, plan, s)
                    try:
                        children.append(child.start())
                        inner.callback(child.stop)
                    except SmokeError as e:
                        state.first_tokens[variant_name(plan, s)] = {"ok": False, "error": str(e)}
            if engine_step is not None:
                state.engine[name] = engine_child(run, plan, engine_step)
            if pool is not None and ref is not None:
                # Its proposals need only the engine: the children compare them while the
                # servers are observed, and take the servers' divergences at the end.
                work, _ = reference_work(run, plan, state, name)
                if work is not None:
                    pool.dispatch(work)
            prefix_ids: list[int] | None = None
            for role, server in servers.items():
                s = by_role[role]
                draft = plan.drafter if role == Role.SERVE_DFLASH else None
                with run.step(s.name, server.log) as record:
                    obs, prefix_ids = observe_server(
                        run,
                        server,
                        draft,
                        prefix_ids,
                        max_tokens=run.config.max_tokens,
                        max_model_len=plan.engine.max_model_len,
                        load=plan.runs(checks.LOAD),
                    )
                observed.append((s, obs, server, record))
            for child in children:
                variant = variant_name(plan, child.step)
                state.first_tokens[variant] = {"ok": False, "error": "did not finish"}
                with run.step(child.step.name, child.log):
                    state.first_tokens[variant] = child.result()
                if not run.steps[-1].ok:
                    state.first_tokens[variant] = {"ok": False, "error": run.steps[-1].message}
        for s, obs, server, record in observed:
            obs.stop = server.stop.how if server.stop else None
            obs.aux_layers = aux_layers_from_log_file(obs.log)
            record.ok = not obs.errors
            record.message = "; ".join(dict.fromkeys(obs.errors.values()))
            record.extra = obs.summary()
            if s.role == Role.SERVE_DFLASH:
                state.spec = obs
            else:
                state.plain = obs
        if ref is not None:
            if pool is None:
                pool = outer.enter_context(start_reference_pool(run, ref))
            state.fidelity[name] = reference_result(run, plan, ref, pool, state, name)


def _serve(
    run: SmokeRun, plan: SmokePlan, step: Step
) -> contextlib.AbstractContextManager[RunningServer]:
    """``vllm serve`` of a plan step: started on entering."""
    draft = plan.drafter if step.role == Role.SERVE_DFLASH else None
    log = run.logs / ("serve-dflash.log" if draft else "serve-plain.log")
    options = serve_options(
        plan.engine, plan.target_info, plan.target, draft, step.kv_cache_memory_bytes, free_port()
    )
    return serve(options, log=log, python=run.python, env=run.step_environment(step))


def _plot(run: SmokeRun, stats: SpecDecodeStats | None) -> Path | None:
    """The acceptance-per-position PNG, when there were drafts and matplotlib is importable."""
    if stats is None or not stats.accepted_per_position:
        return None
    length = stats.acceptance_length or 1.0
    return plot_acceptance(
        stats.per_position_rate(),
        run.workdir / "acceptance.png",
        f"DFlash acceptance per position (length {length:.2f})",
    )
