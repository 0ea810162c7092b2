"""Run the whole smoke on a GPU host: models, two servers, the in-process run, the reference.

Order and why:
1. which vLLM (a quick import in the child interpreter: fails fast on a bad PYTHONPATH),
   and what else would stop the run minutes later (the preflight, which also
   answers vLLM's model-class inspection into the run's cache for every engine);
2. the models (``--tiny``: generated in a child, started beside the preflight);
2a. with ``warm_cache``: in a fresh compile cache, the other build's engine (A)
   then this one's (B), each with the reference; C is step 3 (its own cold
   cache). First, because that check is what such a run is for;
3. the in-process engine (``engine_run``): drafter windows, every proposal,
   the context features, then a concurrent batch with the lookahead-slot audit.
   With ``overlap_engines`` (the ``--tiny`` default) both servers of steps 4-5
   are started first and compile and warm up meanwhile: on an H200 each start of
   the tiny hybrid took 2-4 minutes, most of a run;
4. ``vllm serve`` with the DFlash drafter and prefix caching: lossless prompts,
   the repeated 200-token prompt, acceptance counters, the aux-layer log line;
5. ``vllm serve`` without speculation, same prefix caching: the same prompts;
6. the reference (``reference_pool``): agreement per draft position, once the
   servers have stopped; with ``overlap_engines`` its children start with step 3
   and load the models meanwhile, then wait for their share of the proposals.

Each server in step 4/5 also takes two concurrent bursts (``load``) when asked,
one server at a time, after the in-process engine has exited.
Every vLLM process of the run uses ``workdir/vllm-cache`` (cleared first) as
VLLM_CACHE_ROOT, so a run never reads another run's compiled graphs unless
the warm-cache check puts them there on purpose.

Every step has a time limit cut to what the overall limit leaves, and a step
that fails turns only the checks that need it into errors; the others still run.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import SmokeError
from ..procs import log_tail, run_child, sigterm_as_interrupt, start_group, stop_group
from . import checks, client, load, metrics
from .checks import CheckResult, PrefixObservation
from .config import (
    FIDELITY_LENGTHS,
    FIDELITY_TEXTS,
    LOSSLESS_PROMPTS,
    PREFIX_PROMPT_TEXT,
    PREFIX_PROMPT_TOKENS,
    DrafterInfo,
    EngineSettings,
    SmokeConfig,
    TargetInfo,
    read_drafter_info,
    read_target_info,
)
from .logscan import aux_layers_from_log_file
from .reference_pool import MODULE as REFERENCE_MODULE
from .reference_pool import ReferencePool, reference_pool
from .report import SmokeReport, StepRecord, plot_acceptance
from .server import (
    SERVED_MODEL_NAME,
    RunningServer,
    ServeOptions,
    build_serve_command,
    child_environment,
    free_port,
    serve,
)
from .serving.tiny import TinySpec, load_manifest

Notify = Callable[[str], None]


def _stderr(message: str) -> None:
    print(f"[smoke] {message}", file=sys.stderr, flush=True)


class Deadline:
    """The overall time limit; each step's own limit is cut to what is left of it."""

    def __init__(self, total_s: float) -> None:
        self.end = time.monotonic() + total_s

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def limit(self, step_s: float, reserve_s: float = 0.0) -> float:
        """``step_s``, or less if the overall limit (minus ``reserve_s``) is closer."""
        left = self.remaining() - reserve_s
        if left < 1.0:
            raise SmokeError("the smoke's overall time limit is spent")
        return min(step_s, left)


@dataclass
class ServerObservations:
    """What one server run saw; ``errors`` says which observations failed and why."""

    log: Path
    completions: list[client.Completion] = field(default_factory=list)
    prefix: PrefixObservation | None = None
    spec_stats: metrics.SpecDecodeStats | None = None
    aux_layers: tuple[int, ...] | None = None
    errors: dict[str, str] = field(default_factory=dict)
    startup_s: float | None = None
    stop: str | None = None
    """How the server's process group ended (procs.StopOutcome.how)."""
    load: dict[str, Any] | None = None
    """The concurrent bursts: ``first`` and ``measured`` summaries, acceptance under load."""
    prompt_ids: list[list[int]] | None = None
    """The lossless prompts as this server tokenized them for /v1/completions."""

    def summary(self) -> dict[str, Any]:
        return {
            "startup_s": self.startup_s,
            "stop": self.stop,
            "errors": self.errors,
            "load": self.load,
        }


def read_metrics(base_url: str, timeout_s: float = 10.0) -> list[metrics.Sample]:
    """The server's /metrics, parsed."""
    text = client.get_text(f"{base_url}/metrics", timeout_s)
    try:
        return metrics.parse_prometheus(text)
    except ValueError as e:
        raise SmokeError(f"{base_url}/metrics: {e}") from None


