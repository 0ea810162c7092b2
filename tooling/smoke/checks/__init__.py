"""The smoke checks as pure functions: observations in, a verdict with evidence out.

Nothing here runs a process or touches the network, so each verdict can be tested on
captured observations. ``base`` holds the verdicts, the check ids and ``CheckResult``;
``lossless`` checks 1-3, ``cache`` checks 4 and 7, ``engine`` the in-process engine's and
the load's (5, 6, 8-10).
"""

from __future__ import annotations

from .base import (
    ACCEPTANCE,
    AUX_LAYERS,
    DRAFTER_WINDOWS,
    ERROR,
    FAIL,
    FIDELITY,
    FIRST_TOKENS,
    INFO,
    LOAD,
    LOSSLESS,
    ORDER,
    PASS,
    PENDING,
    PREFIX_CACHE,
    SKIP,
    SLOT_AUDIT,
    TITLES,
    WARM_CACHE,
    CheckResult,
    Verdict,
    error,
    first_differences,
    skipped,
)
from .cache import (
    PrefixObservation,
    check_prefix_cache,
    check_warm_cache,
    full_block_tokens,
    prefix_prompt_tokens,
)
from .engine import (
    check_acceptance,
    check_fidelity,
    check_first_tokens,
    check_load,
    check_slot_audit,
    fidelity_passes,
)
from .lossless import TieTolerance, check_aux_layers, check_lossless, check_windows

__all__ = [
    "ACCEPTANCE",
    "AUX_LAYERS",
    "DRAFTER_WINDOWS",
    "ERROR",
    "FAIL",
    "FIDELITY",
    "FIRST_TOKENS",
    "INFO",
    "LOAD",
    "LOSSLESS",
    "ORDER",
    "PASS",
    "PENDING",
    "PREFIX_CACHE",
    "SKIP",
    "SLOT_AUDIT",
    "TITLES",
    "WARM_CACHE",
    "CheckResult",
    "PrefixObservation",
    "TieTolerance",
    "Verdict",
    "check_acceptance",
    "check_aux_layers",
    "check_fidelity",
    "check_first_tokens",
    "check_load",
    "check_lossless",
    "check_prefix_cache",
    "check_slot_audit",
    "check_warm_cache",
    "check_windows",
    "error",
    "fidelity_passes",
    "first_differences",
    "full_block_tokens",
    "prefix_prompt_tokens",
    "skipped",
]
