"""The reference comparison's counts, which add up across shards, and the result they give.

Pure (stdlib only), so both sides import it: each reference child (``reference``)
fills a :class:`Tally` over its share of the prompts, and the runner, in the
toolchain's interpreter, adds the shards' tallies up (:meth:`Tally.merged`) and
turns the sum into the fidelity result the checks read (:meth:`Tally.result`).
Rates are computed only there, from the summed counts, so a sharded comparison
reports what one process would have.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

NEAR_TIE = 0.05
"""Logit margin under which a mismatch is reported as a near tie (bf16 noise scale)."""

MAX_EXAMPLES = 5


@dataclass
class Agreement:
    """Matches between vLLM's and the reference's drafts, per draft position."""

    matches: list[int] = field(default_factory=list)
    totals: list[int] = field(default_factory=list)

    def add(self, engine: list[int], reference: list[int]) -> None:
        self._widen(len(engine))
        for i, (a, b) in enumerate(zip(engine, reference, strict=True)):
            self.totals[i] += 1
            self.matches[i] += int(a == b)

    def absorb(self, other: Agreement) -> None:
        """Add ``other``'s counts to these."""
        self._widen(len(other.totals))
        for i, (m, t) in enumerate(zip(other.matches, other.totals, strict=True)):
            self.matches[i] += m
            self.totals[i] += t

    def _widen(self, positions: int) -> None:
        while len(self.totals) < positions:
            self.matches.append(0)
            self.totals.append(0)

    @property
    def rate(self) -> float | None:
        total = sum(self.totals)
        return sum(self.matches) / total if total else None

    def per_position(self) -> list[float]:
        return [m / t if t else 0.0 for m, t in zip(self.matches, self.totals, strict=True)]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Agreement:
        return cls(list(data["matches"]), list(data["totals"]))


@dataclass
class LayerDistances:
    """Squared distance of each captured feature slice to each HF hidden state, summed."""

    squared: list[list[float]] = field(default_factory=list)
    """[slice][layer]"""
    norms: list[float] = field(default_factory=list)
    """[layer]: the squared norm of the HF states over the same positions."""

    def absorb(self, squared: list[list[float]], norms: list[float]) -> None:
        """Add one sequence's (or one shard's) sums."""
        if not squared:
            return
        if not self.squared:
            self.squared = [[0.0] * len(norms) for _ in squared]
            self.norms = [0.0] * len(norms)
        for row, more in zip(self.squared, squared, strict=True):
            for layer, value in enumerate(more):
                row[layer] += value
        for layer, value in enumerate(norms):
            self.norms[layer] += value

    def relative(self) -> list[list[float]]:
        return [
            [
                (d / n) ** 0.5 if n > 0 else float("inf")
                for d, n in zip(row, self.norms, strict=True)
            ]
            for row in self.squared
        ]

    def nearest(self) -> list[int]:
        """The HF hidden-state index each slice is closest to."""
        return [min(range(len(row)), key=row.__getitem__) for row in self.relative()]