def _prefix_counters(base_url: str) -> metrics.PrefixCacheCounters:
    counters = metrics.prefix_cache_counters(read_metrics(base_url))
    if counters is None:
        raise SmokeError(f"{base_url}/metrics has no {metrics.PREFIX_CACHE_QUERIES} counter")
    return counters


def _wait_for_queries(
    base_url: str, at_least: float, timeout_s: float
) -> metrics.PrefixCacheCounters:
    # The server updates its counters after it answers; wait until the request shows.
    deadline = time.monotonic() + timeout_s
    while True:
        counters = _prefix_counters(base_url)
        if counters.queries >= at_least or time.monotonic() >= deadline:
            return counters
        time.sleep(0.2)


def settled_spec_stats(base_url: str, timeout_s: float = 5.0) -> metrics.SpecDecodeStats | None:
    """Spec-decode counters once two reads half a second apart agree."""
    deadline = time.monotonic() + timeout_s
    previous = metrics.spec_decode_stats(read_metrics(base_url))
    while time.monotonic() < deadline:
        time.sleep(0.5)
        current = metrics.spec_decode_stats(read_metrics(base_url))
        if current == previous:
            break
        previous = current
    return previous


def prefix_prompt_ids(base_url: str, model: str, timeout_s: float) -> list[int]:
    """Exactly PREFIX_PROMPT_TOKENS token ids of the prefix text, by the server's tokenizer."""
    ids = client.tokenize(base_url, model, PREFIX_PROMPT_TEXT, timeout_s=timeout_s)
    if not ids:
        raise SmokeError("the server tokenized the prefix prompt to nothing")
    while len(ids) < PREFIX_PROMPT_TOKENS:
        ids = ids + ids
    return ids[:PREFIX_PROMPT_TOKENS]


def observe_prefix_cache(
    base_url: str, model: str, ids: list[int], *, timeout_s: float
) -> PrefixObservation:
    """Send ``ids`` twice; what the second request got from the prefix cache."""
    before = _prefix_counters(base_url)
    client.complete(base_url, model, ids, max_tokens=8, timeout_s=timeout_s)
    middle = _wait_for_queries(base_url, before.queries + len(ids), timeout_s=10.0)
    second = client.complete(base_url, model, ids, max_tokens=8, timeout_s=timeout_s)
    after = _wait_for_queries(base_url, middle.queries + len(ids), timeout_s=10.0)
    delta = after.minus(middle)
    return PrefixObservation(
        prompt_tokens=len(ids),
        hits=delta.hits,
        queries=delta.queries,
        cached_tokens=second.cached_tokens,
    )


class _Run:
    """Shared state of one smoke run: config, deadline, step records, progress."""

    def __init__(self, config: SmokeConfig, notify: Notify) -> None:
        self.config = config
        self.notify = notify
        self.deadline = Deadline(config.timeouts.total)
        self.steps: list[StepRecord] = []
        self.python = config.python or sys.executable
        self.workdir = config.workdir.resolve()
        self.cache = self.workdir / "vllm-cache"
        self.target_info = TargetInfo(hybrid=False, multimodal=False)

    @property
    def engine(self) -> EngineSettings:
        """The flags every engine of this run gets (SmokeConfig.engine_settings)."""
        return self.config.engine_settings(self.target_info.hybrid)

    def environment(self, cache: Path | None = None, site: str | None = None) -> dict[str, str]:
        """The children's environment: offline, this run's compile cache, ``site`` first."""
        env = child_environment()
        env["VLLM_CACHE_ROOT"] = str(cache or self.cache)
        if site:
            env["PYTHONPATH"] = os.pathsep.join([site, env["PYTHONPATH"]])
        return env

    @contextmanager
    def step(self, name: str, log: Path | None = None) -> Iterator[StepRecord]:
        """Time a step and record how it ended; SmokeError is recorded, not raised."""
        record = StepRecord(name=name, seconds=0.0, ok=True, log=str(log) if log else None)
        self.notify(f"{name} ...")
        start = time.monotonic()
        try:
            yield record
        except SmokeError as e:
            record.ok = False
            record.message = str(e)
            self.notify(f"{name}: {e}")
        finally:
            record.seconds = time.monotonic() - start
            self.steps.append(record)

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
        env = dict(env or self.environment())
        # In-process engine: the model runner must live in this interpreter.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        limit = self.deadline.limit(timeout_s)
        result = run_child([self.python, "-m", module, *args], log=log, env=env, timeout_s=limit)
        _raise_unless_done(module, None if result.timed_out else result.returncode, limit, log)


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


