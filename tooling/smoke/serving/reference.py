"""Recompute vLLM's DFlash proposals with the reference implementation and measure agreement.

For each proposal vLLM made (bonus token b at position p, k drafted tokens),
the reference drafts from the same state: the HF target's hidden states over
the context (prompt + generated tokens before p), reduced with
``dflash.model.extract_context_feature`` (which reads ``hidden_states[id + 1]``),
a block [b, mask, ..., mask] at positions p..p+k, one ``DFlashDraftModel``
forward without a cache, logits through the target's output head, argmax.
Agreement is counted per draft position.

The target runs at most once per request over its whole sequence: a causal
model's hidden state at position i does not depend on later tokens, so the
context features of every proposal are prefixes of that one pass.

Where the context features come from (``context``):
- ``target``: the HF target's hidden states. End to end: a wrong aux layer or a
  stale compiled graph shows up as disagreement. Right for an attention-only
  target, whose HF and vLLM kernels agree closely.
- ``engine``: the features vLLM's target actually handed its drafter (recorded
  by ``engine_run``). The comparison is then of the drafter alone. Right for a
  hybrid Gated-DeltaNet target: HF computes the linear-attention layers with
  other kernels than vLLM (torch or fla chunked forms against vLLM's Triton
  ones), so near ties of a random drafter would flip on target noise and the
  gate would measure the target's kernels, not the drafter.
In both cases the recorded features are also compared with every HF hidden
state (``feature_layers``): the HF layer each captured slice is nearest to is
the layer the engine really captured, which catches a wrong aux layer (or a
compiled graph that baked in another build's layers) whichever context gates
the drafts. Both agreements are reported; ``context`` says which one gates.

Runs as ``python -m tooling.smoke.serving.reference SETUP.json OUT.json`` in an
interpreter with torch, transformers and the reference ``dflash`` package: it
loads the models SETUP names, then reads one line from stdin, the path of its
work (a FidelityInput, perhaps one shard's prompts), and writes that work's
counts (``agreement.Tally``) to OUT. Loading first lets the runner start its
shards while the engine still runs (``tooling.smoke.reference_pool``).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...entry import entry_logging
from .agreement import MAX_EXAMPLES, Tally
from .child import serve
from .reference_model import (
    EngineFeatures,
    context_features,
    divergence_margins,
    layer_sums,
    load_pair,
    pick_device,
    reference_logits,
    target_hidden_states,
    tie_margins,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSetup:
    """What a reference child loads before its work arrives."""

    target: str
    drafter: str
    device: str = "auto"
    """``cuda`` when available, else ``cpu``; or a torch device name."""
    dtype: str = "auto"
    """``auto``: the checkpoint's own dtype (bf16 for the tiny pair, as vLLM runs it);
    or a torch dtype name such as ``float32``."""


@dataclass
class FidelityInput:
    """The engine run's record and how to compare it (the models are the ModelSetup's)."""

    prompts: list[list[int]]
    outputs: list[list[int]]
    proposals: list[dict[str, Any]]
    tie_tolerance: float = 0.0
    """Count an engine draft as agreeing when its reference logit is this close to the best."""
    context: str = "target"
    """Where the gated agreement takes its context features: ``target`` or ``engine``."""
    features_path: str | None = None
    """The engine's recorded context features (``engine_run``); needed for ``engine``."""
    expected_layers: list[int] | None = None
    """HF hidden-state index each feature slice should come from (target_layer_ids + 1)."""
    divergences: list[dict[str, Any]] = field(default_factory=list)
    """Where the servers' greedy completions first differ: ``context`` (token ids up to
    there) and ``tokens`` (with the drafter, without). The target's own margins there
    tell a near tie, which rounding in other kernels flips, from a lost token."""
    prompt_indices: list[int] | None = None
    """This shard's prompts (None: all); the runner splits the proposals by prompt."""


@dataclass
class PhaseTimes:
    """Wall seconds spent per phase of the comparison, reported so a slow step says why."""

    seconds: dict[str, float]

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - start


def accepted_length(drafts: list[int], sequence: list[int], position: int) -> int:
    """How many leading drafts greedy verification keeps (those equal to what followed)."""
    accepted = 0
    for i, token in enumerate(drafts):
        at = position + 1 + i
        if at >= len(sequence) or sequence[at] != token:
            break
        accepted += 1
    return accepted


