"""What a smoke run is asked to do: the model pair, the engine settings, the prompts, the gates.

Everything here is plain data (stdlib only), so the orchestrator can run on a
machine that has no torch and the children can be handed the same values as JSON.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import SmokeError

SLIDING = "sliding_attention"
FULL_WINDOW = (-1, -1)
"""FlashAttention's window tuple for a layer without a sliding window."""

# Short, distinct openings: no two share a 16-token block, so the prefix cache
# never serves one prompt from another and both servers compute every prompt
# with a full prefill (outputs are compared only between runs whose caching is
# the same).
LOSSLESS_PROMPTS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog because",
    "In the beginning of the year the committee decided to",
    "Speculative decoding drafts several tokens and then",
    "A recipe for bread needs flour, water, salt and",
    "def fibonacci(n):\n    if n < 2:\n        return",
    "Three reasons why the river flooded in spring were",
)

# The repeated prompt for the prefix-cache check: a text distinct from the
# prompts above, cut to exactly PREFIX_PROMPT_TOKENS tokens by the server's own
# tokenizer (repeated to two blocks and a tail on an engine with larger blocks) and
# sent as token ids.
PREFIX_PROMPT_TEXT = (
    "Once upon a time, in a village between two mountains, there lived a clockmaker who "
    "repaired every clock in the valley. Each morning she climbed to the tower, wound the "
    "great bell, and wrote down the hour it struck, the weather, and the names of the "
    "travellers who passed the gate. Over forty years the ledger grew into a history of "
    "the valley itself: floods and harvests, weddings and quarrels, the year the bridge "
    "fell and the year it was rebuilt in stone. "
)
PREFIX_PROMPT_TOKENS = 200
#: Where vLLM enlarges the blocks (a hybrid target), the prompt is two blocks and this tail.
PREFIX_TAIL_TOKENS = 16
#: Tokens each request of the prefix-cache check generates.
PREFIX_MAX_TOKENS = 8

# Texts for the in-process fidelity run, tokenized there and cut to FIDELITY_LENGTHS:
# longer than the tiny drafter's window (16), so a sliding layer that attends to
# everything shows up as a disagreement.
FIDELITY_TEXTS: tuple[str, ...] = (
    PREFIX_PROMPT_TEXT,
    "Large language models generate text one token at a time. A small draft model can "
    "propose several tokens at once, and the large model checks them in a single pass, "
    "keeping the longest prefix it agrees with. The output is exactly what the large "
    "model would have written alone, only faster when the drafts are good. ",
    "import os\nimport sys\n\n\ndef main(argv):\n    for name in sorted(os.listdir(argv[1])):\n"
    "        path = os.path.join(argv[1], name)\n        if os.path.isfile(path):\n"
    "            print(name, os.path.getsize(path))\n    return 0\n\n\nif __name__ == '__main__':\n"
    "    sys.exit(main(sys.argv))\n",
    "Tuesday's forecast: morning fog along the coast, clearing by noon; highs near twenty "
    "degrees inland, cooler by the water; light westerly winds; a chance of showers late "
    "in the evening over the hills, turning to steady rain after midnight. ",
)
FIDELITY_LENGTHS: tuple[int, ...] = (48, 56, 64, 72)


TINY_ARCHS = ("hybrid", "seed", "qwen3")

EXECUTOR_BACKENDS = ("mp", "ray")
RAY_VERSION = "2.48.0"
"""The Ray a run with ``--distributed-executor-backend ray`` is told to install, and the one
``ci/gpu/make-parts.sh RAY=1`` bundles: the version vLLM 0.20.1's CUDA test lock pins."""

REFERENCE_SHARDS = 4
"""The most reference children: its drafter passes are bound by one Python thread each,
so several split the work where the GPU holds that many copies of the pair."""


