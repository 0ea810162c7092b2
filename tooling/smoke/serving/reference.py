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
  target, whose HF and vLLM kernels agree closely (99.8% measured).
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

Runs as ``python -m tooling.smoke.serving.reference IN.json OUT.json`` in an
interpreter with torch, transformers and the reference ``dflash`` package.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .child import serve

NEAR_TIE = 0.05
"""Logit margin under which a mismatch is reported as a near tie (bf16 noise scale)."""


@dataclass
class FidelityInput:
    """The engine run's record plus where the models are and how to run the reference."""

    target: str
    drafter: str
    prompts: list[list[int]]
    outputs: list[list[int]]
    proposals: list[dict[str, Any]]
    device: str = "auto"
    """``cuda`` when available, else ``cpu``; or a torch device name."""
    tie_tolerance: float = 0.0
    """Count an engine draft as agreeing when its reference logit is this close to the best."""
    dtype: str = "auto"
    """``auto``: the checkpoint's own dtype (bf16 for the tiny pair, as vLLM runs it);
    or a torch dtype name such as ``float32``."""
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

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FidelityInput:
        return cls(**data)


@dataclass
class Agreement:
    """Matches between vLLM's and the reference's drafts, per draft position."""

    matches: list[int] = field(default_factory=list)
    totals: list[int] = field(default_factory=list)

    def add(self, engine: list[int], reference: list[int]) -> None:
        while len(self.totals) < len(engine):
            self.matches.append(0)
            self.totals.append(0)
        for i, (a, b) in enumerate(zip(engine, reference, strict=True)):
            self.totals[i] += 1
            self.matches[i] += int(a == b)

    @property
    def rate(self) -> float | None:
        total = sum(self.totals)
        return sum(self.matches) / total if total else None

    def per_position(self) -> list[float]:
        return [m / t if t else 0.0 for m, t in zip(self.matches, self.totals, strict=True)]


@dataclass
class PhaseTimes:
    """Wall seconds spent per phase of the comparison, reported so a slow step says why."""

    seconds: dict[str, float] = field(default_factory=dict)

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


def _pick_device(requested: str) -> str:
    import torch

    if requested != "auto":
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_pair(target: str, drafter: str, device: str, dtype: str) -> tuple[Any, Any]:
    """The HF target and the reference drafter, in eval mode on ``device``."""
    import torch
    import transformers
    from dflash.model import DFlashDraftModel

    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    # The class the checkpoint names (Qwen3_5ForConditionalGeneration loads its
    # own weight layout; the Auto mapping would pick the text-only class).
    config = transformers.AutoConfig.from_pretrained(target)
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    cls = cls or transformers.AutoModelForCausalLM
    target_model = cls.from_pretrained(target, dtype=torch_dtype).to(device)
    draft_model = DFlashDraftModel.from_pretrained(drafter, dtype=torch_dtype).to(device)
    return target_model.eval(), draft_model.eval()


def _embedding_scale(draft_model: Any) -> float:
    # The reference scales the block's embeddings by input_embedding_scale (1.0 unless set).
    config = draft_model.config
    dflash_config = getattr(config, "dflash_config", None) or {}
    default = getattr(config, "input_embedding_scale", 1.0)
    return float(dflash_config.get("input_embedding_scale", default))


def _output_head(target_model: Any) -> Any:
    # As the reference: the target's lm_head, else its output embeddings.
    head = getattr(target_model, "lm_head", None)
    return head if head is not None else target_model.get_output_embeddings()


def target_hidden_states(target_model: Any, sequence: list[int]) -> list[Any]:
    """The HF target's hidden states over ``sequence``: embeddings, then each layer's output."""
    import torch

    device = next(target_model.parameters()).device
    ids = torch.tensor([sequence], dtype=torch.long, device=device)
    with torch.inference_mode():
        out = target_model(ids, output_hidden_states=True, use_cache=False)
    return list(out.hidden_states)


def context_features(target_model: Any, draft_model: Any, sequence: list[int]) -> Any:
    """[1, len(sequence), n*hidden]: the drafter's context feature at every position."""
    from dflash.model import extract_context_feature

    hidden = target_hidden_states(target_model, sequence)
    return extract_context_feature(hidden, draft_model.target_layer_ids)


@dataclass
class EngineFeatures:
    """The context features vLLM handed its drafter, by prompt and position."""

    by_prompt: dict[int, dict[int, Any]]

    @classmethod
    def load(cls, path: str) -> EngineFeatures:
        import torch

        packed = torch.load(path, map_location="cpu")
        return cls(
            {
                int(prompt): dict(zip(positions, rows, strict=True))
                for prompt, (positions, rows) in packed.items()
            }
        )

    def sequence_features(self, index: int, sequences: list[list[int]]) -> Any | None:
        """[1, n, D] for sequence ``index``, positions 0..n-1; None if one is missing.

        A prompt served partly from the prefix cache never handed its drafter the
        cached positions; those come from another prompt with the same tokens up
        to that position (same tokens, same causal state).
        """
        import torch

        sequence = sequences[index]
        rows = []
        for position in range(len(sequence)):
            row = self.by_prompt.get(index, {}).get(position)
            if row is None:
                row = next(
                    (
                        self.by_prompt[j][position]
                        for j in self.by_prompt
                        if position in self.by_prompt[j]
                        and sequences[j][: position + 1] == sequence[: position + 1]
                    ),
                    None,
                )
            if row is None:
                # A proposal never reads past its bonus position; later gaps are cut.
                break
            rows.append(row)
        if not rows:
            return None
        return torch.stack(rows)[None]