#: Runs in the serving interpreter: which vLLM, whether the reference imports, the GPUs.
_PREFLIGHT = """
import json, pathlib, sys
import vllm
out = {"version": vllm.__version__, "location": str(pathlib.Path(vllm.__file__).parent)}
try:
    import dflash.model  # the reference the fidelity check compares with
    out["dflash_error"] = None
except Exception as e:
    out["dflash_error"] = f"{type(e).__name__}: {e}"
try:
    import torch
    out["gpus"] = [
        dict(zip(("free", "total"), torch.cuda.mem_get_info(i)))
        for i in range(torch.cuda.device_count())
    ]
except Exception as e:
    out["gpus"], out["gpu_error"] = None, f"{type(e).__name__}: {e}"
# vLLM inspects each model class in a subprocess of its own (an import of vLLM and
# torch: 19 s and 22 s for the hybrid pair on an H200 host, in each of the run's
# engines at once) unless VLLM_CACHE_ROOT/modelinfos holds the answer, keyed by the
# hash of the model's module. The run's cache starts empty; answered here, where vLLM
# is imported already, every engine reads it. Best effort: vLLM asks itself otherwise.
try:
    from vllm.model_executor.models import registry
    registry._run_in_subprocess = lambda fn: fn()
    for arch in json.loads(sys.argv[2]):
        registry.ModelRegistry.models[arch].inspect_model_cls()
    out["modelinfo_error"] = None
except Exception as e:
    out["modelinfo_error"] = f"{type(e).__name__}: {e}"
json.dump(out, open(sys.argv[1], "w"))
"""


def _preflight(run: _Run) -> dict[str, Any]:
    """Which vLLM the children import, and what would stop the run minutes later; it
    also fills the run's cache with vLLM's view of the model classes (see _PREFLIGHT)."""
    log = run.workdir / "logs" / "vllm-import.log"
    out = run.workdir / "vllm-import.json"
    limit = run.deadline.limit(120.0)
    archs = json.dumps(model_architectures(run.config))
    result = run_child(
        [run.python, "-c", _PREFLIGHT, str(out), archs],
        log=log,
        env=run.environment(),
        timeout_s=limit,
    )
    if result.returncode != 0 or not out.is_file():
        raise SmokeError(f"{run.python} cannot import vllm: {log_tail(log)} (log: {log})")
    info: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    problem = preflight_problem(info, run.config, run.python)
    if problem:
        raise SmokeError(f"{problem} (log: {log})")
    return info