@dataclass(frozen=True)
class EngineSettings:
    """The engine flags every run shares (servers and the in-process run alike)."""

    num_speculative_tokens: int = 3
    speculative_options: tuple[tuple[str, Any], ...] = ()
    """More keys of every DFlash engine's ``speculative_config`` (the server's, the
    in-process runs'), as a user adds them to ``--speculative-config``: an option of this
    wheel's, such as ``dflash_full_cudagraphs``."""
    attention_backend: str = "FLASH_ATTN"
    max_model_len: int = 1024
    gpu_memory_utilization: float = 0.3
    seed: int = 0
    block_size: int | None = 16
    """None: vLLM's choice (a hybrid target's attention blocks follow the Mamba page)."""
    enforce_eager: bool = False
    """False: vLLM's default, compiled graphs with CUDA graphs (how operators run it)."""
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    disable_custom_all_reduce: bool = False
    """vLLM's ``--disable-custom-all-reduce`` for the servers (NCCL all-reduce instead).
    On 0.20.1, stock and patched alike, a hybrid target's DFlash server at TP=2 dies
    capturing CUDA graphs (an illegal memory access reported by the custom all-reduce);
    with this flag, or with ``--enforce-eager``, it serves."""
    distributed_executor_backend: str | None = None
    """vLLM's ``--distributed-executor-backend`` for the DFlash server: ``mp``, ``ray``, or
    None (vLLM's choice: ``mp`` when the GPUs are on this host). The plain server, the
    lossless checks' control, keeps vLLM's choice; the in-process engines run at TP=1 in the
    smoke's own child, with no executor of workers."""
    max_num_seqs: int = 8
    """Small, so the concurrent batches queue and requests finish out of order."""
    kv_cache_memory_bytes: int | None = None
    """A fixed KV-cache size instead of vLLM's memory profiling. For engines that
    share a GPU with others starting and stopping: vLLM 0.20.1 fails its start-up
    (an assertion in ``determine_available_memory``) when another process frees GPU
    memory while it profiles; with a fixed size it does not profile.
    ``gpu_memory_utilization`` is then only the free memory required at start-up."""


@dataclass(frozen=True)
class Timeouts:
    """The floors of each step's limit, in seconds; the plan (``plan.Deadlines``) raises them
    in proportion to the first engine's measured start, and ``total`` cuts every one."""

    total: float | None = None
    """The whole run; None: no overall limit beyond each step's own."""
    tiny: float = 180.0
    server_start: float = 300.0
    request: float = 60.0
    server_stop: float = 30.0
    engine_run: float = 300.0
    """An in-process child's work once its engine has started."""
    reference: float = 240.0
    load: float = 180.0
    """One concurrent burst against a server, all its requests."""


#: The share of a GPU's memory the plan fills; the rest is for what it cannot see.
USABLE_SHARE = 0.9


#: The most GPUs a plan is made for: the smoke serves on one host, whose GPUs one
#: interpreter sees.
MAX_GPUS = 64
#: The most memory a GPU is taken to have, in GiB (today's hold under 200).
MAX_GPU_GIB = 4096


@dataclass(frozen=True)
class GpuFacts:
    """The GPUs a run plans for: how many, and each one's total memory in bytes."""

    count: int
    total_bytes: int

    @property
    def usable_bytes(self) -> int:
        return int(self.total_bytes * USABLE_SHARE)

    @classmethod
    def parse(cls, text: str) -> GpuFacts:
        """``COUNTxGIB``, e.g. ``2x141``: plain decimal figures (no ``inf``, no exponent),
        bounded before a plan is made for them (a plan holds a board per GPU)."""
        match = re.fullmatch(r"\s*(\d{1,6})\s*x\s*(\d{1,7}(?:\.\d{1,6})?)\s*", text.lower())
        if not match:
            raise SmokeError(f"--gpus {text!r}: expected COUNTxGIB, e.g. 2x141")
        count, gib = int(match.group(1)), float(match.group(2))
        if not 1 <= count <= MAX_GPUS:
            raise SmokeError(f"--gpus {text!r}: COUNT must be 1 to {MAX_GPUS} (one host's GPUs)")
        if not 0 < gib <= MAX_GPU_GIB:
            raise SmokeError(f"--gpus {text!r}: GIB must be above 0 and at most {MAX_GPU_GIB}")
        return cls(count, int(gib * 2**30))


