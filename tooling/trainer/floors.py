"""The recipe's two floors: a target decisive enough for a strict lossless check, and a drafter
the reference accepts enough of; each raises TrainingError, naming the figure, below it."""

from __future__ import annotations

import logging
import statistics
from typing import Any

from ..errors import TrainingError
from .common import Log
from .config import RecipeConfig
from .reference_accept import PlainGreedy

logger = logging.getLogger(__name__)


def target_floor(cfg: RecipeConfig, plain: PlainGreedy, log: Log) -> dict[str, Any]:
    """The target's median top-2 logit margin over its greedy choices on every prompt the
    acceptance table and the lossless check serve, and on the acceptance prompts alone.

    Both must reach ``min_target_margin``: the lossless check's prompts are the most
    decisive of several windows, so on the pooled figure they could carry a target that is
    not decisive on the prompts nobody chose. Raises TrainingError, naming the figure, below
    the floor (before any drafter time is spent); returns the figures."""
    margins = plain.all_margins()
    unchosen = [m for row in plain.margins for m in row]
    figures: dict[str, Any] = {
        "target_median_margin": statistics.median(margins),
        "target_margin_positions": len(margins),
        "target_positions_within_2e-7": sum(1 for m in margins if m <= 2**-7),
        "acceptance_median_margin": statistics.median(unchosen),
        "acceptance_margin_positions": len(unchosen),
        "min_target_margin": cfg.min_target_margin,
    }
    log(logger, f"target floor: {figures}")
    for key, what, count in (
        ("target_median_margin", "", len(margins)),
        ("acceptance_median_margin", " of the acceptance prompts", len(unchosen)),
    ):
        if figures[key] < cfg.min_target_margin:
            raise TrainingError(
                f"target: median top-2 logit margin {figures[key]:.3f} over {count} greedy "
                f"positions{what} is below the floor {cfg.min_target_margin}"
            )
    return figures


def drafter_floor(cfg: RecipeConfig, reference: dict[str, Any], log: Log) -> dict[str, Any]:
    """The reference's mean acceptance length at ``floor_speculative_tokens``. Raises
    TrainingError below ``min_acceptance_length``; returns the figures."""
    k = cfg.floor_speculative_tokens
    if not k:
        return {}
    length = reference["by_speculative_tokens"][str(k)]["mean_acceptance_length"]
    figures = {
        "floor_speculative_tokens": k,
        "acceptance_length": length,
        "min_acceptance_length": cfg.min_acceptance_length,
    }
    log(logger, f"drafter floor: {figures}")
    if length < cfg.min_acceptance_length:
        raise TrainingError(
            f"drafter: reference mean acceptance length {length:.3f} at K={k} is below the "
            f"floor {cfg.min_acceptance_length}"
        )
    return figures
