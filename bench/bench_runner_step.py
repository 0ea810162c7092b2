"""The V1 model runner's CPU time a step up to the target's forward: DFlash at K against
no drafter, on a hybrid target, at several concurrencies, and where DFlash's extra goes.

A GPU host's profile of the trained hybrid pair at one request puts most of DFlash's step
in the runner's preprocessing while the GPU waits. That is CPU code, so it is driven here
on vLLM's real runner (``CPUModelRunner``: the GPU runner, its device buffers on the CPU)
and Scheduler, for the config ``vllm serve`` builds (``_schedsim``: an H200's defaults, the
speed run's ``max_num_seqs`` and ``max_model_len``) for a target of the trained pair's shape
(every fourth layer gated attention, the rest Gated DeltaNet): its KV cache grouped by
vLLM's own code, a metadata builder a group as ``initialize_kv_cache`` makes them
(FlashAttention for attention groups, the drafter's too; Gated DeltaNet for the others),
CUDA-graph mode FULL_AND_PIECEWISE resolved by the runner, so batches are padded and the
builders fill their graph buffers as on the GPU.

Each step the scheduler schedules and ``execute_model`` runs to the model's forward, which
raises (as in ``tooling.probes.accepted_state``); the sampled tokens then go to the
runner's ``_update_states_after_model_execute`` and ``_bookkeeping_sync`` and to the
scheduler. A DFlash request verifies K drafts, accepts ``ACCEPTED`` tokens (bonus included)
and gets K new drafts. Plain and DFlash steps run in turn. Figures are this process's CPU
time, the median over the timed steps, of ``execute_model`` and of the methods the GPU
host's profile names as regions; cProfile and an ATen dispatch counter (by the tree's line
issuing each operation: on a GPU a kernel launch or a trip through the dispatcher, dearer
than a CPU operation on a small tensor here) run over as many steps again.

Stood in for: the model's forward, the KV-cache tensors (the metadata reads none), the
slot-mapping kernel (recorded and counted: no compiled ops here) and the drafter's
attention set-up (its KV-cache group is named to it); the sampler and the drafter's
proposal do not run. On a GPU ``.item()``, ``.tolist()`` and host copies of device tensors
wait for it; here every tensor is on the CPU. Synchronous scheduling only: the
asynchronous path reads the previous step's tokens and drafts from the GPU.

Run (the probe interpreter, with the tree to measure on its path or given by --root):
  PYTHONPATH=build/work/vllm-0.20.1:. $(.venv/bin/tooling probe-env) \\
      bench/bench_runner_step.py [--k 15] [--steps 100] [--concurrent 1,16,64]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

PROMPT_LEN = 256
#: Tokens a verify step accepts a request, the bonus token included.
ACCEPTED = 4
#: The trained pair's target: 24 layers, every fourth gated attention.
TARGET_LAYERS = 24
#: As the trained pair's speed run serves it.
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 64
#: Tensor methods that wait for the GPU where their tensor is on it.
WAITS = ("item", "tolist", "cpu", "numpy", "nonzero")
#: The runner's methods timed apart, named as the GPU host's profile names their regions.
RUNNER_REGIONS = (
    ("_update_states", "runner: states"),
    ("_prepare_inputs", "runner: inputs"),
    ("_calc_spec_decode_metadata", "runner: inputs: spec decode metadata"),
    ("_fill_decode_draft_tokens", "runner: inputs: decode draft counts"),
    ("_determine_batch_execution_and_padding", "runner: dispatch"),
    ("_get_slot_mappings", "runner: slot mappings"),
    ("_build_attention_metadata", "runner: attention metadata"),
    ("_preprocess", "runner: model inputs"),
    ("_update_states_after_model_execute", "hybrid: accepted tokens"),
    ("_bookkeeping_sync", "runner: bookkeep"),
)
#: The metadata builders' methods timed apart, by builder class.
BUILDER_REGIONS = (
    ("GDNAttentionMetadataBuilder", "build", "gdn: metadata"),
    ("GDNAttentionMetadataBuilder", "update_block_table", "gdn: other groups"),
    ("FlashAttentionMetadataBuilder", "build", "flash-attn: metadata"),
)


#: The probed interpreter's environment, as ``tooling probe`` sets it.
ENV = (
    "CUDA_VISIBLE_DEVICES= HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 "
    "VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 VLLM_LOGGING_LEVEL=ERROR"
)


def _env(root: Path | None) -> None:
    for key, _, value in (item.partition("=") for item in ENV.split()):
        os.environ.setdefault(key, value)
    if root is not None:
        sys.path.insert(0, str(root.resolve()))
    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))


def trained_shape_pair(root: Path) -> None:
    """``_schedsim``'s seed pair under ``root``, cut to the trained pair's target depth."""
    from tooling.probes import _schedsim

    target, drafter, layer_types = _schedsim.seed_pair(root)
    layer_types = layer_types[:TARGET_LAYERS]
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(num_hidden_layers=TARGET_LAYERS, layer_types=layer_types)
    (target / "config.json").write_text(json.dumps(cfg))
    draft = json.loads((drafter / "config.json").read_text())
    draft["num_target_layers"] = TARGET_LAYERS
    draft["dflash_config"]["target_layer_ids"] = [1, 6, 11, 16, 21]
    (drafter / "config.json").write_text(json.dumps(draft))
    _schedsim._PAIRS[str(root)] = (target, drafter, layer_types)


class _Forward(Exception):
    """Raised by the model's forward in place of running it."""


