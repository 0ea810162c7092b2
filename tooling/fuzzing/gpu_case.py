"""The GPU fuzzer's cases: serving settings for an engine pair, workloads drawn step by step,
and the case file a finding is saved as.

Case N of campaign S is drawn from S and N alone: its settings first, then, once the DFlash
engine of those settings has reported its own figures (its attention block B and step
budget T), workload W from S, N, W and those figures. The drawing is the scheduler fuzzer's
(``tooling/probes/_schedfuzz.py``: its settings, its boundary lengths and its workloads),
narrowed to what the GPU pair serves (K in 1, 3, 5, 7, 15) and widened by what only a GPU has:
the CUDA-graph mode, and requests that ask for logprobs. On a vLLM with fix 33 the settings
also draw its ``join_hold_steps``, and on one with fix 22 whether the drafter's full CUDA
graphs (``dflash_full_cudagraphs``, on by default there) are turned off, last, so that every
other setting and workload of a campaign is drawn as on a vLLM without them.

Pure: the driver on the GPU host (``serving.gpu_run``) imports it to draw the same
workloads in the DFlash and the plain engine's processes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import FuzzCaseError
from ..fsutil import atomic_write_text
from ..probes._schedfuzz import JOIN_HOLDS
from ..probes._schedfuzz import draw_settings as draw_scheduler_settings
from ..probes._schedfuzz import draw_workload as draw_scheduler_workload
from ..probes._schedsim import STOP_TOKEN, Case, Req, Settings, prompt_tokens
from .cases import MAX_REQUESTS, CaseFile, check_fields, load_case_json
from .gpu_oracles import Evidence, ranked

logger = logging.getLogger(__name__)

FORMAT = "dflash-gpufuzz-case/1"
#: num_speculative_tokens the pair is served with; K = 5 for a verify width (6) that is no
#: power of two, which the drafter's 16-token block is not a multiple of.
KS = (1, 3, 5, 7, 15)
#: ``compilation_config.cudagraph_mode``; "eager" is ``enforce_eager`` (no graphs at all).
CUDAGRAPH_MODES = ("FULL_AND_PIECEWISE", "PIECEWISE", "FULL_DECODE_ONLY", "eager")
#: logprobs a request asks for: never fewer than two, so plain's top-2 margin is known at
#: every position the lossless oracle may have to excuse.
LOGPROBS = (2, 2, 2, 5, 20)
#: The oracles a finding is named by (``gpu_oracles`` says what each means).
KINDS = ("crash", "hang", "stall", "livelock", "lossless", "logprobs", "slot", "acceptance")
OUTCOME_PASS = "pass"
#: A GPU case file is larger than a scheduler case: its evidence holds the prompt and the
#: agreed output of every token difference in the workload.
MAX_BYTES = 1 << 24


@dataclass(frozen=True)
class GpuSettings:
    """What a user sets on ``vllm serve`` for both engines of a pair; None leaves vLLM's
    default. The DFlash engine adds the drafter with ``k`` drafts a step."""

    k: int
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    prefix_caching: bool | None = None
    async_scheduling: bool | None = None
    max_model_len: int = 4096
    long_prefill_token_threshold: int = 0
    kv_cache_dtype: str = "auto"
    gdn_state_dtype: str = "auto"
    """``mamba_ssm_cache_dtype``: "auto" (the model's) or "float32"."""
    cudagraph_mode: str = "FULL_AND_PIECEWISE"
    """One of ``CUDAGRAPH_MODES``."""
    join_hold_steps: int = 0
    """``join_hold_steps`` of the DFlash engine's speculative config (fix 33); 0: not set,
    as stock vLLM, which refuses the key, must be served."""
    drafter_full_graphs: bool | None = None
    """``dflash_full_cudagraphs`` of the DFlash engine's speculative config (fix 22's
    option); None: not set, the wheel's default (on where fix 22 is; stock vLLM refuses
    the key)."""


#: The settings a shrink moves a finding back toward, one at a time.
DEFAULTS = GpuSettings(k=1)


@dataclass(frozen=True)
class GpuReq(Req):
    """A workload's request as the scheduler fuzzer draws it, with the logprobs it asks for."""

    logprobs: int = 2


@dataclass(frozen=True)
class EngineFigures:
    """What a built DFlash engine reports that the workloads are drawn from."""

    block_size: int
    facts: dict[str, Any] = field(default_factory=dict)
    """"budget" (the step's token budget) and what else the engine said of itself."""


@dataclass(frozen=True)
class GpuCase:
    """One engine pair's settings and one workload: what a finding is saved as and what
    ``--replay`` serves again."""

    settings: GpuSettings
    requests: tuple[GpuReq, ...]

    def to_json(self) -> dict[str, Any]:
        settings = asdict(self.settings)
        # Unset, as in every case saved before fixes 33 and 22's options were drawn: such a
        # case reads the same anywhere.
        if not settings["join_hold_steps"]:
            del settings["join_hold_steps"]
        if settings["drafter_full_graphs"] is None:
            del settings["drafter_full_graphs"]
        return {"settings": settings, "requests": [asdict(r) for r in self.requests]}

    @classmethod
    def from_json(cls, data: Any, where: str = "case") -> GpuCase:
        """``data`` checked key by key (FuzzCaseError naming ``where`` and the key)."""
        if not isinstance(data, dict) or set(data) != {"settings", "requests"}:
            raise FuzzCaseError(f"{where}: a case holds 'settings' and 'requests'")
        check_fields(GpuSettings, data["settings"], f"{where}: settings")
        requests = data["requests"]
        if not isinstance(requests, list) or not 0 < len(requests) <= MAX_REQUESTS:
            raise FuzzCaseError(f"{where}: 'requests' must be a list of 1 to {MAX_REQUESTS}")
        for i, req in enumerate(requests):
            check_fields(GpuReq, req, f"{where}: requests[{i}]")
        settings = GpuSettings(**data["settings"])
        _check_values(settings, where)
        reqs = tuple(GpuReq(**r) for r in requests)
        for i, r in enumerate(reqs):
            if r.prompt_len < 1 or r.max_tokens < 1 or not 0 <= r.prefix_len <= r.prompt_len:
                raise FuzzCaseError(f"{where}: requests[{i}]: lengths out of range")
            if r.arrival < 0 or r.logprobs < 2:
                raise FuzzCaseError(f"{where}: requests[{i}]: 'arrival' or 'logprobs' too small")
        return cls(settings, reqs)


def scheduler_case_file(case: GpuCase, detail: str) -> CaseFile:
    """``case``'s scheduler side as the CPU fuzzer serves it (``tooling fuzz scheduler
    --replay``): the same settings with vLLM's own scheduler for the seed's geometry, the
    same requests, its KV cache the default. Saved as a control ("pass"): a replay that
    fails there has found the part of a GPU finding the CPU reproduces."""
    names = {f.name for f in dataclasses.fields(Settings)}
    settings = Settings(**{k: v for k, v in asdict(case.settings).items() if k in names})
    fields = {f.name for f in dataclasses.fields(Req)}
    reqs = tuple(Req(**{k: v for k, v in asdict(r).items() if k in fields}) for r in case.requests)
    return CaseFile(Case(settings, reqs).to_json(), OUTCOME_PASS, detail)


def _check_values(settings: GpuSettings, where: str) -> None:
    if settings.k not in KS:
        raise FuzzCaseError(f"{where}: settings: 'k' must be one of {KS}")
    if settings.cudagraph_mode not in CUDAGRAPH_MODES:
        raise FuzzCaseError(
            f"{where}: settings: 'cudagraph_mode' must be one of {', '.join(CUDAGRAPH_MODES)}"
        )
    if settings.max_model_len < 2:
        raise FuzzCaseError(f"{where}: settings: 'max_model_len' must be at least 2")
    if settings.join_hold_steps < 0:
        raise FuzzCaseError(f"{where}: settings: 'join_hold_steps' must be 0 or more")


def draw_settings(
    seed: int, number: int, max_k: int | None = None, hold: bool = False, graphs: bool = False
) -> GpuSettings:
    """Engine pair ``number`` of campaign ``seed``: the scheduler fuzzer's settings (K 0
    drawn again among ``KS``: the pair always drafts; a K past ``max_k``, the drafter's
    block, the largest of ``KS`` within it), a CUDA-graph mode, with ``hold`` (the vLLM
    under test has fix 33) a ``join_hold_steps``, and with ``graphs`` (it has fix 22's
    option, on by default) the option set false in half the draws."""
    rng = random.Random(f"gpu:{seed}:{number}")
    drawn = draw_scheduler_settings(rng)
    k = drawn.k or rng.choice(KS)
    names = [f.name for f in dataclasses.fields(GpuSettings) if hasattr(drawn, f.name)]
    values: dict[str, Any] = {name: getattr(drawn, name) for name in names}
    if max_k is not None and k > max_k:
        k = max([x for x in KS if x <= max_k], default=min(KS))
    values["k"] = k
    values["cudagraph_mode"] = rng.choice(CUDAGRAPH_MODES)
    # Drawn last: the draws before it are those of a vLLM without the option, so a seed
    # serves the same pairs on stock as on the fixed wheel, but for the hold.
    if hold:
        values["join_hold_steps"] = rng.choice(JOIN_HOLDS)
    if graphs and rng.random() < 0.5:
        values["drafter_full_graphs"] = False
    return GpuSettings(**values)


def draw_workload(
    seed: int, number: int, index: int, figures: EngineFigures, settings: GpuSettings
) -> tuple[GpuReq, ...]:
    """Workload ``index`` of engine pair ``number`` of campaign ``seed``, drawn from the
    DFlash engine's ``figures``: the scheduler fuzzer's requests (boundary prompt lengths,
    shared prefixes, arrivals, aborts, stop tokens, min_tokens, max_tokens up to
    max_model_len), each asking for logprobs."""
    rng = random.Random(f"gpu:{seed}:{number}:{index}")
    drawn = draw_scheduler_workload(rng, figures, settings)
    return tuple(GpuReq(**asdict(r), logprobs=rng.choice(LOGPROBS)) for r in drawn)


def step_bound(requests: tuple[Req, ...]) -> int:
    """Engine steps within which every request of the workload must have finished: the
    scheduler fuzzer's bound (every step that schedules anything computes a token; four
    times the workload's tokens leaves room for every preemption's recompute)."""
    work = sum(r.prompt_len + r.max_tokens for r in requests)
    last = max((r.arrival for r in requests), default=0)
    return last + 64 + 4 * work


def workload_number(requests: Sequence[Req]) -> int:
    """The number a workload's prompts are drawn from, read off its requests alone: the same
    workload drawn in a campaign, saved as a case and replayed (alone, or among others, or
    while it is shrunk) gets the same prompt tokens, where its place in the run it is served
    in would give it others."""
    text = json.dumps([asdict(r) for r in requests], sort_keys=True)
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) % 1_000_000


