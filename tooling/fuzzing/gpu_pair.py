"""One engine pair of the GPU fuzzer: what it needs before it starts (a pair it can serve, an
interpreter that sees a GPU and imports vLLM), its two processes (``serving.gpu_run``,
DFlash and plain, at once on one GPU, or one after the other where it holds one), and the
oracles over what they recorded."""

from __future__ import annotations

import json
import logging
import subprocess
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import FuzzNoGpuError, FuzzPairError, SmokePairError, VllmNotFoundError
from ..paths import REPO_DIR
from ..procs import run as run_command
from ..procs import start_group, stop_group
from ..smoke.pair import read_pair
from .gpu_case import KS, GpuReq, GpuSettings, prompt_ids, workload_number
from .gpu_oracles import (
    Mode,
    Verdict,
    WorkloadRun,
    acceptance,
    crash,
    judge_workload,
    liveness,
    mean_acceptance_length,
    slot,
)

logger = logging.getLogger(__name__)

MODULE = "tooling.fuzzing.serving.gpu_run"
VET_MODULE = "tooling.fuzzing.serving.gpu_vet"
#: The vetting child's time: one import of vLLM and a config built a setting.
VET_TIMEOUT_S = 600.0
ROLES = ("dflash", "plain")
#: How often a pair's processes are looked at while they serve.
POLL_S = 1.0
#: Before a pair's processes are stopped, each engine ends the workload it is in this long
#: earlier (``gpu_run``'s ``cut_after``): room for the step in flight to return and the
#: record to be written, so that only a step that never returns reads as a hang.
CUT_MARGIN_S = 60.0
MIN_VOCAB = 64
#: What the interpreter is asked before a campaign: a GPU, where its vLLM is, and whether
#: that vLLM takes fix 33's ``join_hold_steps`` (as ``_schedfuzz.has_join_hold`` asks a
#: tree) and fix 22's ``dflash_full_cudagraphs``. A vLLM whose config cannot be imported is
#: taken to lack them: stock refuses the keys.
CHECK = (
    "import importlib.util, json\n"
    "try:\n"
    "    import torch\n"
    "    gpu = bool(torch.cuda.is_available())\n"
    "    why = '' if gpu else 'torch.cuda.is_available() is false'\n"
    "except ImportError as e:\n"
    "    gpu, why = False, f'cannot import torch ({e})'\n"
    "spec = importlib.util.find_spec('vllm')\n"
    "keys = {}\n"
    "if spec:\n"
    "    try:\n"
    "        from vllm.config import SpeculativeConfig\n"
    "        keys = getattr(SpeculativeConfig, '__dataclass_fields__', {})\n"
    "    except Exception:\n"
    "        pass\n"
    "where = spec.origin if spec else None\n"
    "print(json.dumps({'gpu': gpu, 'why': why, 'vllm': where,\n"
    "                  'join_hold': 'join_hold_steps' in keys,\n"
    "                  'drafter_graphs': 'dflash_full_cudagraphs' in keys}))\n"
)


@dataclass(frozen=True)
class GpuTarget:
    """The vLLM under test (an interpreter and the environment it runs in) and the pair."""

    python: Path
    pair: Path
    env: Mapping[str, str] = field(default_factory=dict)
    vocab_size: int = 248320
    cache_root: Path | None = None
    """Where each engine's ``VLLM_CACHE_ROOT`` is (its compile cache, reused by later
    pairs; kept out of the campaign's folder, which is brought back from a host); None:
    beside the pairs' folders."""

    @property
    def target(self) -> Path:
        return self.pair / "target"

    @property
    def drafter(self) -> Path:
        return self.pair / "drafter"

    def describe(self) -> str:
        return f"{self.python} on {self.pair}"


@dataclass(frozen=True)
class PairShape:
    """What the campaign must know of the pair: its vocabulary, and the most drafts a step
    its drafter takes (its block less the bonus token; None when its config does not say)."""

    vocab_size: int
    max_k: int | None = None


def check_pair(pair: Path) -> PairShape:
    """The shape of the pair in ``pair`` (target/ and drafter/); FuzzPairError, one line
    naming the folder or the file at fault, when it is not a pair the fuzzer can serve."""
    for role in ("target", "drafter"):
        if not (pair / role).is_dir():
            raise FuzzPairError(f"{pair}: no {role}/ folder: not a pair (target/ and drafter/)")
    try:
        facts = read_pair(str(pair / "target"), str(pair / "drafter"))
    except SmokePairError as e:
        raise FuzzPairError(e.message) from None
    if facts.target.vocab_size < MIN_VOCAB:
        raise FuzzPairError(
            f"{pair / 'target'}: a vocabulary of {facts.target.vocab_size}, under {MIN_VOCAB}: "
            "too few ids for prompts clear of the reserved ones"
        )
    block = facts.drafter.block_size
    max_k = block - 1 if block else None
    if max_k is not None and max_k < min(KS):
        raise FuzzPairError(f"{pair / 'drafter'}: a block of {block} drafts nothing")
    return PairShape(facts.target.vocab_size, max_k)