@dataclass
class Served:
    """A hybrid target's V1 runner and scheduler, with or without DFlash, and its figures."""

    k: int
    config: Any
    scheduler: Any
    runner: Any
    groups: list[str]
    spent: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # this step
    steps: list[tuple[float, dict[str, float]]] = field(default_factory=list)  # execute, regions
    launches: int = 0  # Triton kernel launches (recorded) while ops were counted
    tokens: int = 0

    def timed(self, fn: Any, region: str) -> Any:
        """``fn``, its CPU time added to ``region``."""

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[region] += time.process_time() - t0

        return wrapper

    def time_regions(self) -> None:
        for name, region in RUNNER_REGIONS:
            if hasattr(self.runner, name):  # stock 0.20.1 lacks some
                setattr(self.runner, name, self.timed(getattr(self.runner, name), region))
        for (group,) in self.runner.attn_groups:
            builder = group.get_metadata_builder()
            for cls, name, region in BUILDER_REGIONS:
                if type(builder).__name__ == cls and hasattr(builder, name):
                    setattr(builder, name, self.timed(getattr(builder, name), region))


def build(k: int, root: Path) -> Served:
    """The runner and scheduler ``vllm serve`` would make for the pair under ``root``."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.worker.utils import AttentionGroup, prepare_kernel_block_sizes

    from tooling.probes import _harness
    from tooling.probes._schedsim import Engine, Settings, build_engine

    settings = Settings(
        k,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN,
        async_scheduling=False,
        kv_memory_factor=MAX_NUM_SEQS + 8.0,
    )
    engine = build_engine(settings, root)
    if not isinstance(engine, Engine):
        raise SystemExit(f"k={k}: the engine did not build: {engine.outcome} {engine.detail}")
    config, kv_config = engine.config, engine.scheduler.kv_cache_config
    # FULL_AND_PIECEWISE up to vLLM's default largest capture: max_num_seqs x 2 without
    # drafts, x (1 + K) with them, as the GPU host's engines logged.
    largest = MAX_NUM_SEQS * (1 + k) if k else MAX_NUM_SEQS * 2
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, largest + 1, 16)]
    with _harness.replaced(_harness, CAPTURE_SIZES=[n for n in sizes if n <= largest]):
        runner = _harness.graph_runner(config, "FULL_AND_PIECEWISE", kv_config)
    groups, names = [], []
    for gid, group in enumerate(kv_config.kv_cache_groups):
        mamba = isinstance(group.kv_cache_spec, MambaSpec)
        backend = GDNAttentionBackend if mamba else FlashAttentionBackend
        groups.append([AttentionGroup(backend, list(group.layer_names), group.kv_cache_spec, gid)])
        drafter = group.layer_names[0].startswith("draft_model.")
        names.append("gdn" if mamba else "drafter attn" if drafter else "attn")
        if drafter:
            # What the drafter's own initialize_attn_backend finds (it needs loaded layers).
            runner.drafter.kv_cache_gid = gid
    with set_current_vllm_config(config):
        runner.attn_groups = groups
        block_sizes = prepare_kernel_block_sizes(kv_config, groups)
        for (group,) in groups:
            group.create_metadata_builders(
                config, runner.device, block_sizes[group.kv_cache_group_id]
            )
        runner.calculate_reorder_batch_threshold()
        runner.may_reinitialize_input_batch(kv_config, block_sizes)

    def forward(**kwargs: Any) -> Any:
        raise _Forward()

    runner._model_forward = forward
    runner.model = forward
    served = Served(k, config, engine.scheduler, runner, names)
    served.time_regions()
    return served


def execute(served: Served, out: Any) -> float:
    """CPU seconds of ``execute_model`` for ``out``, up to the forward."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(served.config):
        t0 = time.process_time()
        try:
            served.runner.execute_model(out)
        except _Forward:
            return time.process_time() - t0
    raise SystemExit("execute_model returned before the model's forward")


