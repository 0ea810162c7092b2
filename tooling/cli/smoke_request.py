"""The program ``tooling smoke`` runs for a request: the smoke run (``tooling.smoke``) or one of
the trained pairs' (``tooling.trained``), each after the same refusals."""

from __future__ import annotations

from collections.abc import Callable

from ..smoke.request import SmokeOutcome, SmokeRequest, check_request, smoke_run_requested

__all__ = ["SmokeOutcome", "SmokeRequest", "smoke_requested"]


def smoke_requested(
    request: SmokeRequest, notify: Callable[[str], None] | None = None
) -> SmokeOutcome:
    """Run ``request``; ``notify`` hears the smoke run's progress lines."""
    check_request(request)
    if request.trained or request.trained_hybrid:
        from ..trained.request import trained_requested

        return trained_requested(request)
    return smoke_run_requested(request, notify)
