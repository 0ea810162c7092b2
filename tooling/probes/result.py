"""The probe verdict: the one data type both sides of the process boundary share."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

PRESENT = "present"
ABSENT = "absent"
UNKNOWN = "unknown"


@dataclass
class ProbeResult:
    probe: str
    status: str
    """present, absent or unknown."""
    evidence: str
    """One line a person reads: what vLLM did when asked."""
    form: str | None = None
    """How the tree implements the fix, where behaviour can tell (an API name, a KV layout)."""
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProbeResult:
        return cls(**data)
