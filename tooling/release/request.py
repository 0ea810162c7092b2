"""What ``tooling bundle`` was asked for, carried out: the options turned into a
:class:`~tooling.release.bundle_plan.BundleConfig` (defaults from the base), then the lock alone
or the whole bundle; the command's one entry.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..building.build import single_wheel
from ..fetching.bases import Base
from . import bundle, bundle_plan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BundleRequest:
    wheel: Path | None
    """The wheel to ship; None: the one vllm-*.whl in ``dist_dir``."""
    dist_dir: Path
    out_dir: Path
    base: Base
    """Whose release date cuts the resolution unless ``exclude_newer`` is given."""
    index_url: str
    download_dir: Path
    """Where wheels are downloaded and kept between runs."""
    exclude_newer: str | None = None
    python_version: str = bundle_plan.DEFAULT_PYTHON_VERSION
    platform: str = bundle_plan.DEFAULT_PLATFORM
    extras: tuple[str, ...] = ()
    """Wheels added without their dependencies; empty: bundle_plan.DEFAULT_EXTRAS."""
    exclude_present: Path | None = None
    split: str | None = None
    """Largest part, e.g. ``60M``; None: no split."""
    lock_only: Path | None = None
    """Only resolve, and write the lock here."""
    progress: bool = True
    offline: bool = False
    """--offline: resolved from uv's cache, the wheels from ``download_dir``; no network."""

    def config(self) -> bundle_plan.BundleConfig:
        """The bundle this request describes, every default filled in."""
        wheel = self.wheel or single_wheel(self.dist_dir)
        return bundle_plan.BundleConfig(
            wheel=wheel.resolve(),
            out_dir=self.out_dir.resolve(),
            exclude_newer=self.exclude_newer or bundle_plan.exclude_newer_for(self.base),
            python_version=self.python_version,
            platform=self.platform,
            extras=self.extras or bundle_plan.DEFAULT_EXTRAS,
            excludes=self.base.bundle_excludes,
            exclude_present=self.exclude_present,
            split_bytes=bundle_plan.parse_size(self.split) if self.split else None,
            index_url=self.index_url,
            download_dir=self.download_dir,
            progress=self.progress,
            offline=self.offline,
        )


@dataclass(frozen=True)
class BundleOutcome:
    config: bundle_plan.BundleConfig
    plan: bundle_plan.BundlePlan
    result: bundle.BundleResult | None
    """None when only the lock was written."""
    lock: Path | None

    def to_json(self) -> dict[str, Any]:
        if self.result is None:
            return {"ok": True, "lock": str(self.lock), "plan": self.plan.to_json()}
        return {"ok": True, "plan": self.plan.to_json(), "result": self.result.to_json()}


def bundle_requested(request: BundleRequest) -> BundleOutcome:
    """The lock alone (``lock_only``) or the whole bundle."""
    config = request.config()
    logger.debug(
        "bundle %s for %s, Python %s", config.wheel, config.platform, config.python_version
    )
    if request.lock_only is not None:
        plan = bundle.lock_bundle(config, request.lock_only)
        return BundleOutcome(config, plan, None, request.lock_only)
    plan, result = bundle.make_bundle(config)
    return BundleOutcome(config, plan, result, None)