@dataclass(frozen=True)
class SmokeConfig:
    """One smoke run. ``target``/``drafter`` are local folders or hub ids; None with ``tiny``."""

    workdir: Path
    target: str | None = None
    drafter: str | None = None
    tiny: bool = False
    tiny_seed: int = 0
    engine: EngineSettings = field(default_factory=EngineSettings)
    timeouts: Timeouts = field(default_factory=Timeouts)
    python: str | None = None
    """Interpreter for ``vllm serve`` and the children; None means this one (sys.executable)."""
    max_tokens: int = 48
    fidelity_max_tokens: int = 40
    fidelity_gate: float = 0.99
    fidelity_tie_tolerance: float = 2**-7
    """Count a draft whose reference logit is this close to the best as agreeing (0: exact),
    or within twice the plain noise check 10 measured where that is larger.

    One bf16 ulp of a logit in [1, 2): compiled graphs fuse and round differently
    from the eager reference, so a correct drafter's rare mismatches sit one or two
    ulps from the best logit, while a defect's are far off. A wider target's logits sit
    higher, where an ulp is larger: its measured noise says by how much. The exact
    agreement stays in the report.
    """
    lossless_tie_tolerance: float = 2**-5
    """A first difference between the greedy completions with and without the drafter
    is no lost token when the drafter's run's token's logit is this close to the
    reference target's best, or within the plain noise check 10 measured where that is
    larger (a deep random-weight target's plain runs differ by more than a shallow one's).

    Spec decoding verifies K+1 tokens per step through other kernels than plain
    decoding (a hybrid target's GDN layers especially), and each path rounds its bf16
    logits, so a first difference between two correct paths is a near tie of the best
    logit (a few bf16 steps), on stock 0.20.1 as on this wheel; the check reports the
    spread of the logits there beside it. A lost or wrong token is not a near tie of
    the target's own logits.
    """
    reference_dtype: str = "auto"
    """dtype of the reference run: ``auto`` (the checkpoint's), ``float32``, ``bfloat16``."""
    min_acceptance_length: float | None = None
    run_fidelity: bool = True
    plot: bool = True
    expect: str = "fixed"
    """``fixed``: all checks must pass; ``stock``: lossless must pass and checks 2-5 fail."""
    tiny_arch: str = "hybrid"
    """``hybrid``: a Qwen3.5/3.6-family target (Gated DeltaNet + gated attention);
    ``seed``: the same with Qwen3.6-27B's depth, heads and vocabulary and z-lab's drafter
    layout, only the hidden width narrowed; ``qwen3``: the attention-only Qwen3 target."""
    tiny_hidden_size: int | None = None
    """The seed-shaped pair's hidden width (None: the generator's default)."""
    quick: bool = False
    """Only the checks one start of the engines answers: aux layers, windows, slot audit
    and the first tokens of K, K+1 and K+2-token prompts."""
    gpus: GpuFacts | None = None
    """The GPUs to plan for; None: those the serving interpreter sees."""
    fidelity_context: str = "auto"
    """Where the reference drafter takes its context features: ``target`` (the HF
    target's hidden states), ``engine`` (the ones vLLM handed its drafter), or
    ``auto`` (``engine`` for a hybrid target, ``target`` otherwise)."""
    load: bool = True
    """Concurrent bursts against both servers (check 9)."""
    audit: bool = True
    """The concurrent in-process batch with the lookahead-slot audit (check 8)."""
    warm_cache: bool = False
    """Check 7: another build compiles into the cache first (needs ``other_site``)."""
    other_site: str | None = None
    """A folder with another vLLM build (stock, or fix 1 skipped) for the warm-cache check."""
    overlap_engines: bool | None = None
    """None: the plan starts the engines side by side when they fit the GPUs at once (each
    with a fixed KV cache, since vLLM's memory profiling fails while a neighbour frees
    memory), else one after another; False: one after another (``--sequential``). The
    load figures are measured one server at a time either way."""

    def engine_settings(self, hybrid: bool) -> EngineSettings:
        """The flags every engine of the run gets: vLLM picks a hybrid target's block size."""
        if hybrid:
            return replace(self.engine, block_size=None)
        return self.engine

    def validate(self) -> None:
        """Raise SmokeError when the model choice is contradictory."""
        if self.tiny and (self.target or self.drafter):
            raise SmokeError("--tiny generates its own models: drop --target/--drafter")
        if not self.tiny and not (self.target and self.drafter):
            raise SmokeError("give both --target and --drafter, or --tiny")
        if self.expect not in ("fixed", "stock"):
            raise SmokeError(f"--expect {self.expect!r}: choose fixed or stock")
        if not 0.0 < self.fidelity_gate <= 1.0:
            raise SmokeError(f"fidelity gate {self.fidelity_gate} is not in (0, 1]")
        if self.tiny_arch not in TINY_ARCHS:
            raise SmokeError(f"--tiny-arch {self.tiny_arch!r}: choose {' or '.join(TINY_ARCHS)}")
        if self.tiny_hidden_size is not None and not (self.tiny and self.tiny_arch == "seed"):
            raise SmokeError("--tiny-hidden-size goes with --tiny --tiny-arch seed")
        backend = self.engine.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            choices = " or ".join(EXECUTOR_BACKENDS)
            raise SmokeError(f"--distributed-executor-backend {backend!r}: choose {choices}")
        if backend is not None and self.quick:
            raise SmokeError(
                "--distributed-executor-backend reaches the DFlash server, which --quick does not "
                "start: drop one of them"
            )
        if self.quick and self.warm_cache:
            raise SmokeError("--quick runs one start of the engines: drop --warm-cache")
        if self.fidelity_context not in ("auto", "target", "engine"):
            raise SmokeError(f"fidelity context {self.fidelity_context!r}: auto, target or engine")
        if self.warm_cache and not self.other_site:
            raise SmokeError(
                "the warm-cache check needs another build: --stock-site or --stock-wheel"
            )
        if self.warm_cache and not self.run_fidelity:
            raise SmokeError("the warm-cache check measures fidelity: drop --no-fidelity")
        if self.other_site and not Path(self.other_site, "vllm", "__init__.py").is_file():
            raise SmokeError(f"{self.other_site}: no vllm package in this folder")

    def context_source(self, hybrid: bool) -> str:
        """``target`` or ``engine``: where the gated fidelity takes its context features."""
        if self.fidelity_context != "auto":
            return self.fidelity_context
        return "engine" if hybrid else "target"