@dataclass
class LayerDistances:
    """Squared distance of each captured feature slice to each HF hidden state, summed."""

    squared: list[list[float]] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)

    def add(self, features: Any, hidden: list[Any]) -> None:
        """``features`` [n, S*H] of known positions, ``hidden`` HF states [1, >=n, H] each."""
        width = hidden[0].shape[-1]
        slices = features.shape[-1] // width
        if not self.squared:
            self.squared = [[0.0] * len(hidden) for _ in range(slices)]
            self.norms = [0.0] * len(hidden)
        n = features.shape[0]
        for layer, state in enumerate(hidden):
            ref = state[0, :n].float().cpu()
            self.norms[layer] += float((ref * ref).sum())
            for s in range(slices):
                diff = features[:, s * width : (s + 1) * width].float() - ref
                self.squared[s][layer] += float((diff * diff).sum())

    def relative(self) -> list[list[float]]:
        return [
            [
                (d / n) ** 0.5 if n > 0 else float("inf")
                for d, n in zip(row, self.norms, strict=True)
            ]
            for row in self.squared
        ]

    def nearest(self) -> list[int]:
        """The HF hidden-state index each slice is closest to."""
        return [min(range(len(row)), key=row.__getitem__) for row in self.relative()]


def reference_logits(
    target_model: Any, draft_model: Any, features: Any, position: int, bonus: int, k: int
) -> Any:
    """[k, vocab] float32 logits of the reference's k drafts after ``bonus`` at ``position``.

    The context is ``features[:, :position]``: every token before the bonus.
    """
    import torch

    device = features.device
    block = torch.tensor([[bonus] + [draft_model.mask_token_id] * k], device=device)
    with torch.inference_mode():
        noise = target_model.get_input_embeddings()(block) * _embedding_scale(draft_model)
        positions = torch.arange(position + 1 + k, device=device)[None, :]
        hidden = draft_model(
            target_hidden=features[:, :position, :],
            noise_embedding=noise,
            position_ids=positions,
            past_key_values=None,
            use_cache=False,
        )[:, -k:, :]
        logits = draft_model.compute_logits(hidden, _output_head(target_model))
    return logits[0].float()