@dataclass
class LoadedPair:
    """The models a reference child loaded (ModelSetup), and how long that took."""

    target: Any
    drafter: Any
    device: str
    seconds: float

    @classmethod
    def load(cls, setup: ModelSetup) -> LoadedPair:
        start = time.monotonic()
        device = pick_device(setup.device)
        target, drafter = load_pair(setup.target, setup.drafter, device, setup.dtype)
        return cls(target, drafter, device, time.monotonic() - start)


#: Made-up sequence lengths of the warm-up: Triton specialises an integer argument on its
#: divisibility by 16, so one of each kind.
WARM_UP_LENGTHS = (64, 67)


def warm_up(pair: LoadedPair) -> float:
    """One target pass and one drafter pass per ``WARM_UP_LENGTHS`` on made-up tokens, before
    the work arrives; returns the seconds. The first call of each compiles its kernels (on a
    GPU, a hybrid target's Gated DeltaNet is Triton's), which in a shard otherwise falls after
    the engine, on the run's critical path, while the shard waits for the engine anyway."""
    start = time.monotonic()
    target, drafter = pair.target, pair.drafter
    vocab = int(target.config.get_text_config().vocab_size)
    k = max(1, drafter.block_size - 1)
    for length in WARM_UP_LENGTHS:
        sequence = [(7 * i + 3) % vocab for i in range(length)]
        features = context_features(target, drafter, sequence)
        reference_logits(target, drafter, features, length - 1, sequence[-1], k)
    return time.monotonic() - start


def tally(
    pair: LoadedPair, request: FidelityInput, progress: Callable[[str], None] | None = None
) -> Tally:
    """Agreement of every usable proposal of the request's prompts (all, or its shard's),
    plus what each side's drafts would have had accepted, as counts that add up.
    ``progress`` hears one line per prompt done: how far, and the phases' seconds so far
    (a comparison that runs long says where its time goes before it ends)."""
    target_model, device = pair.target, pair.device
    counts = Tally(
        context=request.context,
        tie_tolerance=request.tie_tolerance,
        expected_layers=request.expected_layers,
        device=device,
        dtype=str(next(target_model.parameters()).dtype).removeprefix("torch."),
    )
    times = PhaseTimes(counts.seconds)
    with times.phase("features_file"):
        engine_features = (
            EngineFeatures.load(request.features_path) if request.features_path else None
        )
    if request.context == "engine" and engine_features is None:
        raise ValueError("context 'engine' needs the engine's recorded features")
    sequences = [p + o for p, o in zip(request.prompts, request.outputs, strict=True)]
    wanted = None if request.prompt_indices is None else set(request.prompt_indices)
    by_prompt: dict[int, list[dict[str, Any]]] = {}
    for proposal in request.proposals:
        index = int(proposal["prompt"])
        if wanted is None or index in wanted:
            by_prompt.setdefault(index, []).append(proposal)
    for done, (index, proposals) in enumerate(sorted(by_prompt.items()), 1):
        if progress is not None and done > 1:
            progress(_progress_line(done - 1, len(by_prompt), counts.seconds))
        if not 0 <= index < len(request.prompts):
            counts.skipped["no_context"] += len(proposals)
            continue
        _tally_prompt(pair, request, counts, times, index, proposals, sequences, engine_features)
    if progress is not None and by_prompt:
        progress(_progress_line(len(by_prompt), len(by_prompt), counts.seconds))
    with times.phase("divergences"):
        counts.divergences = divergence_margins(target_model, request.divergences)
    return counts