def sampled(served: Served, out: Any) -> None:
    """The step's sampling handed on: to the runner's own accepted counts and bookkeeping,
    to the scheduler, and K new drafts a request."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.outputs import DraftTokenIds, SamplerOutput

    from tooling.probes import _harness

    runner, k = served.runner, served.k
    rows = list(runner.input_batch.req_ids)
    tokens = torch.full((len(rows), k + 1), -1, dtype=torch.int32)
    got: dict[str, list[int]] = {}
    for i, rid in enumerate(rows):
        request = served.scheduler.requests[rid]
        if request.num_computed_tokens + out.num_scheduled_tokens[rid] < request.num_tokens:
            got[rid] = []  # a prefill chunk short of its end samples nothing
            continue
        n = min(ACCEPTED, 1 + len(out.scheduled_spec_decode_tokens.get(rid, ())))
        tokens[i, :n] = torch.arange(1000 + i, 1000 + i + n)
        got[rid] = tokens[i, :n].tolist()
    with set_current_vllm_config(served.config):
        runner._update_states_after_model_execute(tokens, out)
        runner._bookkeeping_sync(
            out, SamplerOutput(tokens, None), None, torch.empty(0), out.total_num_scheduled_tokens
        )
    served.scheduler.update_from_output(out, _harness.model_outputs(got))
    if k:
        drafts = [[2000 + j for j in range(k)] for _ in rows]
        served.scheduler.update_draft_token_ids(DraftTokenIds(rows, drafts))


def step(served: Served, around: Any = None) -> Any:
    """One engine step; ``around`` (a context manager) wraps ``execute_model``."""
    served.spent = defaultdict(float)
    out = served.scheduler.schedule()
    with around or nullcontext():
        spent = execute(served, out)
    sampled(served, out)
    served.tokens = out.total_num_scheduled_tokens
    return spent, out


def steady(served: Served, concurrent: int) -> None:
    """``concurrent`` prompts of ``PROMPT_LEN`` tokens in, prefilled, and decoding with
    K drafts each (where there is a drafter)."""
    from tooling.probes._schedsim import Req, engine_request

    sched = served.scheduler
    for i in range(concurrent):
        req = Req(arrival=0, prompt_len=PROMPT_LEN, max_tokens=MAX_MODEL_LEN)
        sched.add_request(engine_request(i, req, None))
    for _ in range(10 * concurrent + 10):
        _, out = step(served)
        decoding = all(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running)
        drafted = len(out.scheduled_spec_decode_tokens) == concurrent or not served.k
        full = len(out.num_scheduled_tokens) == concurrent and not sched.waiting
        if full and decoding and drafted:
            return
    raise SystemExit(f"k={served.k}: {concurrent} requests did not reach steady decode")


class OpCounter:
    """Counts the ATen operations a step dispatches (on a GPU, each a kernel launch or at
    least a trip through the dispatcher), by the line of the vLLM tree that issued them."""

    def __init__(self, tree: str) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        self.tree, self.total = tree, 0
        self.by_line: Counter[tuple[str, int]] = Counter()
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                counter.count()
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def count(self) -> None:
        self.total += 1
        frame: FrameType | None = sys._getframe(2)
        while frame is not None and not frame.f_code.co_filename.startswith(self.tree):
            frame = frame.f_back
        if frame is not None:
            code = frame.f_code
            path = code.co_filename[len(self.tree) :].lstrip("/")
            self.by_line[(f"{path}({code.co_name})", frame.f_lineno)] += 1


@dataclass
class Row:
    concurrent: int
    groups: list[str]
    tokens_per_step: int
    execute_ms: float  # median CPU ms of execute_model up to the forward
    regions: dict[str, float]  # median CPU ms a step in each region
    ops: float  # ATen operations a step, to the forward
    launches: float  # Triton kernel launches a step, to the forward (recorded, not run)
    stats: Any
    op_lines: Counter[tuple[str, int]]


def measure(k: int, concurrent: int, steps: int, root: Path, tree: str) -> tuple[Row, Row]:
    """Plain and DFlash in steady decode at ``concurrent`` requests, then ``steps`` steps
    of each in turn timed, as many profiled, as many with their ATen operations counted."""
    import vllm.v1.worker.block_table as block_table

    from tooling.probes import _harness

    pair = [build(0, root), build(k, root)]
    counters = [OpCounter(tree) for _ in pair]
    profiles = [cProfile.Profile() for _ in pair]
    with _harness.recording(block_table, "_compute_slot_mapping_kernel") as kernels:
        for served in pair:
            steady(served, concurrent)
            for _ in range(5):
                step(served)
        for _ in range(steps):
            for served in pair:
                spent, _ = step(served)
                served.steps.append((spent, served.spent))
        for _ in range(steps):
            for served, profile in zip(pair, profiles, strict=True):
                step(served, profile)
        for _ in range(steps):
            for served, counter in zip(pair, counters, strict=True):
                before = len(kernels.calls)
                step(served, counter.mode)
                served.launches += len(kernels.calls) - before
    rows = []
    for served, counter, profile in zip(pair, counters, profiles, strict=True):
        limit = MAX_MODEL_LEN - 2 * (1 + served.k)
        if any(r.num_computed_tokens > limit for r in served.scheduler.running):
            raise SystemExit(f"k={served.k}: requests reached max_model_len; lower --steps")
        regions = dict.fromkeys(r for _, spent in served.steps for r in spent)
        median = {r: statistics.median(s[r] for _, s in served.steps) * 1e3 for r in regions}
        execute_ms = statistics.median(t for t, _ in served.steps) * 1e3
        ops, launches = counter.total / steps, served.launches / steps
        row = Row(concurrent, served.groups, served.tokens, execute_ms, median, ops, launches,
                  pstats.Stats(profile), counter.by_line)  # fmt: skip
        rows.append(row)
    return rows[0], rows[1]


def _short(key: tuple[str, int, str], tree: str) -> str:
    path, line, name = key
    path = path.removeprefix(tree).lstrip("/").rpartition("site-packages/")[2]
    return f"{path}:{line}({name})" if line else name


def extra(plain: Row, spec: Row, steps: int, top: int, tree: str) -> list[str]:
    """The functions whose cumulative time a step grows most from plain to DFlash."""
    p, s = plain.stats.stats, spec.stats.stats  # type: ignore[union-attr]
    rows = []
    for key, (_, calls, _, cum, _) in s.items():
        if key[0] == __file__:
            continue  # this script's own frames: the step and the regions' timers
        base = p.get(key, (0, 0, 0, 0.0, 0))
        rows.append((cum - base[3], key, calls, base[1], cum, base[3]))
    rows.sort(reverse=True)
    lines = ["| function | DFlash - plain ms/step | DFlash | plain | calls/step DFlash / plain |"]
    lines.append("|---|---|---|---|---|")
    for delta, key, calls, base_calls, cum, base_cum in rows[:top]:
        ms = " | ".join(f"{t / steps * 1e3:.3f}" for t in (delta, cum, base_cum))
        lines.append(
            f"| `{_short(key, tree)}` | {ms} | {calls / steps:g} / {base_calls / steps:g} |"
        )
    return lines


def host_waits(plain: Row, spec: Row, steps: int, tree: str) -> list[str]:
    """Calls that wait for the GPU where their tensor is on it, a step, by calling function."""
    found: dict[tuple[str, str], list[float]] = {}
    for which, row in enumerate((plain, spec)):
        for (path, _, name), (*_, callers) in row.stats.stats.items():
            method = name.split("'")[1] if path == "~" and "'" in name else ""
            if method in WAITS and "torch" in name:
                for caller, (calls, *_) in callers.items():
                    found.setdefault((method, _short(caller, tree)), [0, 0])[which] += calls
    out = ["| call | in | calls/step DFlash / plain |", "|---|---|---|"]
    for (method, caller), (p, s) in sorted(found.items(), key=lambda kv: -kv[1][1]):
        out.append(f"| `.{method}()` | `{caller}` | {s / steps:g} / {p / steps:g} |")
    return out


def step_table(by: dict[int, tuple[Row, Row]]) -> list[str]:
    """A step at each concurrency, plain / DFlash: its size, CPU ms to the forward (median)
    whole and in each region (a region includes those it calls), its operations."""
    out = ["| | " + " | ".join(f"{c} concurrent: plain / DFlash" for c in by) + " |"]
    out += ["|---|" + "---|" * len(by)]

    def row(name: str, cell: Any) -> None:
        out.append(
            f"| {name} | " + " | ".join(" / ".join(map(cell, pair)) for pair in by.values()) + " |"
        )

    row("tokens a step", lambda r: str(r.tokens_per_step))
    row("ATen ops a step", lambda r: f"{r.ops:g}")
    row("Triton launches a step", lambda r: f"{r.launches:g}")
    row("**execute_model to forward, ms**", lambda r: f"**{r.execute_ms:.3f}**")
    ratios = (f"{s.execute_ms / p.execute_ms:.2f}" for p, s in by.values())
    out.append("| DFlash / plain | " + " | ".join(ratios) + " |")
    seen = {r for pair in by.values() for row_ in pair for r in row_.regions}
    for name in [r for _, r in RUNNER_REGIONS] + [r for _, _, r in BUILDER_REGIONS]:
        if name in seen:
            row(name, lambda r, n=name: f"{r.regions[n]:.3f}" if n in r.regions else "-")
    return out


def extra_ops(plain: Row, spec: Row, steps: int, top: int) -> list[str]:
    """The tree's functions whose ATen operations a step grow most from plain to DFlash,
    with the lines that issue DFlash's."""
    funcs: dict[str, list[Counter[int]]] = {}
    for which, row in enumerate((plain, spec)):
        for (func, line), n in row.op_lines.items():
            funcs.setdefault(func, [Counter(), Counter()])[which][line] += n
    ranked = sorted(funcs.items(), key=lambda kv: kv[1][0].total() - kv[1][1].total())
    out = ["| function | ops/step DFlash - plain | DFlash | plain | DFlash's by line |"]
    out.append("|---|---|---|---|---|")
    for func, (p, s) in ranked[:top]:
        n_p, n_s = p.total() / steps, s.total() / steps
        lines = ", ".join(f"{line}: {n / steps:g}" for line, n in sorted(s.items()))
        out.append(f"| `{func}` | {n_s - n_p:g} | {n_s:g} | {n_p:g} | {lines} |")
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, help="the vLLM tree to measure (else sys.path's)")
    parser.add_argument("--k", type=int, default=15)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--concurrent", default="1,16,64")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--profile-at", type=int, help="concurrency to list functions at")
    args = parser.parse_args()
    _env(args.root)
    from tooling.probes import _harness
    from tooling.probes._schedsim import h200_platform

    _harness.install_cpu_platform()
    import vllm

    tree = str(Path(vllm.__file__).resolve().parents[1])
    levels = [int(c) for c in args.concurrent.split(",")]
    by: dict[int, tuple[Row, Row]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-runner-") as tmp, h200_platform():
        trained_shape_pair(Path(tmp))
        for c in levels:
            by[c] = measure(args.k, c, args.steps, Path(tmp), tree)
    plain, spec = by[levels[0]]
    print(f"vLLM tree: {tree}")
    print(f"KV-cache groups: plain {', '.join(plain.groups)}; DFlash {', '.join(spec.groups)}")
    print(f"K = {args.k}, {ACCEPTED} tokens accepted a step, median of {args.steps} steps\n")
    print("\n".join(step_table(by)))
    for c in [args.profile_at] if args.profile_at else levels:
        print(f"\nWhere DFlash's extra goes at {c} concurrent (cProfile, cumulative):\n")
        print("\n".join(extra(*by[c], args.steps, args.top, tree)))
        print(f"\nDFlash's extra ATen operations at {c} concurrent, by function:\n")
        print("\n".join(extra_ops(*by[c], args.steps, args.top)))
        print(f"\nCalls that wait for the GPU where their tensor is on it, at {c} concurrent:\n")
        print("\n".join(host_waits(*by[c], args.steps, tree)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