def divergence_margins(
    target_model: Any, divergences: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per divergence: how far below the target's best next-token logit each side's token is."""
    import torch

    device = next(target_model.parameters()).device
    margins = []
    for d in divergences:
        ids = torch.tensor([d["context"]], dtype=torch.long, device=device)
        with torch.inference_mode():
            logits = target_model(ids, use_cache=False).logits[0, -1:].float()
        spec_gap, plain_gap = tie_margins(logits.expand(2, -1), list(d["tokens"]))
        margins.append(
            {
                "spec_gap": spec_gap,
                "plain_gap": plain_gap,
                "argmax": int(logits[0].argmax()),
                "best": float(logits[0].max()),
                # How far apart the target's logits are there: a lost token is a draw
                # from this spread, a tie a small fraction of it.
                "spread": float(logits[0].std()),
            }
        )
    return margins


def tie_margins(logits: Any, tokens: list[int]) -> list[float]:
    """Per position: how far below the reference's best logit each given token's logit is.

    0.0 where the token is the reference's argmax; a small value marks a near tie
    that bf16 rounding on either side can flip.
    """
    best = logits.max(dim=-1).values
    chosen = logits[list(range(len(tokens))), tokens]
    return [float(m) for m in (best - chosen).tolist()]


def compare(request: FidelityInput) -> dict[str, Any]:
    """Agreement of every usable proposal, plus what each side's drafts would have had accepted."""
    import torch

    device = _pick_device(request.device)
    times = PhaseTimes()
    with times.phase("load"):
        target_model, draft_model = load_pair(
            request.target, request.drafter, device, request.dtype
        )
        engine_features = (
            EngineFeatures.load(request.features_path) if request.features_path else None
        )
    if request.context == "engine" and engine_features is None:
        raise ValueError("context 'engine' needs the engine's recorded features")
    sequences = [p + o for p, o in zip(request.prompts, request.outputs, strict=True)]
    distances = LayerDistances()
    other = Agreement()
    """The agreement with the context the gate does not use (reported only, and only
    for the sequential prompts: a second drafter pass per proposal doubled the
    comparison's time on the hybrid pair, 117 s on an H200)."""
    groups: dict[str, tuple[Agreement, Agreement]] = {}
    """Per engine group (sequential, concurrent): exact and gated agreement."""
    agreement = Agreement()
    tolerant = Agreement()
    margins: list[float] = []
    skipped: dict[str, int] = {"no_context": 0, "bonus_mismatch": 0}
    engine_accepted: list[int] = []
    reference_accepted: list[int] = []
    examples: list[dict[str, Any]] = []
    by_prompt: dict[int, list[dict[str, Any]]] = {}
    for proposal in request.proposals:
        by_prompt.setdefault(int(proposal["prompt"]), []).append(proposal)
    for index, proposals in sorted(by_prompt.items()):
        if not 0 <= index < len(request.prompts):
            skipped["no_context"] += len(proposals)
            continue
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
            recorded = (
                engine_features.sequence_features(index, sequences) if engine_features else None
            )
            if recorded is not None:
                if hidden is not None:
                    distances.add(recorded[0], hidden)
                recorded = recorded.to(device=device, dtype=target_model.dtype)
        gated_features = recorded if request.context == "engine" else hf_features
        other_features = hf_features if request.context == "engine" else recorded
        for proposal in proposals:
            position, bonus = int(proposal["position"]), int(proposal["bonus"])
            drafts = [int(t) for t in proposal["drafts"]]
            if position < 1 or position > len(sequence):
                # Drafted after the output was cut at max_tokens: context unknown.
                skipped["no_context"] += 1
                continue
            if position < len(sequence) and sequence[position] != bonus:
                skipped["bonus_mismatch"] += 1
                continue
            k = len(drafts)
            if gated_features is None or gated_features.shape[1] < position:
                skipped["no_context"] += 1
                continue
            with times.phase("drafter"):
                logits = reference_logits(
                    target_model, draft_model, gated_features, position, bonus, k
                )
                ours = [int(t) for t in logits.argmax(dim=-1).tolist()]
            group = str(proposal.get("group", "sequential"))
            other_known = other_features is not None and other_features.shape[1] >= position
            if group == "sequential" and other_known:
                with times.phase("other_context"):
                    alt = reference_logits(
                        target_model, draft_model, other_features, position, bonus, k
                    )
                    other.add(drafts, [int(t) for t in alt.argmax(dim=-1).tolist()])
            gaps = tie_margins(logits, drafts)
            # Where the margin is within tolerance the engine's token stands in for ours.
            tolerated = [
                d if g <= request.tie_tolerance else o
                for d, o, g in zip(drafts, ours, gaps, strict=True)
            ]
            exact_in_group, gated_in_group = groups.setdefault(group, (Agreement(), Agreement()))
            agreement.add(drafts, ours)
            exact_in_group.add(drafts, ours)
            tolerant.add(drafts, tolerated)
            gated_in_group.add(drafts, tolerated)
            # Every mismatch, exact ties (margin 0: bf16 logits equal, argmax picked
            # the other) included.
            margins += [g for d, o, g in zip(drafts, ours, gaps, strict=True) if d != o]
            engine_accepted.append(accepted_length(drafts, sequence, position))
            reference_accepted.append(accepted_length(ours, sequence, position))
            if drafts != ours and len(examples) < 5:
                examples.append(
                    {
                        "prompt": index,
                        "position": position,
                        "engine": drafts,
                        "reference": ours,
                        "margins": gaps,
                    }
                )
    steps = len(engine_accepted)
    gated = tolerant if request.tie_tolerance > 0 else agreement
    with times.phase("divergences"):
        divergences = divergence_margins(target_model, request.divergences)
    del torch
    return {
        "context": request.context,
        "other_context_agreement": other.rate,
        "group_agreement": {
            name: (gated_in if request.tie_tolerance > 0 else exact_in).rate
            for name, (exact_in, gated_in) in groups.items()
        },
        "group_exact_agreement": {name: exact_in.rate for name, (exact_in, _) in groups.items()},
        "group_tokens": {name: sum(g.totals) for name, (g, _) in groups.items()},
        "feature_layers": (
            {
                "nearest": distances.nearest(),
                "expected": request.expected_layers,
                "relative_distance": distances.relative(),
            }
            if distances.squared
            else None
        ),
        "device": device,
        "dtype": str(next(target_model.parameters()).dtype).removeprefix("torch."),
        "compared_proposals": steps,
        "compared_tokens": sum(agreement.totals),
        "matches": agreement.matches,
        "totals": agreement.totals,
        "agreement": gated.rate,
        "per_position": gated.per_position(),
        "exact_agreement": agreement.rate,
        "exact_per_position": agreement.per_position(),
        "tie_tolerance": request.tie_tolerance,
        "mismatches": len(margins),
        "near_ties": sum(1 for m in margins if m <= NEAR_TIE),
        "mismatch_margins": sorted(margins)[:50],
        "skipped": skipped,
        "engine_acceptance_length": 1 + sum(engine_accepted) / steps if steps else None,
        "reference_acceptance_length": 1 + sum(reference_accepted) / steps if steps else None,
        "mismatch_examples": examples,
        "divergences": divergences,
        "seconds": times.seconds,
    }


def main(argv: list[str]) -> int:
    """Compare the proposals in ``argv[0]``; write the verdict to ``argv[1]``; 0 when it ran."""
    return serve(
        Path(argv[0]), Path(argv[1]), lambda request: compare(FidelityInput.from_json(request))
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