def _tally_prompt(
    pair: LoadedPair,
    request: FidelityInput,
    counts: Tally,
    times: PhaseTimes,
    index: int,
    proposals: list[dict[str, Any]],
    sequences: list[list[int]],
    engine_features: EngineFeatures | None,
) -> None:
    """Add one prompt's proposals to ``counts``."""
    target_model, draft_model, device = pair.target, pair.drafter, pair.device
    sequence = sequences[index]
    sequential = all(p.get("group", "sequential") == "sequential" for p in proposals)
    # The HF target pass gates with context "target"; otherwise it serves only the
    # sequential prompts' other-context figure and layer distances (a hybrid
    # target's torch GDN fallback made it a third of the step's time).
    hf_features = hidden = None
    if request.context == "target" or sequential:
        with times.phase("target"):
            hidden = target_hidden_states(target_model, sequence)
            from dflash.model import extract_context_feature

            hf_features = extract_context_feature(hidden, draft_model.target_layer_ids)
    with times.phase("features"):
        recorded = engine_features.sequence_features(index, sequences) if engine_features else None
        if recorded is not None:
            recorded = recorded.to(device=device)
    if recorded is not None:
        if hidden is not None:
            with times.phase("distances"):
                counts.distances.absorb(*layer_sums(recorded[0], hidden))
        recorded = recorded.to(dtype=target_model.dtype)
    gated_features = recorded if request.context == "engine" else hf_features
    # The agreement with the context the gate does not use is reported only, and
    # only for the sequential prompts: a second drafter pass per proposal would double
    # the comparison's time.
    other_features = hf_features if request.context == "engine" else recorded
    for proposal in proposals:
        position, bonus = int(proposal["position"]), int(proposal["bonus"])
        drafts = [int(t) for t in proposal["drafts"]]
        if position < 1 or position > len(sequence):
            # Drafted after the output was cut at max_tokens: context unknown.
            counts.skipped["no_context"] += 1
            continue
        if position < len(sequence) and sequence[position] != bonus:
            counts.skipped["bonus_mismatch"] += 1
            continue
        k = len(drafts)
        if gated_features is None or gated_features.shape[1] < position:
            counts.skipped["no_context"] += 1
            continue
        with times.phase("drafter"):
            logits = reference_logits(target_model, draft_model, gated_features, position, bonus, k)
            ours = [int(t) for t in logits.argmax(dim=-1).tolist()]
        group = str(proposal.get("group", "sequential"))
        other_known = other_features is not None and other_features.shape[1] >= position
        if group == "sequential" and other_known:
            with times.phase("other_context"):
                alt = reference_logits(
                    target_model, draft_model, other_features, position, bonus, k
                )
                counts.other.add(drafts, [int(t) for t in alt.argmax(dim=-1).tolist()])
        gaps = tie_margins(logits, drafts)
        accepted = (
            accepted_length(drafts, sequence, position),
            accepted_length(ours, sequence, position),
        )
        differs = counts.record(group, drafts, ours, gaps, accepted)
        if differs and len(counts.examples) < MAX_EXAMPLES:
            counts.examples.append(
                {
                    "prompt": index,
                    "position": position,
                    "engine": drafts,
                    "reference": ours,
                    "margins": gaps,
                }
            )


def _progress_line(done: int, total: int, seconds: dict[str, float]) -> str:
    phases = ", ".join(f"{name} {s:.1f}s" for name, s in seconds.items())
    return f"{done}/{total} prompts compared ({phases})"


def _say(line: str) -> None:
    """A line of the comparison's progress, in the child's log (its stderr)."""
    logger.info("%s", line)


def compare(setup: ModelSetup, request: FidelityInput) -> dict[str, Any]:
    """Load the pair and compare every proposal in one process: the fidelity result."""
    pair = LoadedPair.load(setup)
    counts = tally(pair, request)
    counts.seconds["load"] = pair.seconds
    return counts.result()


def _load_then_tally(setup: dict[str, Any]) -> dict[str, Any]:
    # The work arrives on stdin once the models are loaded: the runner starts its
    # shards while the engine still runs, so loading is off the critical path.
    pair = LoadedPair.load(ModelSetup(**setup))
    warm_s = warm_up(pair)
    _say(f"loaded in {pair.seconds:.1f}s, warmed up in {warm_s:.1f}s; waiting for the proposals")
    work = sys.stdin.readline().strip()
    if not work:
        raise ValueError("no work arrived on stdin (the run stopped before the comparison)")
    request = json.loads(Path(work).read_text(encoding="utf-8"))
    counts = tally(pair, FidelityInput(**request), _say)
    counts.seconds["load"] = pair.seconds
    counts.seconds["warm_up"] = warm_s
    # The servers' divergences come once the servers are observed, which the proposals
    # need not wait for: a second line, or none (stdin closed).
    more = sys.stdin.readline().strip()
    if more:
        divergences = json.loads(Path(more).read_text(encoding="utf-8"))
        with PhaseTimes(counts.seconds).phase("divergences"):
            counts.divergences += divergence_margins(pair.target, divergences)
        _say(f"{len(divergences)} divergences measured in {counts.seconds['divergences']:.1f}s")
    return {"tally": counts.to_json()}


def main(argv: list[str]) -> int:
    """Load the models named in ``argv[0]`` (a ModelSetup), then read from stdin the path
    of a FidelityInput and, on a second line if any, of a list of divergences, and write
    their Tally to ``argv[1]``; 0 when it ran."""
    with entry_logging():
        return serve(Path(argv[0]), Path(argv[1]), _load_then_tally)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
