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
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import SmokeCapacityError, SmokeError
from ..procs import log_tail, sigterm_as_interrupt, start_group, stop_group
from . import checks, distribution, load, observe
from .config import (
    FIDELITY_LENGTHS,
    FIDELITY_TEXTS,
    DrafterInfo,
    GpuFacts,
    SmokeConfig,
    read_drafter_info,
)
from .logscan import aux_layers_from_log_file
from .metrics import SpecDecodeStats
from .observe import ServerObservations, observe_server
from .pair import GIB, PairFacts, read_pair, tiny_pair
from .plan import TINY_MODULE, Role, SmokePlan, Step, models_draw, plan_smoke, serve_options
from .preflight import gpu_facts, query_gpus, run_preflight
from .reference_pool import ReferencePool, reference_pool
from .report import SmokeReport, StepRecord, plot_acceptance
from .server import RunningServer, child_environment, free_port, serve
from .serving.tiny import load_manifest
from .verdicts import evaluate, lossless_divergences

logger = logging.getLogger(__name__)

Notify = Callable[[str], None]

PREFLIGHT_S = 120.0
GPU_QUERY_S = 60.0
AUDIT_REQUESTS = 48


class Deadline:
    """The overall time limit (None: none); each step's own limit is cut to what is left."""

    def __init__(self, total_s: float | None) -> None:
        self.end = None if total_s is None else time.monotonic() + total_s

    def remaining(self) -> float:
        return float("inf") if self.end is None else self.end - time.monotonic()

    def limit(self, step_s: float, reserve_s: float = 0.0) -> float:
        """``step_s``, or less if the overall limit (minus ``reserve_s``) is closer."""
        left = self.remaining() - reserve_s
        if left < 1.0:
            raise SmokeError("the smoke's overall time limit is spent")
        return min(step_s, left)


class _Run:
    """Shared state of one smoke run: config, plan, deadline, step records, progress."""

    def __init__(self, config: SmokeConfig, notify: Notify) -> None:
        self.config = config
        self.notify = notify
        self.deadline = Deadline(config.timeouts.total)
        self.began = time.monotonic()
        self.steps: list[StepRecord] = []
        self.python = config.python or sys.executable
        self.workdir = config.workdir.resolve()
        self.cache = self.workdir / "vllm-cache"
        self.logs = self.workdir / "logs"
        self.plan: SmokePlan | None = None
        self.first_start_s: float | None = None
        """The first engine's measured start: later limits are multiples of it."""

    # observe.Budget
    def limit(self, what: str) -> float:
        assert self.plan is not None
        d, m = self.plan.deadlines, self.first_start_s
        seconds = {
            observe.START: d.start_s(m),
            observe.REQUEST: d.request.seconds(m),
            observe.LOAD: d.load.seconds(m),
        }[what]
        return self.deadline.limit(seconds, reserve_s=d.server_stop_s)

    def started(self, seconds: float, message: str) -> None:
        if self.first_start_s is None:
            self.first_start_s = seconds
        self.notify(message)

    def environment(
        self, cache: Path | None = None, site: str | None = None, gpus: tuple[int, ...] = ()
    ) -> dict[str, str]:
        """The children's environment: offline, this run's compile cache, ``site`` first,
        and only ``gpus`` (indices into the GPUs this run sees) visible."""
        env = child_environment()
        env["VLLM_CACHE_ROOT"] = str(cache or self.cache)
        if site:
            env["PYTHONPATH"] = os.pathsep.join([site, env["PYTHONPATH"]])
        if gpus:
            seen = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(seen[i] if seen else str(i) for i in gpus)
        return env

    def step_environment(self, step: Step) -> dict[str, str]:
        """A plan step's environment: check 7's runs share a cache of their own, and the
        first (A) imports the other build."""
        if step.run.startswith("warm-"):
            site = self.config.other_site if step.run == "warm-A" else None
            return self.environment(self.workdir / "vllm-cache-warm", site, step.gpus)
        return self.environment(gpus=step.gpus)

    @contextmanager
    def step(self, name: str, log: Path | None = None) -> Iterator[StepRecord]:
        """Time a step and record how it ended; SmokeError is recorded, not raised."""
        record = StepRecord(name=name, seconds=0.0, ok=True, log=str(log) if log else None)
        self.notify(f"{name} ...")
        start = time.monotonic()
        record.started_s = start - self.began
        try:
            yield record
        except SmokeError as e:
            record.ok = False
            record.message = str(e)
            self.notify(f"{name}: {e}")
        finally:
            record.seconds = time.monotonic() - start
            self.steps.append(record)

    def start_child(
        self, module: str, args: list[str], *, log: Path, timeout_s: float, env: dict[str, str]
    ) -> _Child:
        """``python -m module args``, started now; ``wait`` bounds it to ``timeout_s``."""
        env = dict(env)
        # In-process engine: the model runner must live in this interpreter.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        limit = self.deadline.limit(timeout_s)
        proc = start_group([self.python, "-m", module, *args], log=log, env=env)
        return _Child(module, proc, log, limit, time.monotonic())

    def child(
        self,
        module: str,
        args: list[str],
        *,
        log: Path,
        timeout_s: float,
        env: dict[str, str] | None = None,
    ) -> None:
        """Run ``python -m module args`` within its limit; SmokeError unless it exits 0."""
        child = self.start_child(
            module, args, log=log, timeout_s=timeout_s, env=env or self.environment()
        )
        try:
            child.wait()
        finally:
            child.stop()


