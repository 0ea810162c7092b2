"""Recompute vLLM's DFlash proposals with the reference implementation and measure agreement.

For each proposal vLLM made (bonus token b at position p, k drafted tokens),
the reference drafts from the same state: the HF target's hidden states over
the context (prompt + generated tokens before p), reduced with
``dflash.model.extract_context_feature`` (which reads ``hidden_states[id + 1]``),
a block [b, mask, ..., mask] at positions p..p+k, one ``DFlashDraftModel``
forward without a cache, logits through the target's output head, argmax.
Agreement is counted per draft position.

The target runs once per request over its whole sequence: a causal model's
hidden state at position i does not depend on later tokens, so the context
features of every proposal are prefixes of that one pass.

Runs as ``python -m tooling.smoke.reference IN.json OUT.json`` in an
interpreter with torch, transformers and the reference ``dflash`` package.
"""

from __future__ import annotations

import sys
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
    from dflash.model import DFlashDraftModel
    from transformers import AutoModelForCausalLM

    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    target_model = AutoModelForCausalLM.from_pretrained(target, dtype=torch_dtype).to(device)
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


def context_features(target_model: Any, draft_model: Any, sequence: list[int]) -> Any:
    """[1, len(sequence), n*hidden]: the drafter's context feature at every position."""
    import torch
    from dflash.model import extract_context_feature

    device = next(target_model.parameters()).device
    ids = torch.tensor([sequence], dtype=torch.long, device=device)
    with torch.inference_mode():
        out = target_model(ids, output_hidden_states=True, use_cache=False)
    return extract_context_feature(list(out.hidden_states), draft_model.target_layer_ids)


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
    device = _pick_device(request.device)
    target_model, draft_model = load_pair(request.target, request.drafter, device, request.dtype)
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
        sequence = request.prompts[index] + request.outputs[index]
        features = context_features(target_model, draft_model, sequence)
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
            logits = reference_logits(target_model, draft_model, features, position, bonus, k)
            ours = [int(t) for t in logits.argmax(dim=-1).tolist()]
            gaps = tie_margins(logits, drafts)
            agreement.add(drafts, ours)
            # Where the margin is within tolerance the engine's token stands in for ours.
            tolerant.add(
                drafts,
                [
                    d if g <= request.tie_tolerance else o
                    for d, o, g in zip(drafts, ours, gaps, strict=True)
                ],
            )
            margins += [g for g in gaps if g > 0]
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
    return {
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
    }


def main(argv: list[str]) -> int:
    """Compare the proposals in ``argv[0]``; write the verdict to ``argv[1]``; 0 when it ran."""
    return serve(
        Path(argv[0]), Path(argv[1]), lambda request: compare(FidelityInput.from_json(request))
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