@dataclass(frozen=True)
class DrafterInfo:
    """What the smoke expects of a DFlash drafter, read from its config.json."""

    target_layer_ids: tuple[int, ...] | None
    layer_types: tuple[str, ...] | None
    sliding_window: int | None
    """The window transformers keeps: None unless ``use_sliding_window`` is true."""
    num_hidden_layers: int
    mask_token_id: int | None

    def expected_aux_layers(self) -> tuple[int, ...] | None:
        """The aux layer ids vLLM must capture: target_layer_ids + 1.

        The reference reads HF ``hidden_states[id + 1]`` (layer id's output); vLLM's
        aux index k is the residual stream entering layer k, i.e. ``hidden_states[k]``.
        """
        if self.target_layer_ids is None:
            return None
        return tuple(i + 1 for i in self.target_layer_ids)

    def expected_windows(self) -> list[tuple[int, int]]:
        """FlashAttention window per drafter layer as the reference would attend.

        A sliding layer with window w looks back w-1 tokens: (w-1, 0). A full layer,
        or a sliding one whose window transformers dropped, gets (-1, -1).
        """
        types = self.layer_types or ("full_attention",) * self.num_hidden_layers
        windows = []
        for layer_type in types:
            if layer_type == SLIDING and self.sliding_window:
                windows.append((self.sliding_window - 1, 0))
            else:
                windows.append(FULL_WINDOW)
        return windows

    def has_sliding_layers(self) -> bool:
        return any(w != FULL_WINDOW for w in self.expected_windows())


def drafter_info_from_config(config: dict[str, Any]) -> DrafterInfo:
    """The smoke's expectations from a drafter's config.json contents."""
    dflash = config.get("dflash_config") or {}
    ids = dflash.get("target_layer_ids", config.get("target_layer_ids"))
    layer_types = config.get("layer_types")
    # Mirror transformers' Qwen3Config, which both vLLM and the reference load
    # the drafter through: the window survives only with use_sliding_window.
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    mask = dflash.get("mask_token_id", config.get("mask_token_id"))
    return DrafterInfo(
        target_layer_ids=tuple(int(i) for i in ids) if ids is not None else None,
        layer_types=tuple(layer_types) if layer_types else None,
        sliding_window=int(window) if window else None,
        num_hidden_layers=int(config.get("num_hidden_layers", len(layer_types or ()))),
        mask_token_id=int(mask) if mask is not None else None,
    )


#: The Gated DeltaNet prefill kernel for hybrid targets. vLLM's default on sm90 is
#: FlashInfer's (JIT-compiled at first run), which needs flashinfer, a package the
#: offline bundle leaves out; the Triton/FLA kernel is vLLM's own, and the DFlash
#: fixes under test live in neither.
GDN_PREFILL_BACKEND = "triton"


@dataclass(frozen=True)
class TargetInfo:
    """What the smoke must know of the target to start it right."""

    hybrid: bool
    """Linear-attention (Mamba-like) layers beside attention: vLLM sizes its blocks."""
    multimodal: bool
    """A vision tower in the checkpoint: served with ``--language-model-only``."""

    @property
    def gdn_prefill_backend(self) -> str | None:
        return GDN_PREFILL_BACKEND if self.hybrid else None


def target_info_from_config(config: dict[str, Any]) -> TargetInfo:
    text = config.get("text_config") or config
    layer_types = text.get("layer_types") or ()
    return TargetInfo(
        hybrid=any(
            t != "full_attention" and "attention" in t and "sliding" not in t for t in layer_types
        ),
        multimodal="vision_config" in config,
    )