def prompt_ids(workload: int, index: int, req: Req, vocab: int) -> list[int]:
    """Request ``index`` of workload ``workload``'s prompt: shared prefixes the same in every
    workload (so they hit the cache across workloads too), its own tokens its own, every id
    inside ``vocab`` and clear of its low and top ids (reserved, mask, multimodal)."""
    low, top = min(100, vocab // 8), vocab - min(1000, vocab // 4)
    return [
        t if low <= t < top else low + t % (top - low)
        for t in prompt_tokens(workload * 1000 + index, req)
    ]


def stop_ids(prompt: list[int]) -> list[int]:
    """The stop tokens of a request that asks for some: the scheduler fuzzer's, and the
    prompt's last token, which greedy decoding often repeats."""
    return sorted({STOP_TOKEN, prompt[-1]})


@dataclass(frozen=True)
class GpuCaseFile:
    """A saved finding: the case, the oracle it failed, and on what."""

    case: GpuCase
    kind: str
    """One of ``KINDS``, or "pass" for a case kept as a control."""
    detail: str = ""
    found_on: str = ""
    """The vLLM it was found on (an interpreter, and the version it reported)."""
    excused: tuple[str, ...] = ()
    """Differences the lossless oracle excused in it (a near tie in plain's top-2)."""
    evidence: tuple[Evidence, ...] = ()
    """Each token difference of the case as saved (its shrunk form's, once shrunk), flagged
    or excused: what ``tooling fuzz referee`` settles. Empty in files saved before findings
    carried it."""

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "case": self.case.to_json(),
            "kind": self.kind,
            "detail": self.detail,
            "found_on": self.found_on,
            "excused": list(self.excused),
            "evidence": [e.to_json() for e in self.evidence],
        }


