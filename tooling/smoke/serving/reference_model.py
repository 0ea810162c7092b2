"""The reference package's side of the comparison: the pair loaded with transformers and
``dflash``, the HF target's hidden states and context features, the engine's recorded features,
the reference drafter's logits for one proposal, and the target's margins (runs inside the
SERVING interpreter, for ``reference``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


def pick_device(requested: str) -> str:
    import torch

    if requested != "auto":
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_target(target: str, device: str, dtype: str) -> Any:
    """The HF target in eval mode on ``device``, in ``dtype`` ("auto": its checkpoint's)."""
    import torch
    import transformers

    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    # The class the checkpoint names (Qwen3_5ForConditionalGeneration loads its
    # own weight layout; the Auto mapping would pick the text-only class).
    config = transformers.AutoConfig.from_pretrained(target)
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    cls = cls or transformers.AutoModelForCausalLM
    return cls.from_pretrained(target, dtype=torch_dtype).to(device).eval()


def load_pair(target: str, drafter: str, device: str, dtype: str) -> tuple[Any, Any]:
    """The HF target and the reference drafter, in eval mode on ``device``."""
    import torch
    from dflash.model import DFlashDraftModel

    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    logger.debug("load the reference pair %s, %s on %s (%s)", target, drafter, device, dtype)
    target_model = load_target(target, device, dtype)
    draft_model = DFlashDraftModel.from_pretrained(drafter, dtype=torch_dtype).to(device)
    return target_model, draft_model.eval()


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
    if ids.is_cuda:
        # The GPU runs the pass after the call returns: without the wait its time lands in
        # the phase that first reads a result (the features'), and the phases mislead.
        torch.cuda.synchronize(device)
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


def layer_sums(features: Any, hidden: list[Any]) -> tuple[list[list[float]], list[float]]:
    """Squared distance of each slice of ``features`` [n, S*H] (known positions) to each
    HF state of ``hidden`` ([1, >=n, H] each, on the same device), and each state's squared
    norm there. Summed on the states' device, not the host's CPU, which the engines starting
    beside a comparison keep busy compiling."""
    width = hidden[0].shape[-1]
    slices = features.shape[-1] // width
    n = features.shape[0]
    squared = [[0.0] * len(hidden) for _ in range(slices)]
    norms = []
    for layer, state in enumerate(hidden):
        ref = state[0, :n].float()
        norms.append(float((ref * ref).sum()))
        for s in range(slices):
            diff = features[:, s * width : (s + 1) * width].float() - ref
            squared[s][layer] = float((diff * diff).sum())
    return squared, norms