@dataclass(frozen=True)
class Interpreter:
    """What the interpreter of the vLLM under test answered before a campaign."""

    vllm: str
    """Where its vLLM is."""
    join_hold: bool = False
    """Its vLLM takes ``join_hold_steps`` in the speculative config (fix 33)."""
    drafter_graphs: bool = False
    """Its vLLM takes ``dflash_full_cudagraphs`` in the speculative config (fix 22)."""


def check_interpreter(python: Path, env: Mapping[str, str]) -> Interpreter:
    """Where ``python``'s vLLM is and whether it has fix 33's option; FuzzNoGpuError when it
    sees no GPU, VllmNotFoundError when it has no vLLM."""
    try:
        done = run_command([str(python), "-c", CHECK], env=env, timeout_s=300)
    except OSError as e:
        raise FuzzNoGpuError(f"{python}: cannot start ({e.strerror or e})") from None
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        tail = " ".join(done.stderr.split())[-200:]
        raise FuzzNoGpuError(f"{python}: cannot tell whether it sees a GPU: {tail}") from None
    if not answer["gpu"]:
        raise FuzzNoGpuError(f"{python}: no GPU ({answer['why']}): the GPU fuzzer needs one")
    if not answer["vllm"]:
        raise VllmNotFoundError(f"{python}: no vLLM to fuzz (vllm is not importable there)")
    return Interpreter(
        str(answer["vllm"]),
        answer.get("join_hold") is True,
        answer.get("drafter_graphs") is True,
    )


@dataclass
class PairRun:
    """What both processes of an engine pair recorded (``gpu_run``'s progress, or its result
    when it ended), and how long the pair held the GPU."""

    runs: dict[str, dict[str, Any]]
    seconds: float
    stopped: dict[str, bool] = field(default_factory=dict)
    """Per role: the process was stopped at the time limit (or by a signal)."""
    vocab_size: int | None = None
    """The target's vocabulary, which the prompts were drawn inside; None where unknown
    (then no difference keeps its evidence)."""


def _read(progress: Path, result: Path) -> dict[str, Any]:
    for path in (result, progress):
        try:
            data: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if data.get("ok") is False:
            return {"start_error": data.get("error", "the engine process failed"), "workloads": []}
        return data
    return {"start_error": "the engine process wrote nothing", "workloads": []}


@dataclass(frozen=True)
class _Launch:
    """What both engine processes of a pair are started with; ``start`` gives one role's."""

    target: GpuTarget
    settings: GpuSettings
    work: Path
    limit_s: float
    kv_cache_memory_bytes: int
    seed: int
    number: int
    workloads: int

    @property
    def figures(self) -> Path:
        return self.work / "figures.json"

    def files(self, role: str) -> tuple[Path, Path]:
        return self.work / f"{role}.in.json", self.work / f"{role}.out.json"

    def start(self, role: str, replay: list[tuple[GpuReq, ...]] | None) -> subprocess.Popen[bytes]:
        limit_s = self.limit_s
        request = {
            "role": role,
            "target": str(self.target.target),
            "drafter": str(self.target.drafter) if role == "dflash" else None,
            "settings": asdict(self.settings),
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "figures_file": str(self.figures),
            "progress": str(self.work / f"{role}.progress.json"),
            "seed": self.seed,
            "number": self.number,
            "workloads": 0 if replay else self.workloads,
            "replay": [[asdict(r) for r in w] for w in replay or []],
            "vocab_size": self.target.vocab_size,
            # Room for the last workload to end before the pair is stopped, which would
            # read as a hang.
            "seconds": max(limit_s - max(300.0, limit_s / 3), 30.0),
            "cut_after": max(limit_s - CUT_MARGIN_S, limit_s / 2),
            "figures_timeout_s": limit_s,
        }
        in_file, out_file = self.files(role)
        in_file.write_text(json.dumps(request))
        out_file.unlink(missing_ok=True)
        cache = self.target.cache_root or self.work.parent / "vllm-cache"
        env = {
            **self.target.env,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CACHE_ROOT": str(cache / role),
        }
        cmd = [str(self.target.python), "-m", MODULE, str(in_file), str(out_file)]
        log = self.work / f"{role}.log"
        return start_group(cmd, log=log, env=env, cwd=REPO_DIR, truncate_log=True)

    def read(self, role: str) -> dict[str, Any]:
        return _read(self.work / f"{role}.progress.json", self.files(role)[1])