def read_gpu_case_file(path: Path) -> GpuCaseFile:
    """The case saved in ``path``; FuzzCaseError, one line naming the file and the key,
    when it is none."""
    data = load_case_json(path, FORMAT, KINDS, MAX_BYTES)
    excused = data.get("excused", [])
    if not isinstance(excused, list) or not all(isinstance(e, str) for e in excused):
        raise FuzzCaseError(f"{path}: 'excused' must be a list of strings")
    evidence = data.get("evidence", [])
    if not isinstance(evidence, list):
        raise FuzzCaseError(f"{path}: 'evidence' must be a list")
    return GpuCaseFile(
        case=GpuCase.from_json(data.get("case"), f"{path}: case"),
        kind=data["kind"],
        detail=data.get("detail", ""),
        found_on=data.get("found_on", ""),
        excused=tuple(excused),
        evidence=tuple(read_evidence(e, f"{path}: evidence[{i}]") for i, e in enumerate(evidence)),
    )


#: An evidence entry's keys, as ``Evidence.to_json`` writes them.
EVIDENCE_KEYS = ("request", "prompt", "agreed", "dflash", "plain", "plain_top", "excused")


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int and t >= 0 for t in value)


def read_evidence(data: Any, where: str) -> Evidence:
    """One evidence entry of a case file, checked key by key (FuzzCaseError naming
    ``where`` and the key)."""
    if not isinstance(data, dict) or set(data) != set(EVIDENCE_KEYS):
        raise FuzzCaseError(f"{where}: an entry holds {', '.join(map(repr, EVIDENCE_KEYS))}")
    if not isinstance(data["request"], str):
        raise FuzzCaseError(f"{where}: 'request' must be a string")
    if not _token_ids(data["prompt"]) or not data["prompt"]:
        raise FuzzCaseError(f"{where}: 'prompt' must be a list of token ids, not empty")
    if not _token_ids(data["agreed"]):
        raise FuzzCaseError(f"{where}: 'agreed' must be a list of token ids")
    for key in ("dflash", "plain"):
        if not _token_ids([data[key]]):
            raise FuzzCaseError(f"{where}: {key!r} must be a token id")
    if data["dflash"] == data["plain"]:
        raise FuzzCaseError(f"{where}: 'dflash' and 'plain' are the same token: no difference")
    top = data["plain_top"]
    if not isinstance(top, dict) or not all(
        k.isdigit() and type(v) in (int, float) for k, v in top.items()
    ):
        raise FuzzCaseError(f"{where}: 'plain_top' must map token ids to logprobs")
    if type(data["excused"]) is not bool:
        raise FuzzCaseError(f"{where}: 'excused' must be true or false")
    return Evidence(
        data["request"],
        tuple(data["prompt"]),
        tuple(data["agreed"]),
        data["dflash"],
        data["plain"],
        ranked(top),
        data["excused"],
    )


def write_gpu_case_file(path: Path, case_file: GpuCaseFile) -> None:
    """``case_file`` into ``path``, whole or not at all (a signal mid-write leaves the old)."""
    logger.debug("GPU case (%s) written to %s", case_file.kind, path)
    atomic_write_text(path, json.dumps(case_file.to_json(), indent=1) + "\n")