@dataclass
class _Child:
    """A started child process, stopped with its whole group."""

    module: str
    proc: subprocess.Popen[bytes]
    log: Path
    limit: float
    started: float

    def wait(self) -> None:
        """SmokeError naming the module and its log unless it exits 0 within its limit."""
        left = max(self.limit - (time.monotonic() - self.started), 0.0)
        try:
            returncode: int | None = self.proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            returncode = None
        _raise_unless_done(self.module, returncode, self.limit, self.log)

    def stop(self) -> None:
        stop_group(self.proc, grace_s=10.0)


def _raise_unless_done(module: str, returncode: int | None, limit: float, log: Path) -> None:
    """SmokeError naming ``module`` and its log unless it exited 0 (None: ran out of time)."""
    if returncode is None:
        raise SmokeError(f"{module} did not finish within {limit:.0f}s (log: {log})")
    if returncode != 0:
        raise SmokeError(f"{module} exited {returncode}: {log_tail(log)} (log: {log})")


def _read_result(path: Path, log: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise SmokeError(f"{path.name} was not written: {log_tail(log)} (log: {log})") from None
    if not data.get("ok", True):
        raise SmokeError(f"{data.get('error')} (log: {log})")
    return data


@dataclass
class _JsonChild:
    """A child of the JSON protocol (``serving.child``): request in, result out."""

    run: _Run
    step: Step
    request: dict[str, Any]
    timeout_s: float
    child: _Child | None = None

    @property
    def paths(self) -> tuple[Path, Path]:
        return Path(self.step.argv[3]), Path(self.step.argv[4])

    @property
    def log(self) -> Path:
        return self.run.logs / f"{Path(self.step.argv[4]).stem}-run.log"

    def start(self) -> _JsonChild:
        in_path, out_path = self.paths
        in_path.write_text(json.dumps(self.request, indent=1), encoding="utf-8")
        out_path.unlink(missing_ok=True)
        self.child = self.run.start_child(
            self.step.argv[2],
            [str(in_path), str(out_path)],
            log=self.log,
            timeout_s=self.timeout_s,
            env=self.run.step_environment(self.step),
        )
        return self

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()

    def result(self) -> dict[str, Any]:
        """Its result (SmokeError when it failed); records its engine's start."""
        assert self.child is not None
        _, out_path = self.paths
        try:
            self.child.wait()
        except SmokeError:
            # The child's own error (in its result file) says more than its exit code.
            if out_path.is_file():
                _read_result(out_path, self.log)
            raise
        finally:
            self.child.stop()
        result = _read_result(out_path, self.log)
        if isinstance(result.get("startup_s"), (int, float)):
            self.run.started(result["startup_s"], f"{self.step.name}: engine started")
        return result


@dataclass
class _State:
    """What the waves observed so far."""

    info: DrafterInfo | None = None
    info_error: str = ""
    spec: ServerObservations | None = None
    plain: ServerObservations | None = None
    engine: dict[str, tuple[dict[str, Any] | None, str]] = field(default_factory=dict)
    """Run name (``engine``, ``warm-A``, ``warm-B``) -> (in-process result, why missing)."""
    fidelity: dict[str, tuple[dict[str, Any] | None, str]] = field(default_factory=dict)
    first_tokens: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Variant name -> its result (``{"ok": false, "error": ...}`` where it failed)."""


# --- the plan -------------------------------------------------------------------------


def pair_facts(config: SmokeConfig) -> PairFacts:
    """The pair's figures: the tiny pair's from its configs, a given one's from its folders
    (SmokePairError, one line, when the smoke cannot serve it)."""
    config.validate()
    if config.tiny:
        root = config.workdir.resolve() / "models"
        return tiny_pair(config.tiny_arch, config.tiny_hidden_size, root)
    assert config.target and config.drafter
    return read_pair(config.target, config.drafter)


def _pair_to_run(config: SmokeConfig) -> PairFacts:
    """``pair_facts``, and for a pair the run generates, the disk under the workdir checked
    against it: what a dry run and a run both refuse before anything starts."""
    pair = pair_facts(config)
    if config.tiny:
        check_models_disk(config.workdir.resolve() / "models", pair)
    return pair


MODELS_DISK_HEADROOM = 2 * GIB
"""Disk beyond a generated pair's weights: its tokenizer, the run's logs and compile caches."""


def check_models_disk(root: Path, pair: PairFacts) -> None:
    """Refuse a generated pair the disk under ``root`` cannot hold, in one line with both
    figures, before anything is written: at the seed's width the pair is about 57 GB, and a
    disk that fills half-way through its weights leaves a broken pair and no verdict."""
    weights = pair.target.weight_bytes + pair.drafter.weight_bytes
    need = weights + MODELS_DISK_HEADROOM
    existing = root
    while not existing.exists():
        existing = existing.parent
    # An earlier run's pair in the same workdir is written over, so its bytes are free too.
    earlier = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0
    free = shutil.disk_usage(existing).free + earlier
    if need > free:
        raise SmokeCapacityError(
            f"{root}: the generated pair needs {need / GIB:.1f} GiB of disk ({weights / GIB:.1f} "
            f"GiB of weights, {MODELS_DISK_HEADROOM / GIB:.0f} for logs and caches); "
            f"{free / GIB:.1f} GiB free there"
        )


def describe_plan(config: SmokeConfig) -> SmokePlan:
    """The plan ``run_smoke`` would execute, starting no engine (``--dry-run``). The GPUs are
    ``config.gpus``, else what torch sees in the serving interpreter."""
    pair = _pair_to_run(config)
    gpus = config.gpus
    if gpus is None:
        python = config.python or sys.executable
        # The query's files go to a scratch folder: a plan writes nothing (a failed query
        # names the log's last lines).
        with tempfile.TemporaryDirectory(prefix="smoke-plan-") as scratch:
            gpus = query_gpus(python, Path(scratch), child_environment(), GPU_QUERY_S)
    return plan_smoke(config, pair, gpus)


# --- the run --------------------------------------------------------------------------


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
    pair = _pair_to_run(config)
    run = _Run(config, notify or _progress)
    run.workdir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(run.cache, ignore_errors=True)
    # The report on disk is this run's from here on, partial while it goes on: an earlier
    # run's verdict left there would read as this one's if this one is cut short.
    (run.workdir / "report.json").unlink(missing_ok=True)
    with sigterm_as_interrupt():
        return _run_all(run, pair)


def _run_all(run: _Run, pair: PairFacts) -> SmokeReport:
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

    state = _State()
    try:
        state.info = read_drafter_info(plan.drafter)
    except SmokeError as e:
        state.info_error = str(e)
    if config.warm_cache:
        shutil.rmtree(run.workdir / "vllm-cache-warm", ignore_errors=True)
    waves = plan.waves()[1:]
    for done, wave in enumerate(waves, 1):
        _wave(run, plan, wave, state)
        if done < len(waves):
            # A long run (the seed's width: a wave an engine) can be cut short with no
            # chance to report: what its finished waves decided is on disk meanwhile.
            _report(run, plan, state, vllm_info, f"wave {done} of {len(waves)} done", done)
    return _report(run, plan, state, vllm_info)


def _report(
    run: _Run,
    plan: SmokePlan,
    state: _State,
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
    first_tokens, first_error = _first_tokens_report(plan, state)
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
def _models_started(run: _Run, pair: PairFacts) -> Iterator[Callable[[], tuple[str, str]] | None]:
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


def _wave(run: _Run, plan: SmokePlan, steps: list[Step], state: _State) -> None:
    """Start every process of one wave, do their work, stop them, then compare."""
    by_role = {s.role: s for s in steps}
    ref = by_role.get(Role.REFERENCE)
    engine_step = by_role.get(Role.ENGINE)
    name = (engine_step or ref or steps[0]).run
    with contextlib.ExitStack() as outer:
        pool = None
        if ref is not None and ref.loads_before_the_engine:
            pool = outer.enter_context(_reference_pool(run, ref))
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
                    child = _first_tokens_child(run, plan, s)
                    try:
                        children.append(child.start())
                        inner.callback(child.stop)
                    except SmokeError as e:
                        state.first_tokens[_variant_name(plan, s)] = {"ok": False, "error": str(e)}
            if engine_step is not None:
                state.engine[name] = _engine(run, plan, engine_step)
            if pool is not None and ref is not None:
                # Its proposals need only the engine: the children compare them while the
                # servers are observed, and take the servers' divergences at the end.
                work, _ = _reference_work(run, plan, state, name)
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
                variant = _variant_name(plan, child.step)
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
                pool = outer.enter_context(_reference_pool(run, ref))
            state.fidelity[name] = _reference(run, plan, ref, pool, state, name)


def _serve(
    run: _Run, plan: SmokePlan, step: Step
) -> contextlib.AbstractContextManager[RunningServer]:
    """``vllm serve`` of a plan step: started on entering."""
    draft = plan.drafter if step.role == Role.SERVE_DFLASH else None
    log = run.logs / ("serve-dflash.log" if draft else "serve-plain.log")
    options = serve_options(
        plan.engine, plan.target_info, plan.target, draft, step.kv_cache_memory_bytes, free_port()
    )
    return serve(options, log=log, python=run.python, env=run.step_environment(step))


def _variant_name(plan: SmokePlan, step: Step) -> str:
    k = plan.engine.num_speculative_tokens
    return "plain" if step.role == Role.FIRST_TOKENS_PLAIN else f"dflash-k{k}"


def _first_tokens_variants(plan: SmokePlan) -> list[distribution.Variant]:
    kv = {
        s.role: (s.kv_cache_memory_bytes or 0) / GIB
        for s in plan.steps
        if s.role in (Role.FIRST_TOKENS_DFLASH, Role.FIRST_TOKENS_PLAIN)
    }
    return distribution.smoke_variants(
        plan.engine.num_speculative_tokens,
        kv.get(Role.FIRST_TOKENS_PLAIN, 0.0),
        kv.get(Role.FIRST_TOKENS_DFLASH, 0.0),
    )


def _first_tokens_child(run: _Run, plan: SmokePlan, step: Step) -> _JsonChild:
    """One engine of the first-token check (``serving.distribution``)."""
    variants = {v.name: v for v in _first_tokens_variants(plan)}
    engine = plan.engine
    engine_args: dict[str, Any] = {"kv_cache_dtype": engine.kv_cache_dtype}
    if engine.block_size is not None:
        engine_args["block_size"] = engine.block_size
    request = distribution.request_for(
        variants[_variant_name(plan, step)],
        plan.target,
        plan.drafter,
        per_length=plan.prompts["first_tokens_per_length"],
        vocab_size=plan.pair["vocab_size"],
        max_model_len=engine.max_model_len,
        max_num_seqs=engine.max_num_seqs,
        enforce_eager=engine.enforce_eager,
        engine_args=engine_args,
    )
    d = plan.deadlines
    return _JsonChild(run, step, request, d.child_s(d.engine_run, run.first_start_s))


def _first_tokens_report(plan: SmokePlan, state: _State) -> tuple[distribution.Report | None, str]:
    if not plan.runs(checks.FIRST_TOKENS):
        return None, ""
    report = distribution.build_report(state.first_tokens, _first_tokens_variants(plan))
    return report, "; ".join(report.failures)


def _engine_request(run: _Run, plan: SmokePlan, step: Step, *, batch: bool) -> dict[str, Any]:
    """The in-process run's request; ``batch`` adds the concurrent audited batch."""
    config, engine = run.config, plan.engine
    concurrent = None
    if batch:
        # Shared-prefix prompts of 16-200 tokens, 4-60 output tokens: they finish
        # out of order while max_num_seqs keeps the batch turning over.
        vocab = (10, 1000)
        base = [random.Random(7).randrange(*vocab) for _ in range(max(load.PREFIX_LENGTHS))]
        concurrent = [
            {"prompt": list(item.prompt), "max_tokens": item.max_tokens}
            for item in load.load_items(base, AUDIT_REQUESTS, seed=3, vocab=vocab)
        ]
    return {
        "target": plan.target,
        "drafter": plan.drafter,
        "texts": list(FIDELITY_TEXTS),
        "lengths": list(FIDELITY_LENGTHS),
        "max_tokens": config.fidelity_max_tokens,
        "num_speculative_tokens": engine.num_speculative_tokens,
        "attention_backend": engine.attention_backend,
        "max_model_len": engine.max_model_len,
        "gpu_memory_utilization": engine.gpu_memory_utilization,
        "seed": engine.seed,
        "enforce_eager": engine.enforce_eager,
        "kv_cache_dtype": engine.kv_cache_dtype,
        # The in-process engine holds its model runner only at TP=1; the servers
        # run at the requested TP and executor.
        "tensor_parallel_size": 1,
        "max_num_seqs": engine.max_num_seqs,
        "block_size": engine.block_size,
        "kv_cache_memory_bytes": step.kv_cache_memory_bytes,
        "language_model_only": plan.target_info.multimodal,
        "gdn_prefill_backend": plan.target_info.gdn_prefill_backend,
        "features_path": str(run.workdir / f"{step.run}-features.pt"),
        "concurrent": concurrent,
    }


def _engine(run: _Run, plan: SmokePlan, step: Step) -> tuple[dict[str, Any] | None, str]:
    """One in-process engine run (``engine``: the main one, with the audited batch).
    Returns (its result, why it is missing)."""
    batch = step.run == "engine" and plan.runs(checks.SLOT_AUDIT)
    request = _engine_request(run, plan, step, batch=batch)
    d = plan.deadlines
    child = _JsonChild(run, step, request, d.child_s(d.engine_run, run.first_start_s))
    with run.step(step.name, child.log) as record:
        result = child.start().result()
        record.extra = {"proposals": len(result["proposals"]), "vllm": result.get("vllm_location")}
        return result, ""
    return None, run.steps[-1].message or "the in-process run did not finish"


def _reference_pool(run: _Run, step: Step) -> contextlib.AbstractContextManager[ReferencePool]:
    """The reference children of one engine run: started now when they load beside the
    engines, else at the comparison."""
    assert run.plan is not None
    plan = run.plan
    setup = {"target": plan.target, "drafter": plan.drafter, "dtype": run.config.reference_dtype}
    return reference_pool(
        run.python,
        run.workdir,
        run.logs,
        step.run,
        setup,
        shards=step.processes,
        env=run.step_environment(step),
        early=step.loads_before_the_engine,
    )


def _reference_work(
    run: _Run, plan: SmokePlan, state: _State, name: str
) -> tuple[dict[str, Any] | None, str]:
    """The reference's work on one engine run's proposals (a FidelityInput's fields, the
    servers' divergences aside). Returns (work, why there is none)."""
    engine_result, why = state.engine.get(name, (None, "the in-process run did not run"))
    if engine_result is None:
        return None, f"needs the in-process run: {why}"
    config = run.config
    expected = state.info.expected_aux_layers() if state.info else None
    subset = set(plan.reference.prompts)
    return {
        "prompts": engine_result["prompts"],
        "outputs": engine_result["outputs"],
        "proposals": [p for p in engine_result["proposals"] if int(p["prompt"]) in subset],
        "tie_tolerance": config.fidelity_tie_tolerance,
        "context": config.context_source(plan.target_info.hybrid),
        "features_path": engine_result.get("features_path"),
        "expected_layers": list(expected) if expected else None,
    }, ""


def _reference(
    run: _Run, plan: SmokePlan, step: Step, pool: ReferencePool, state: _State, name: str
) -> tuple[dict[str, Any] | None, str]:
    """The reference comparison of one engine run (and, for the main run, the target's
    margins at the servers' first differences), its proposals handed over now unless the
    pool has them already. Returns (fidelity result, why missing)."""
    work = None
    if not pool.dispatched:
        work, why = _reference_work(run, plan, state, name)
        if work is None:
            return None, why
    divergences = []
    if name == "engine" and state.spec is not None and state.plain is not None:
        divergences = lossless_divergences(state.spec, state.plain)
    d = plan.deadlines
    if step.loads_before_the_engine:
        limit = d.reference.seconds(run.first_start_s)
    else:
        limit = d.child_s(d.reference, run.first_start_s)
    with run.step(f"reference comparison ({name})", pool.log(0)) as record:
        if work is not None:
            pool.dispatch(work)
        fidelity = pool.finish(divergences, run.deadline.limit(limit))
        record.extra = {"seconds": fidelity.get("seconds"), "shards": fidelity.get("shards")}
        return fidelity, ""
    return None, run.steps[-1].message or "the reference comparison did not finish"


def _plot(run: _Run, stats: SpecDecodeStats | None) -> Path | None:
    """The acceptance-per-position PNG, when there were drafts and matplotlib is importable."""
    if stats is None or not stats.accepted_per_position:
        return None
    length = stats.acceptance_length or 1.0
    return plot_acceptance(
        stats.per_position_rate(),
        run.workdir / "acceptance.png",
        f"DFlash acceptance per position (length {length:.2f})",
    )
