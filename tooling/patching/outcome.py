"""What applying the series came to: each patch's status (``decide``, the pure rule, from the
three observations ``apply`` makes), its outcome, and the series' report as JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from ..errors import PatchConflictError
from ..probing import PRESENT


class PatchStatus(StrEnum):
    """What applying a patch came to. Strings underneath: reports and JSON carry the values."""

    APPLIED = "applied"
    ALREADY_APPLIED = "already-applied"
    SUPERSEDED = "superseded"
    NOT_NEEDED = "not-needed"
    """On a ported base, where the ledger says the defect's code path is gone."""
    CONFLICT = "conflict"
    SKIPPED = "skipped"
    NOT_ATTEMPTED = "not-attempted"


# The names the rest of the toolchain imports.
APPLIED = PatchStatus.APPLIED
ALREADY_APPLIED = PatchStatus.ALREADY_APPLIED
SUPERSEDED = PatchStatus.SUPERSEDED
NOT_NEEDED = PatchStatus.NOT_NEEDED
CONFLICT = PatchStatus.CONFLICT
SKIPPED = PatchStatus.SKIPPED
NOT_ATTEMPTED = PatchStatus.NOT_ATTEMPTED


def decide(forward_ok: bool, reverse_ok: bool, probe_status: str | None) -> PatchStatus:
    """The status of one patch from what was observed about the tree (pure).

    Behaviour outranks text: a base that already behaves as fixed is never
    patched again even if our hunks would still apply, since applying them
    would fix the fix (a second +1 on the layer ids).
    """
    if reverse_ok and not forward_ok:
        return ALREADY_APPLIED
    if probe_status == PRESENT:
        return SUPERSEDED
    if forward_ok:
        return APPLIED
    return CONFLICT


@dataclass
class PatchOutcome:
    patch_id: str
    patch_file: str
    sha256: str
    status: PatchStatus
    message: str
    method: str | None = None
    """"strict" or "3way" for applied patches."""
    commit: str | None = None
    conflicts: list[str] = field(default_factory=list)
    probe_before: dict[str, Any] | None = None
    probe_after: dict[str, Any] | None = None
    problem: str | None = None
    """Set when a patch went in but its probe does not read present afterwards."""

    @property
    def ok(self) -> bool:
        return self.status not in (CONFLICT, NOT_ATTEMPTED) and self.problem is None


@dataclass
class SeriesReport:
    base: str
    source: str
    upstream_identity: str
    series_digest: str
    work_dir: str
    baseline: str
    head: str
    outcomes: list[PatchOutcome]
    probe_python: str | None
    saved_work: str | None = None
    """Where a person's earlier tree at ``work_dir`` was moved, when there was one."""

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outcomes)

    def outcome(self, patch_id: str) -> PatchOutcome:
        return next(o for o in self.outcomes if o.patch_id == patch_id)

    def cached_probes(self) -> list[str]:
        """Which probe runs ("base", "patched") were answered from the probe cache."""
        runs = {
            "base": [o.probe_before for o in self.outcomes],
            "patched": [o.probe_after for o in self.outcomes],
        }
        return [run for run, found in runs.items() if any(r and r.get("cached") for r in found)]

    def raise_unless_ok(self) -> None:
        """PatchConflictError naming the first patch that did not go in, and how many more."""
        bad = [o for o in self.outcomes if not o.ok]
        if not bad:
            return
        first = bad[0]
        raise PatchConflictError(
            f"patch {first.patch_id} ({first.patch_file}): {first.problem or first.message}"
            + (f" (+{len(bad) - 1} more)" if len(bad) > 1 else "")
        )

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SeriesReport:
        data = {k: v for k, v in data.items() if k != "ok"}
        data["outcomes"] = [PatchOutcome(**o) for o in data["outcomes"]]
        return cls(**data)
