"""``tooling smoke --trained`` and ``--trained-hybrid`` as the command runs them: the wheel under
test installed and put first, then the trained pair's acceptance table or the hybrid pair's
checks."""

from __future__ import annotations

import logging

from ..smoke.request import SmokeOutcome, SmokeRequest, prepare_workdir
from ..smoke.site import parse_engines

logger = logging.getLogger(__name__)

#: Each engine process of ``--trained-hybrid`` (start, the checks, speed) ends within this,
#: unless --time-limit says otherwise.
TRAINED_ENGINE_LIMIT_S = 900.0


def trained_requested(request: SmokeRequest) -> SmokeOutcome:
    """Run a checked ``request`` (``smoke.request.check_request``) that asks for ``trained`` or
    ``trained_hybrid``."""
    workdir = prepare_workdir(request)
    logger.debug("the %s pair, in %s", "trained" if request.trained else "trained hybrid", workdir)
    if request.trained:
        from .measure import measure_trained

        measured = measure_trained(workdir, parse_engines(request.engines), request.cache_dir)
        failed = ", ".join(measured.failed)
        return SmokeOutcome(
            measured.data,
            measured.table,
            f"engines failed to run: {failed} (logs in {workdir})" if failed else None,
        )
    assert request.trained_hybrid
    from .measure import measure_trained_hybrid

    hybrid = measure_trained_hybrid(
        workdir,
        parse_engines(request.engines),
        request.cache_dir,
        request.config.timeouts.total or TRAINED_ENGINE_LIMIT_S,
    )
    return SmokeOutcome(
        hybrid.data,
        hybrid.text,
        None if hybrid.ok else f"the trained hybrid pair's checks failed (see {workdir})",
    )