@dataclass
class Tally:
    """Everything one comparison counted, in a form that adds up across shards.

    Only exact agreement is counted here; every mismatch keeps its group, draft position
    and the reference's margin, so the tie tolerance is applied where the result is read
    (:func:`with_tolerance`): the runner may know a larger one (the plain noise the run
    measured) only after the comparison."""

    context: str
    tie_tolerance: float
    """The floor the child was given: ``result`` gates with it."""
    expected_layers: list[int] | None = None
    device: str = ""
    dtype: str = ""
    exact: Agreement = field(default_factory=Agreement)
    other: Agreement = field(default_factory=Agreement)
    """With the context the gate does not use (sequential prompts only)."""
    groups: dict[str, Agreement] = field(default_factory=dict)
    """Exact agreement per engine group (sequential, concurrent)."""
    distances: LayerDistances = field(default_factory=LayerDistances)
    mismatches: list[list[Any]] = field(default_factory=list)
    """[group, draft position, the reference's margin at the engine's draft] per mismatch,
    exact ties (0.0) included."""
    skipped: dict[str, int] = field(default_factory=lambda: {"no_context": 0, "bonus_mismatch": 0})
    engine_accepted: list[int] = field(default_factory=list)
    reference_accepted: list[int] = field(default_factory=list)
    examples: list[dict[str, Any]] = field(default_factory=list)
    divergences: list[dict[str, Any]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall seconds per phase; summed over shards, so the work done, not the wall time."""

    def record(
        self,
        group: str,
        drafts: list[int],
        ours: list[int],
        gaps: list[float],
        accepted: tuple[int, int],
    ) -> bool:
        """Count one proposal: the engine's drafts, the reference's, the reference's margin
        at each engine draft, and how many of each side greedy verification keeps.
        Returns whether the drafts differ."""
        self.exact.add(drafts, ours)
        self.groups.setdefault(group, Agreement()).add(drafts, ours)
        self.mismatches += [
            [group, i, g]
            for i, (d, o, g) in enumerate(zip(drafts, ours, gaps, strict=True))
            if d != o
        ]
        self.engine_accepted.append(accepted[0])
        self.reference_accepted.append(accepted[1])
        return drafts != ours

    @classmethod
    def merged(cls, tallies: list[Tally]) -> Tally:
        """The sum of the shards' tallies (the first one's settings)."""
        if not tallies:
            raise ValueError("no tallies to merge")
        first = tallies[0]
        total = cls(
            first.context, first.tie_tolerance, first.expected_layers, first.device, first.dtype
        )
        for t in tallies:
            total.exact.absorb(t.exact)
            total.other.absorb(t.other)
            for name, g in t.groups.items():
                total.groups.setdefault(name, Agreement()).absorb(g)
            total.distances.absorb(t.distances.squared, t.distances.norms)
            total.mismatches += t.mismatches
            for key, count in t.skipped.items():
                total.skipped[key] = total.skipped.get(key, 0) + count
            total.engine_accepted += t.engine_accepted
            total.reference_accepted += t.reference_accepted
            total.examples += t.examples
            total.divergences += t.divergences
            for phase, s in t.seconds.items():
                total.seconds[phase] = total.seconds.get(phase, 0.0) + s
        total.examples = total.examples[:MAX_EXAMPLES]
        return total

    def to_json(self) -> dict[str, Any]:
        return {
            "context": self.context,
            "tie_tolerance": self.tie_tolerance,
            "expected_layers": self.expected_layers,
            "device": self.device,
            "dtype": self.dtype,
            "exact": vars(self.exact),
            "other": vars(self.other),
            "groups": {name: vars(g) for name, g in self.groups.items()},
            "distances": vars(self.distances),
            "mismatches": self.mismatches,
            "skipped": self.skipped,
            "engine_accepted": self.engine_accepted,
            "reference_accepted": self.reference_accepted,
            "examples": self.examples,
            "divergences": self.divergences,
            "seconds": self.seconds,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Tally:
        return cls(
            context=data["context"],
            tie_tolerance=float(data["tie_tolerance"]),
            expected_layers=data["expected_layers"],
            device=data["device"],
            dtype=data["dtype"],
            exact=Agreement.from_json(data["exact"]),
            other=Agreement.from_json(data["other"]),
            groups={name: Agreement.from_json(g) for name, g in data["groups"].items()},
            distances=LayerDistances(data["distances"]["squared"], data["distances"]["norms"]),
            mismatches=[list(m) for m in data["mismatches"]],
            skipped=dict(data["skipped"]),
            engine_accepted=list(data["engine_accepted"]),
            reference_accepted=list(data["reference_accepted"]),
            examples=list(data["examples"]),
            divergences=list(data["divergences"]),
            seconds=dict(data["seconds"]),
        )

    def result(self) -> dict[str, Any]:
        """The fidelity result the checks and the report read, gated at ``tie_tolerance``
        (:func:`with_tolerance` gates it again at another)."""
        steps = len(self.engine_accepted)
        margins = [m[2] for m in self.mismatches]
        counts = {
            "context": self.context,
            "other_context_agreement": self.other.rate,
            "group_exact": {name: vars(g) for name, g in self.groups.items()},
            "group_exact_agreement": {name: g.rate for name, g in self.groups.items()},
            "group_tokens": {name: sum(g.totals) for name, g in self.groups.items()},
            "feature_layers": (
                {
                    "nearest": self.distances.nearest(),
                    "expected": self.expected_layers,
                    "relative_distance": self.distances.relative(),
                }
                if self.distances.squared
                else None
            ),
            "device": self.device,
            "dtype": self.dtype,
            "compared_proposals": steps,
            "compared_tokens": sum(self.exact.totals),
            "matches": self.exact.matches,
            "totals": self.exact.totals,
            "exact_agreement": self.exact.rate,
            "exact_per_position": self.exact.per_position(),
            "mismatches": len(margins),
            "near_ties": sum(1 for m in margins if m <= NEAR_TIE),
            "mismatch_margins": sorted(margins)[:50],
            "mismatch_detail": sorted(self.mismatches),
            "skipped": self.skipped,
            "engine_acceptance_length": 1 + sum(self.engine_accepted) / steps if steps else None,
            "reference_acceptance_length": (
                1 + sum(self.reference_accepted) / steps if steps else None
            ),
            "mismatch_examples": self.examples,
            "divergences": self.divergences,
            "seconds": self.seconds,
        }
        return with_tolerance(counts, self.tie_tolerance)


def with_tolerance(result: dict[str, Any], tolerance: float) -> dict[str, Any]:
    """``result`` gated at ``tolerance``: an engine draft whose reference logit is within it
    of the reference's best counts as agreeing (none with a tolerance of 0). Sets
    ``agreement``, ``per_position``, ``group_agreement`` and ``tie_tolerance``; the exact
    counts and every mismatch's margin, which it reads, stay as they are."""
    tolerated = [m for m in result["mismatch_detail"] if tolerance > 0 and m[2] <= tolerance]

    def gated(exact: dict[str, list[int]], group: str | None) -> Agreement:
        out = Agreement(list(exact["matches"]), list(exact["totals"]))
        for name, position, _ in tolerated:
            if group is None or name == group:
                out.matches[position] += 1
        return out

    overall = gated({"matches": result["matches"], "totals": result["totals"]}, None)
    return {
        **result,
        "agreement": overall.rate,
        "per_position": overall.per_position(),
        "group_agreement": {
            name: gated(exact, name).rate for name, exact in result["group_exact"].items()
        },
        "tie_tolerance": tolerance,
        "tolerated": len(tolerated),
    }


def shard_prompts(proposals_per_prompt: dict[int, int], shards: int) -> list[list[int]]:
    """Prompt indices per shard, at most ``shards`` non-empty lists with about equal
    proposal counts (largest first onto the least loaded), each in ascending order.

    A prompt stays whole within one shard: its target pass and recorded features
    serve all its proposals.
    """
    loads = [0] * max(shards, 1)
    assigned: list[list[int]] = [[] for _ in loads]
    for index, count in sorted(proposals_per_prompt.items(), key=lambda kv: (-kv[1], kv[0])):
        lightest = loads.index(min(loads))
        assigned[lightest].append(index)
        loads[lightest] += count
    return [sorted(a) for a in assigned if a]