def run_pair(
    target: GpuTarget,
    settings: GpuSettings,
    work: Path,
    limit_s: float,
    *,
    kv_cache_memory_bytes: int,
    seed: int = 0,
    number: int = 0,
    workloads: int = 0,
    replay: list[tuple[GpuReq, ...]] | None = None,
    one_at_a_time: bool = False,
) -> PairRun:
    """Both engines of ``settings`` over the workloads (``workloads`` drawn, or ``replay``),
    at once, each stopped after ``limit_s``; files and logs under ``work``. With
    ``one_at_a_time`` (a GPU that holds one engine only), the DFlash engine serves first,
    alone, and the plain engine then serves exactly the workloads DFlash was given."""
    work.mkdir(parents=True, exist_ok=True)
    launch = _Launch(
        target, settings, work, limit_s, kv_cache_memory_bytes, seed, number, workloads
    )
    launch.figures.unlink(missing_ok=True)
    started = time.monotonic()
    if one_at_a_time:
        runs, stopped = _one_at_a_time(launch, replay)
        return PairRun(runs, time.monotonic() - started, stopped, target.vocab_size)
    procs = {}
    try:
        for role in ROLES:
            procs[role] = launch.start(role, replay)
        stopped = wait_pair(procs, launch.figures, started + limit_s)
    finally:
        for proc in procs.values():
            stop_group(proc, grace_s=10.0)
    runs = {role: launch.read(role) for role in procs}
    return PairRun(runs, time.monotonic() - started, stopped, target.vocab_size)


def given_workloads(run: Mapping[str, Any]) -> list[tuple[GpuReq, ...]]:
    """The workloads an engine process was given, in order: those it recorded, then the one
    it was in when it ended (a hang or a crash, which the other engine is asked too)."""
    given = [tuple(GpuReq(**r) for r in w["requests"]) for w in run.get("workloads", [])]
    if run.get("current") is not None and run.get("current_requests") is not None:
        given.append(tuple(GpuReq(**r) for r in run["current_requests"]))
    return given


def _one_at_a_time(
    launch: _Launch, replay: list[tuple[GpuReq, ...]] | None
) -> tuple[dict[str, dict[str, Any]], dict[str, bool]]:
    """The DFlash engine alone until it ends (or ``limit_s``), then the plain engine alone
    over the workloads DFlash was given; none when DFlash was given none (refused, or it
    never started), as at once the plain engine is stopped then."""
    runs, stopped = {}, {}
    runs["dflash"], stopped["dflash"] = _alone(launch, "dflash", replay)
    given = given_workloads(runs["dflash"])
    if not given:
        logger.info("the DFlash engine served no workload: the plain engine is not started")
        return runs, stopped
    runs["plain"], stopped["plain"] = _alone(launch, "plain", given)
    return runs, stopped


def _alone(
    launch: _Launch, role: str, given: list[tuple[GpuReq, ...]] | None
) -> tuple[dict[str, Any], bool]:
    """One engine process of the pair over ``given``, alone on the GPU: what it recorded,
    and whether it was still running at ``limit_s`` (and so stopped)."""
    proc = launch.start(role, given)
    try:
        stopped = wait_pair({role: proc}, launch.figures, time.monotonic() + launch.limit_s)
    finally:
        stop_group(proc, grace_s=10.0)
    return launch.read(role), stopped[role]


def vet_settings(
    target: GpuTarget, settings: list[GpuSettings], work: Path, kv_cache_memory_bytes: int
) -> list[str | None] | None:
    """Each of ``settings``' refusal by the DFlash engine's vLLM config (``serving.gpu_vet``,
    no engine started), or None where it passes; None for them all when the vetting child
    itself failed (its log in ``work``), so that every setting is served as before."""
    work.mkdir(parents=True, exist_ok=True)
    in_file, out_file = work / "vet.in.json", work / "vet.out.json"
    in_file.write_text(
        json.dumps(
            {
                "target": str(target.target),
                "drafter": str(target.drafter),
                "settings": [asdict(s) for s in settings],
                "kv_cache_memory_bytes": kv_cache_memory_bytes,
                "vocab_size": target.vocab_size,
            }
        )
    )
    out_file.unlink(missing_ok=True)
    env = {**target.env, "VLLM_CACHE_ROOT": str(work / "vllm-cache-vet")}
    cmd = [str(target.python), "-m", VET_MODULE, str(in_file), str(out_file)]
    try:
        done = run_command(cmd, timeout_s=VET_TIMEOUT_S, env=env, cwd=REPO_DIR)
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.info("the settings could not be vetted (%s): each pair starts as drawn", e)
        return None
    (work / "vet.log").write_text(done.stdout + done.stderr)
    try:
        data = json.loads(out_file.read_text())
    except (OSError, ValueError):
        data = {}
    refused = data.get("refused")
    if not data.get("ok") or not isinstance(refused, list) or len(refused) != len(settings):
        logger.info("the settings could not be vetted (%s): each pair starts as drawn", work)
        return None
    return [r if isinstance(r, str) else None for r in refused]


