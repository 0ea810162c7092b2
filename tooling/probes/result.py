"""The probe verdict: the one data type both sides of the process boundary share."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


class ProbeStatus(StrEnum):
    """A probe's answer. Strings underneath: JSON and text output are the values."""

    PRESENT = "present"
    ABSENT = "absent"
    UNKNOWN = "unknown"


# The names the probes and verify import.
PRESENT = ProbeStatus.PRESENT
ABSENT = ProbeStatus.ABSENT
UNKNOWN = ProbeStatus.UNKNOWN


@dataclass
class ProbeResult:
    probe: str
    status: ProbeStatus
    evidence: str
    """One line a person reads: what vLLM did when asked."""
    form: str | None = None
    """How the tree implements the fix, where behaviour can tell (an API name, a KV layout)."""
    details: dict[str, Any] = field(default_factory=dict)
    cached: bool = False
    """Answered from the toolchain's cache of earlier runs (``tooling.probing.cache``), not by
    a probe run of its own; never set inside the probed interpreter."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProbeResult:
        return cls(**{**data, "status": ProbeStatus(data["status"])})