def model_architectures(config: SmokeConfig) -> list[str]:
    """The model classes the run's engines resolve: the tiny pair's, or those the
    given folders' config.json name (none for a hub id: vLLM then asks itself)."""
    if config.tiny:
        return list(TinySpec.for_arch(config.tiny_arch).architectures)
    names: list[str] = []
    for folder in (config.target, config.drafter):
        try:
            data = json.loads(Path(str(folder), "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        names += [n for n in data.get("architectures") or [] if isinstance(n, str)]
    return names


def preflight_problem(info: dict[str, Any], config: SmokeConfig, python: str) -> str | None:
    """The first thing the preflight found that the run cannot start with (pure)."""
    gpus = info.get("gpus")
    if gpus is None:
        return f"{python} cannot query the GPUs: {info.get('gpu_error')}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    if not gpus:
        return f"no CUDA GPU is visible to {python} (CUDA_VISIBLE_DEVICES={visible})"
    tp = config.engine.tensor_parallel_size
    if len(gpus) < tp:
        return f"--tensor-parallel-size {tp} needs {tp} GPUs; {len(gpus)} visible"
    share = config.engine.gpu_memory_utilization
    free, total = gpus[0]["free"], gpus[0]["total"]
    if free < share * total:
        return (
            f"GPU 0 has {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB; vLLM needs "
            f"--gpu-memory-utilization {share} of it ({share * total / 2**30:.1f} GiB) free "
            "to start an engine"
        )
    if config.run_fidelity and info.get("dflash_error"):
        return (
            f"the reference package dflash does not import for {python} "
            f"({info['dflash_error']}): install dflash==0.1.0 there, or pass --no-fidelity"
        )
    return None


@contextmanager
def _models_started(run: _Run) -> Iterator[Callable[[], tuple[str, str]]]:
    """Start writing the tiny pair (``--tiny``) in a child now, so it overlaps the
    preflight; the function yielded waits for it and returns (target, drafter). The
    child is stopped on any way out."""
    config = run.config
    if not config.tiny:
        assert config.target and config.drafter
        given = (config.target, config.drafter)
        yield lambda: given
        return
    out = run.workdir / "models"
    log = run.workdir / "logs" / "tiny.log"
    module = "tooling.smoke.serving.tiny"
    args = [str(out), "--seed", str(config.tiny_seed), "--arch", config.tiny_arch]
    limit = run.deadline.limit(config.timeouts.tiny)
    started = time.monotonic()
    proc = start_group([run.python, "-m", module, *args], log=log, env=run.environment())

    def wait() -> tuple[str, str]:
        try:
            returncode: int | None = proc.wait(timeout=max(limit - (time.monotonic() - started), 0))
        except subprocess.TimeoutExpired:
            returncode = None
        _raise_unless_done(module, returncode, limit, log)
        tiny = load_manifest(out)
        return str(tiny.target), str(tiny.drafter)

    try:
        yield wait
    finally:
        stop_group(proc)


def _observe_server(
    run: _Run,
    server: RunningServer,
    drafter: str | None,
    prefix_ids: list[int] | None,
) -> tuple[ServerObservations, list[int] | None]:
    """Wait for a started server, then every request of steps 4-5 against it."""
    log = server.log
    obs = ServerObservations(log=log)
    timeouts = run.config.timeouts
    model = SERVED_MODEL_NAME
    try:
        obs.startup_s = server.wait_healthy(
            run.deadline.limit(timeouts.server_start, reserve_s=timeouts.server_stop)
        )
        url = server.base_url
        run.notify(f"server ready {obs.startup_s:.0f}s after its start at {url}")
        try:
            for prompt in LOSSLESS_PROMPTS:
                limit = run.deadline.limit(timeouts.request, reserve_s=timeouts.server_stop)
                obs.completions.append(
                    client.complete(
                        url, model, prompt, max_tokens=run.config.max_tokens, timeout_s=limit
                    )
                )
        except SmokeError as e:
            obs.errors["lossless"] = str(e)
        if drafter is not None:
            try:
                limit = run.deadline.limit(timeouts.request, reserve_s=timeouts.server_stop)
                obs.prompt_ids = [
                    client.tokenize(url, model, p, timeout_s=limit, add_special_tokens=True)
                    for p in LOSSLESS_PROMPTS
                ]
            except SmokeError:
                obs.prompt_ids = None  # only the lossless check's tie margins need them
        try:
            limit = run.deadline.limit(timeouts.request, reserve_s=timeouts.server_stop)
            prefix_ids = prefix_ids or prefix_prompt_ids(url, model, limit)
            obs.prefix = observe_prefix_cache(url, model, prefix_ids, timeout_s=limit)
        except SmokeError as e:
            obs.errors["prefix"] = str(e)
        if drafter is not None:
            try:
                obs.spec_stats = settled_spec_stats(url)
            except SmokeError as e:
                obs.errors["metrics"] = str(e)
        if run.config.load and prefix_ids:
            try:
                obs.load = _load_bursts(run, url, model, prefix_ids, drafter)
            except SmokeError as e:
                obs.errors["load"] = str(e)
    except SmokeError as e:
        for key in ("lossless", "prefix", "metrics", "load"):
            obs.errors.setdefault(key, str(e))
    return obs, prefix_ids


LOAD_FIRST = 32
LOAD_MEASURED = 64


def _load_bursts(
    run: _Run, url: str, model: str, prefix_ids: list[int], drafter: str | None
) -> dict[str, Any]:
    """A first burst (first traffic, timed on its own) then the measured burst.

    The shared prefixes are sent once, one at a time, before the bursts, so both
    servers start the bursts with the same cache content and the reuse compares.
    """
    limit = run.deadline.limit(run.config.timeouts.load, reserve_s=run.config.timeouts.server_stop)
    vocab = (10, 1000)
    warm = load.load_items(prefix_ids, len(load.PREFIX_LENGTHS), seed=99, vocab=vocab)
    for item in warm:
        client.complete(url, model, list(item.prompt), max_tokens=1, timeout_s=limit)
    first = load.burst(
        url, model, load.load_items(prefix_ids, LOAD_FIRST, seed=1, vocab=vocab), timeout_s=limit
    )
    before = metrics.spec_decode_stats(read_metrics(url)) if drafter else None
    measured = load.burst(
        url,
        model,
        load.load_items(prefix_ids, LOAD_MEASURED, seed=2, vocab=vocab),
        timeout_s=limit,
    )
    result: dict[str, Any] = {"first": first.summary(), "measured": measured.summary()}
    if drafter and before is not None:
        after = settled_spec_stats(url)
        if after is not None:
            drafts = after.num_drafts - before.num_drafts
            accepted = after.num_accepted_tokens - before.num_accepted_tokens
            result["acceptance_length"] = 1 + accepted / drafts if drafts else None
    return result


def run_smoke(config: SmokeConfig, notify: Notify | None = None) -> SmokeReport:
    """Run every check and return the report (also written to ``workdir/report.json``).

    Raises SmokeError only when nothing can run (bad options, no importable
    vLLM); failed checks are in the report, not raised. KeyboardInterrupt (and
    SIGTERM, turned into it) stops every child first and then propagates.
    """
    config.validate()
    run = _Run(config, notify or _stderr)
    run.workdir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(run.cache, ignore_errors=True)
    logs = run.workdir / "logs"
    with sigterm_as_interrupt():
        return _run_all(run, logs)


def _run_all(run: _Run, logs: Path) -> SmokeReport:
    config = run.config
    vllm_info: dict[str, Any] = {}
    target = drafter = None
    with _models_started(run) as models:
        with run.step("preflight", logs / "vllm-import.log") as step:
            vllm_info = _preflight(run)
            step.extra = vllm_info
        if not run.steps[-1].ok:
            raise SmokeError(run.steps[-1].message)
        # Only the wait is timed here: the tiny pair was written during the preflight.
        with run.step("models", logs / "tiny.log" if config.tiny else None) as step:
            target, drafter = models()
            step.extra = {"target": target, "drafter": drafter}
    if target is None or drafter is None:
        raise SmokeError(f"no models to serve: {run.steps[-1].message}")

    try:
        run.target_info = read_target_info(target)
    except SmokeError as e:
        raise SmokeError(f"the target cannot be served: {e}") from None

    info: DrafterInfo | None = None
    info_error = ""
    try:
        info = read_drafter_info(drafter)
    except SmokeError as e:
        info_error = str(e)

    expected = info.expected_aux_layers() if info else None
    warm = _warm_cache(run, logs, target, drafter, expected) if config.warm_cache else None
    with _reference_pool(run, logs, "engine", (target, drafter)) as pool:
        spec, plain, engine = _servers_and_engine(run, logs, target, drafter)
        engine_result, engine_error, fidelity, fidelity_error = _reference(
            run, pool, engine, expected, lossless_divergences(spec, plain)
        )
    if warm is not None:
        warm["C"] = fidelity

    results = evaluate(
        config=config,
        info=info,
        info_error=info_error,
        spec=spec,
        plain=plain,
        engine_result=engine_result,
        engine_error=engine_error,
        fidelity=fidelity,
        fidelity_error=fidelity_error,
        warm=warm,
        block_size=run.engine.block_size,
    )
    plot = _plot(run, spec.spec_stats) if config.plot else None
    report = SmokeReport(
        checks=results,
        steps=run.steps,
        workdir=run.workdir,
        models={
            "target": target,
            "drafter": drafter,
            "tiny": config.tiny,
            "tiny_arch": config.tiny_arch if config.tiny else None,
            "target_info": asdict(run.target_info),
            "drafter_info": asdict(info) if info else None,
        },
        engine=asdict(run.engine),
        vllm=vllm_info,
        plot=plot,
        expect=config.expect,
    )
    report.write_json()
    return report


def _servers_and_engine(
    run: _Run, logs: Path, target: str, drafter: str
) -> tuple[ServerObservations, ServerObservations, tuple[dict[str, Any] | None, str]]:
    """Steps 3-5: the in-process engine, then the server with the DFlash drafter and
    the one without (same prefix caching). With ``overlap_engines`` both servers
    start before the engine runs and stop together at the end; otherwise each
    starts when its turn comes and stops after it."""
    plan = (
        ("serve with DFlash", drafter, logs / "serve-dflash.log"),
        ("serve without speculation", None, logs / "serve-plain.log"),
    )
    overlap = run.config.overlaps
    observed: list[tuple[ServerObservations, RunningServer, StepRecord]] = []
    with contextlib.ExitStack() as both:
        early = [both.enter_context(_serve(run, target, d, log)) for _, d, log in plan if overlap]
        engine = _engine(run, logs, target, drafter)
        prefix_ids: list[int] | None = None
        for i, (name, draft, log) in enumerate(plan):
            with run.step(name, log) as step, contextlib.ExitStack() as own:
                server = early[i] if early else own.enter_context(_serve(run, target, draft, log))
                obs, prefix_ids = _observe_server(run, server, draft, prefix_ids)
            observed.append((obs, server, step))
    for obs, server, step in observed:
        obs.stop = server.stop.how if server.stop else None
        obs.aux_layers = aux_layers_from_log_file(obs.log)
        step.ok = not obs.errors
        step.message = "; ".join(dict.fromkeys(obs.errors.values()))
        step.extra = obs.summary()
    return observed[0][0], observed[1][0], engine


def _serve(
    run: _Run, target: str, drafter: str | None, log: Path
) -> contextlib.AbstractContextManager[RunningServer]:
    """``vllm serve`` of ``target`` (with ``drafter``, if any): started on entering."""
    options = ServeOptions(
        target,
        drafter,
        run.engine,
        port=free_port(),
        language_model_only=run.target_info.multimodal,
        gdn_prefill_backend=run.target_info.gdn_prefill_backend,
    )
    return serve(options, log=log, python=run.python, env=run.environment())


def _plot(run: _Run, stats: metrics.SpecDecodeStats | None) -> Path | None:
    """The acceptance-per-position PNG, when there were drafts and matplotlib is importable."""
    if stats is None or not stats.accepted_per_position:
        return None
    length = stats.acceptance_length or 1.0
    return plot_acceptance(
        stats.per_position_rate(),
        run.workdir / "acceptance.png",
        f"DFlash acceptance per position (length {length:.2f})",
    )


@dataclass
class _ChildStep:
    """One child run of the fidelity part: its module, files, log and limit."""

    module: str
    request: dict[str, Any]
    in_name: str
    out_name: str
    log: Path
    timeout_s: float
    env: dict[str, str] | None = None


def _run_json_child(run: _Run, step: _ChildStep) -> dict[str, Any]:
    """Write the request, run the child, return its result (SmokeError when it failed)."""
    in_path, out_path = run.workdir / step.in_name, run.workdir / step.out_name
    in_path.write_text(json.dumps(step.request, indent=1), encoding="utf-8")
    out_path.unlink(missing_ok=True)
    try:
        run.child(
            step.module,
            [str(in_path), str(out_path)],
            log=step.log,
            timeout_s=step.timeout_s,
            env=step.env,
        )
    except SmokeError:
        # The child's own error (in its result file) says more than its exit code.
        if out_path.is_file():
            _read_result(out_path, step.log)
        raise
    return _read_result(out_path, step.log)


AUDIT_REQUESTS = 48


def _engine_request(
    run: _Run, target: str, drafter: str, features: Path, *, batch: bool
) -> dict[str, Any]:
    """The in-process run's request; ``batch`` adds the concurrent audited batch."""
    config, engine = run.config, run.engine
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
        "target": target,
        "drafter": drafter,
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
        # run at the requested TP.
        "tensor_parallel_size": 1,
        "max_num_seqs": engine.max_num_seqs,
        "block_size": engine.block_size,
        "kv_cache_memory_bytes": engine.kv_cache_memory_bytes,
        "language_model_only": run.target_info.multimodal,
        "gdn_prefill_backend": run.target_info.gdn_prefill_backend,
        "features_path": str(features),
        "concurrent": concurrent,
    }


def _engine(
    run: _Run,
    logs: Path,
    target: str,
    drafter: str,
    name: str = "engine",
    env: dict[str, str] | None = None,
) -> tuple[dict[str, Any] | None, str]:
    """One in-process engine run (``engine``: the main one, with the audited batch),
    files and logs named by ``name``. Returns (its result, why it is missing)."""
    if not run.config.run_fidelity:
        return None, "skipped (--no-fidelity)"
    main = name == "engine"
    request = _engine_request(
        run, target, drafter, run.workdir / f"{name}-features.pt", batch=main and run.config.audit
    )
    engine_step = _ChildStep(
        module="tooling.smoke.serving.engine_run",
        request=request,
        in_name=f"{name}-in.json",
        out_name=f"{name}.json",
        log=logs / f"{name}-run.log",
        timeout_s=run.config.timeouts.engine_run,
        env=env,
    )
    with run.step(f"in-process engine ({name})", engine_step.log) as step:
        result = _run_json_child(run, engine_step)
        step.extra = {"proposals": len(result["proposals"]), "vllm": result.get("vllm_location")}
        return result, ""
    return None, run.steps[-1].message or "the in-process run did not finish"


def lossless_divergences(
    spec: ServerObservations, plain: ServerObservations
) -> list[dict[str, Any]]:
    """Where the servers' greedy completions first differ, as the reference's input:
    ``context`` (prompt ids and the common tokens) and ``tokens`` (with, without the
    drafter). Empty when any difference cannot be placed (the check then says so)."""
    ids = spec.prompt_ids
    if ids is None or len(spec.completions) != len(ids) or len(plain.completions) != len(ids):
        return []
    found = []
    for d in checks.first_differences(spec.completions, plain.completions):
        i, first = d["prompt"], d["first_difference"]
        if first is None or len(ids[i]) != spec.completions[i].prompt_tokens:
            return []  # one is a prefix of the other, or the ids are not what was served
        found.append(
            {
                "context": ids[i] + list(d["spec"][:first]),
                "tokens": [d["spec"][first], d["plain"][first]],
            }
        )
    return found


def _reference_pool(
    run: _Run,
    logs: Path,
    name: str,
    models: tuple[str, str],
) -> contextlib.AbstractContextManager[ReferencePool]:
    """The reference children for one engine run of ``models`` (target, drafter): started
    now when the engines share the GPU anyway (they load while the engine runs), else at
    the comparison. None of them runs without the fidelity check."""
    config = run.config
    setup = {"target": models[0], "drafter": models[1], "dtype": config.reference_dtype}
    return reference_pool(
        run.python,
        run.workdir,
        logs,
        name,
        setup,
        shards=config.reference_shards,
        env=run.environment(),
        early=config.overlaps and config.run_fidelity,
    )


def _reference(
    run: _Run,
    pool: ReferencePool,
    engine: tuple[dict[str, Any] | None, str],
    expected: tuple[int, ...] | None,
    divergences: list[dict[str, Any]] | None = None,
) -> tuple[dict[str, Any] | None, str, dict[str, Any] | None, str]:
    """The reference comparison of one engine run, and the target's margins at
    ``divergences`` (the servers' first differences).
    Returns (engine result, why it is missing, fidelity result, why it is missing)."""
    engine_result, why = engine
    if engine_result is None:
        if not run.config.run_fidelity:
            return None, why, None, why
        return None, why, None, f"needs the in-process run: {why}"
    config = run.config
    request = {
        "prompts": engine_result["prompts"],
        "outputs": engine_result["outputs"],
        "proposals": engine_result["proposals"],
        "tie_tolerance": config.fidelity_tie_tolerance,
        "context": config.context_source(run.target_info.hybrid),
        "features_path": engine_result.get("features_path"),
        "expected_layers": list(expected) if expected else None,
        "divergences": divergences or [],
    }
    with run.step(f"reference comparison ({pool.name})", pool.log(0)) as step:
        fidelity = pool.compare(request, run.deadline.limit(config.timeouts.reference))
        step.extra = {"seconds": fidelity.get("seconds"), "shards": fidelity.get("shards")}
        return engine_result, "", fidelity, ""
    why = run.steps[-1].message or "the reference comparison did not finish"
    return engine_result, "", None, why


def _warm_cache(
    run: _Run, logs: Path, target: str, drafter: str, expected: tuple[int, ...] | None
) -> dict[str, dict[str, Any] | None]:
    """A: the other build, cold, in a fresh cache; B: this build right after, same cache."""
    cache = run.workdir / "vllm-cache-warm"
    shutil.rmtree(cache, ignore_errors=True)
    runs: dict[str, dict[str, Any] | None] = {}
    for name, site in (("A", run.config.other_site), ("B", None)):
        env = run.environment(cache=cache, site=site)
        with _reference_pool(run, logs, f"warm-{name}", (target, drafter)) as pool:
            engine = _engine(run, logs, target, drafter, f"warm-{name}", env)
            runs[name] = _reference(run, pool, engine, expected)[2]
    return runs


def _why(obs: ServerObservations | None, key: str) -> str:
    if obs is None:
        return "the server did not run"
    return obs.errors.get(key, "")


def evaluate(
    *,
    config: SmokeConfig,
    info: DrafterInfo | None,
    info_error: str,
    spec: ServerObservations | None,
    plain: ServerObservations | None,
    engine_result: dict[str, Any] | None,
    engine_error: str,
    fidelity: dict[str, Any] | None,
    fidelity_error: str,
    warm: dict[str, dict[str, Any] | None] | None = None,
    block_size: int | None = 16,
) -> list[CheckResult]:
    """The verdicts from whatever the steps observed (pure: no I/O).

    ``block_size`` None: a hybrid target, whose prefix reuse is judged against
    the server without speculation.
    """
    results: list[CheckResult] = []

    # 1. lossless
    if spec is None or plain is None or "lossless" in spec.errors or "lossless" in plain.errors:
        why = _why(spec, "lossless") or _why(plain, "lossless")
        results.append(checks.error(checks.LOSSLESS, f"completions missing: {why}"))
    else:
        results.append(
            checks.check_lossless(
                spec.completions,
                plain.completions,
                list(LOSSLESS_PROMPTS),
                margins=(fidelity or {}).get("divergences"),
                tolerance=config.lossless_tie_tolerance,
            )
        )

    # 2. aux layers: the server log; the in-process run's record when the log has none
    if info is None:
        results.append(checks.error(checks.AUX_LAYERS, info_error))
    else:
        observed = spec.aux_layers if spec else None
        source = f"the server log {spec.log}" if spec else "the server log"
        if observed is None and engine_result and engine_result.get("aux_layers"):
            observed = tuple(engine_result["aux_layers"])
            source = "the in-process model runner"
        layers = (fidelity or {}).get("feature_layers") or {}
        captured = tuple(layers["nearest"]) if layers.get("nearest") else None
        results.append(
            checks.check_aux_layers(observed, info.expected_aux_layers(), source, captured)
        )

    # 3. drafter windows
    if not config.run_fidelity:
        results.append(checks.skipped(checks.DRAFTER_WINDOWS, engine_error))
    elif info is None:
        results.append(checks.error(checks.DRAFTER_WINDOWS, info_error))
    elif engine_result is None:
        results.append(checks.error(checks.DRAFTER_WINDOWS, engine_error))
    else:
        results.append(checks.check_windows(engine_result["windows"], info.expected_windows()))

    # 4. prefix cache
    if spec is None or spec.prefix is None:
        why = _why(spec, "prefix")
        results.append(checks.error(checks.PREFIX_CACHE, f"no prefix-cache observation: {why}"))
    else:
        control = plain.prefix if plain else None
        results.append(checks.check_prefix_cache(spec.prefix, control, block_size))

    # 5. fidelity
    if not config.run_fidelity:
        results.append(checks.skipped(checks.FIDELITY, fidelity_error))
    elif fidelity is None:
        results.append(checks.error(checks.FIDELITY, fidelity_error))
    else:
        verdict = checks.check_fidelity(fidelity, config.fidelity_gate)
        if config.engine.kv_cache_dtype != "auto":
            # A quantized KV cache is not the bf16 reference's arithmetic: the
            # figure is reported, not gated.
            verdict = replace(verdict, status=checks.INFO)
        results.append(verdict)

    # 6. acceptance
    if spec is None or "metrics" in spec.errors:
        why = _why(spec, "metrics")
        results.append(checks.error(checks.ACCEPTANCE, f"no /metrics: {why}"))
    else:
        results.append(checks.check_acceptance(spec.spec_stats, config.min_acceptance_length))

    # 7. warm compile cache
    if not config.warm_cache:
        results.append(checks.skipped(checks.WARM_CACHE, "not asked (--warm-cache)"))
    else:
        expected = info.expected_aux_layers() if info else None
        results.append(checks.check_warm_cache(warm or {}, config.fidelity_gate, expected))

    # 8. lookahead-slot audit (the in-process concurrent batch)
    if not (config.run_fidelity and config.audit):
        results.append(checks.skipped(checks.SLOT_AUDIT, "not asked"))
    elif engine_result is None or engine_result.get("slot_audit") is None:
        results.append(checks.error(checks.SLOT_AUDIT, f"no in-process run: {engine_error}"))
    else:
        results.append(checks.check_slot_audit(engine_result["slot_audit"]))

    # 9. concurrent load through both servers
    if not config.load:
        results.append(checks.skipped(checks.LOAD, "not asked (--no-load)"))
    elif spec is None or plain is None or spec.load is None or plain.load is None:
        why = _why(spec, "load") or _why(plain, "load") or "no bursts ran"
        results.append(checks.error(checks.LOAD, f"no concurrent load: {why}"))
    else:
        results.append(checks.check_load(spec.load, plain.load))
    return results


def describe_plan(config: SmokeConfig) -> dict[str, Any]:
    """What ``run_smoke`` would start, without starting anything (for ``--dry-run``).

    Model paths of ``--tiny`` are where the run would generate them; ports are
    chosen at run time (shown as 0).
    """
    config.validate()
    python = config.python or sys.executable
    workdir = config.workdir.resolve()
    target = config.target or str(workdir / "models" / "target")
    drafter = config.drafter or str(workdir / "models" / "drafter")
    steps: list[dict[str, Any]] = []
    if config.tiny:
        steps.append(
            {
                "step": "models",
                "argv": [
                    python,
                    "-m",
                    "tooling.smoke.serving.tiny",
                    str(workdir / "models"),
                    "--arch",
                    config.tiny_arch,
                ],
            }
        )

    def child(name: str, module: str, files: tuple[str, str]) -> dict[str, Any]:
        return {"step": name, "argv": [python, "-m", module, *(str(workdir / f) for f in files)]}

    def engine(name: str) -> dict[str, Any]:
        files = (f"{name}-in.json", f"{name}.json")
        return child(f"in-process engine ({name})", "tooling.smoke.serving.engine_run", files)

    early = config.overlaps

    def reference(name: str) -> dict[str, Any]:
        # One entry for its processes: the same argv but the shard's result file.
        files = (f"{name}-reference-setup.json", f"{name}-fidelity-0.json")
        step = child(f"reference comparison ({name})", REFERENCE_MODULE, files)
        return {**step, "processes": config.reference_shards, "loads_before_the_engine": early}

    def engine_and_reference(name: str) -> list[dict[str, Any]]:
        pair = [engine(name), reference(name)]
        return pair[::-1] if early else pair

    # The order run_smoke starts them in: the warm-cache runs, then the in-process
    # engine and the servers (the servers first when they overlap), the reference last
    # (with the engine when they overlap: it loads, then waits for the proposals).
    for name in ("warm-A", "warm-B") if config.warm_cache else ():
        steps += engine_and_reference(name)
    servers = [
        {
            "step": name,
            "argv": build_serve_command(
                ServeOptions(target, draft, config.engine_settings(False), port=0), python
            ),
        }
        for name, draft in (("serve with DFlash", drafter), ("serve without speculation", None))
    ]
    if not config.run_fidelity:
        steps += servers
    elif early:
        steps += servers + engine_and_reference("engine")
    else:
        steps += [engine("engine"), *servers, reference("engine")]
    return {"workdir": str(workdir), "time_limit_s": config.timeouts.total, "steps": steps}