def _dflash_failed(figures: Path) -> bool:
    try:
        return "failed" in json.loads(figures.read_text())
    except (OSError, ValueError):
        return False


def wait_pair(
    procs: Mapping[str, subprocess.Popen[bytes]], figures: Path, deadline: float
) -> dict[str, bool]:
    """Wait for the pair's processes until ``deadline``; by role, whether one was still
    running then (and so is stopped: a hang). Once the DFlash engine has failed to start
    (refused or crashed, in ``figures``), the plain engine has nothing to serve: it is
    stopped at once, not left to finish a start that costs minutes of the GPU."""
    while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
        plain = procs.get("plain")
        if plain is not None and plain.poll() is None and _dflash_failed(figures):
            logger.info("the DFlash engine did not start: the plain engine is stopped")
            stop_group(plain, grace_s=10.0)
        time.sleep(POLL_S)
    return {role: proc.poll() is None for role, proc in procs.items()}


@dataclass
class Judgement:
    """One engine pair judged: its failures, and its counts for the report."""

    verdicts: list[Verdict]
    refused: str | None = None
    served: int = 0
    """Workloads the DFlash engine finished (served or died in)."""
    requests_of: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    """Each workload's requests by index: those served, and one an engine was in when its
    process ended."""
    requests: int = 0
    excused: int = 0
    acceptance: float | None = None
    cut: int = 0
    """Workloads an engine ended at its time (its steps still returning): no hang."""


def with_prompts(runs: list[WorkloadRun], requests: list[dict[str, Any]], vocab: int) -> None:
    """Each request of ``runs`` given its prompt's token ids, drawn from the workload's
    ``requests`` as both engines drew them (``serving.gpu_run``): a difference's evidence
    then holds the whole context, and a referee needs neither the case nor the engines."""
    reqs = [GpuReq(**r) for r in requests]
    number = workload_number(reqs)
    for i, req in enumerate(reqs):
        served = [run.results[f"r{i}"] for run in runs if f"r{i}" in run.results]
        if served and not all(r.prompt for r in served):
            prompt = prompt_ids(number, i, req, vocab)
            for r in served:
                r.prompt = r.prompt or prompt


def judge_pair(pair: PairRun, mode: Mode) -> Judgement:
    """Every oracle over ``pair``: each workload both engines finished, a workload an
    engine was stopped in (``hang``), an engine that failed to start (``crash``), and the
    DFlash engine's acceptance over the pair."""
    d_data, p_data = pair.runs.get("dflash", {}), pair.runs.get("plain", {})
    refused = d_data.get("refused") or p_data.get("refused")
    if refused:
        return Judgement([], refused=refused)
    verdicts: list[Verdict] = []
    judged = Judgement(verdicts)
    for role, data in (("dflash", d_data), ("plain", p_data)):
        if data.get("current") is not None and data.get("current_requests") is not None:
            judged.requests_of[data["current"]] = data["current_requests"]
        if data.get("start_error"):
            verdicts.append(Verdict("crash", f"{role}: at start-up: {data['start_error']}", role))
        current = data.get("current")
        if current is not None and pair.stopped.get(role):
            what = f"{role}: a step of workload {current} never returned"
            verdicts.append(Verdict("hang", what, role, current))
        elif current is not None:
            # Ended in a workload without a Python exception: killed, or aborted by CUDA.
            what = f"{role}: the engine process ended in workload {current}"
            verdicts.append(Verdict("crash", what, role, current))
    d_runs = [WorkloadRun.from_json(w) for w in d_data.get("workloads", [])]
    p_runs = {w["index"]: WorkloadRun.from_json(w) for w in p_data.get("workloads", [])}
    for d, recorded in zip(d_runs, d_data.get("workloads", []), strict=True):
        judged.requests_of[d.index] = recorded["requests"]
        judged.served += 1
        p = p_runs.get(d.index)
        if pair.vocab_size is not None:
            with_prompts([d] if p is None else [d, p], recorded["requests"], pair.vocab_size)
        judged.requests += len(d.results)
        judged.cut += int(d.cut is not None or (p is not None and p.cut is not None))
        if p is None:  # the plain engine never served it: DFlash's own oracles only
            verdicts += crash(d, "dflash") + slot(d)
            verdicts += liveness(d, "dflash") if d.cut is None else []
            continue
        for v in judge_workload(d, p, mode):
            judged.excused += len(v.excused)
            if v.kind != "pass":
                verdicts.append(v)
    verdicts += acceptance(d_runs, mode)
    judged.acceptance = mean_acceptance_length(d_runs)
    return judged
