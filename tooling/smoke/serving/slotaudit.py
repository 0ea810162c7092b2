"""The lookahead-slot audit: does DFlash's first pass write only into its request's own blocks?

DFlash's first drafter pass writes K+1 query slots per request (the bonus
token and K masks) at positions after the last verified one. The slot of a
position is ``block_table[row, pos // block_size] * block_size + pos %
block_size``; a position the scheduler reserved no block for reads a stale
block-table entry (production-path.md section 2). The audit compares every
query slot written with the blocks the scheduler's KV-cache manager assigned
to that request *for that step*, and counts slots outside them and slots
inside another live request's blocks.

Pure arithmetic here (tested on crafted block tables); the hooks that feed it
live in ``engine_run``.

Manager blocks and kernel blocks: a hybrid model's KV-cache manager may use
blocks larger than the attention kernel's (``blocks_per_kv_block`` kernel
blocks per manager block, ids ``b * m + j``), so a kernel slot ``s`` lies in
manager block ``s // manager_block_size`` either way; the audit works in
manager blocks.

A K-slot lookahead reservation falls short only where a row's last query slot
(position last+1+K) is the first slot of a manager block; a pass with no such
row cannot tell K reserved slots from K+1. Hybrid targets' manager blocks are
large (sized to the Mamba state), so short prompts seldom end there: the
audited run serves one prompt of ``boundary_prompt_length`` tokens, whose
first pass ends there by construction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PADDING_SLOT = -1
"""vLLM's slot for a padded token: written nowhere."""

NULL_BLOCK_ID = 0
"""The KV-cache manager's null block (a placeholder no request owns)."""


@dataclass
class SlotAudit:
    """Counts over every audited first pass."""

    passes: int = 0
    slots: int = 0
    outside: int = 0
    """Slots in a block the writing request does not own."""
    other_live: int = 0
    """Of ``outside``: slots in a block another live request owns."""
    null_block: int = 0
    """Of ``outside``: slots in the null block."""
    unknown_rows: int = 0
    """Rows whose request the scheduler's snapshot did not list (not audited)."""
    unaudited_passes: int = 0
    """First passes with no scheduler snapshot to audit against."""
    boundary_rows: int = 0
    """Audited rows whose last query slot is the first slot of a manager block: the only
    slot a K-slot reservation leaves without a block."""
    misplaced: int = 0
    """Slots in a block the writing request owns, but not the one its position falls in: a
    stale block-table entry that happens to name another of the request's blocks, whose
    keys and values it overwrites."""
    examples: list[dict[str, Any]] = field(default_factory=list)

    def add(self, other: SlotAudit) -> None:
        self.passes += other.passes
        self.slots += other.slots
        self.outside += other.outside
        self.other_live += other.other_live
        self.null_block += other.null_block
        self.unknown_rows += other.unknown_rows
        self.unaudited_passes += other.unaudited_passes
        self.boundary_rows += other.boundary_rows
        self.misplaced += other.misplaced
        room = 10 - len(self.examples)
        self.examples += other.examples[: max(room, 0)]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SlotAudit:
        return cls(**dict(data))


def audit_first_pass(
    slots: Sequence[int],
    positions: Sequence[int],
    row_requests: Sequence[str],
    owners: Mapping[str, Sequence[int]],
    block_size: int,
) -> SlotAudit:
    """Audit one first pass.

    ``slots``/``positions``: the query slot mapping and positions, ``len(row_requests)``
    rows of equal width, row-major. ``row_requests``: the request id of each row.
    ``owners``: request id -> the manager block ids it owns at this step (every
    live request), in the order of the positions they hold. ``block_size``: the manager's
    block size for the drafter's group. A slot must lie in the block its position falls
    in, ``owners[request][position // block_size]``.
    """
    audit = SlotAudit(passes=1)
    rows = len(row_requests)
    if rows == 0:
        return audit
    width = len(slots) // rows
    owned = {req: set(blocks) for req, blocks in owners.items()}
    for row, request in enumerate(row_requests):
        mine = owned.get(request)
        if mine is None:
            audit.unknown_rows += 1
            continue
        last = (row + 1) * width - 1
        if int(slots[last]) != PADDING_SLOT and int(positions[last]) % block_size == 0:
            audit.boundary_rows += 1
        ordered = owners[request]
        for i in range(row * width, (row + 1) * width):
            slot = int(slots[i])
            if slot == PADDING_SLOT:
                continue
            audit.slots += 1
            block = slot // block_size
            index = int(positions[i]) // block_size
            if index < len(ordered) and ordered[index] == block:
                continue
            others = []
            if block in mine:
                audit.misplaced += 1
            else:
                audit.outside += 1
                others = [r for r, blocks in owned.items() if r != request and block in blocks]
                if others:
                    audit.other_live += 1
                if block == NULL_BLOCK_ID:
                    audit.null_block += 1
            if len(audit.examples) < 10:
                audit.examples.append(
                    {
                        "request": request,
                        "position": int(positions[i]),
                        "slot": slot,
                        "block": block,
                        "expected": ordered[index] if index < len(ordered) else None,
                        "owned": list(ordered),
                        "owned_by": others,
                    }
                )
    return audit


def boundary_prompt_length(
    block_size: int, num_speculative_tokens: int, max_tokens: int, max_model_len: int
) -> int | None:
    """The shortest prompt whose first pass after its prefill ends on a block's first slot.

    A prompt of L tokens has its last verified position at L-1, so the first pass
    writes L .. L+K; L = m*B - K puts L+K on the first slot of block m (m the
    smallest with L >= 1). None when that prompt and ``max_tokens`` new tokens
    exceed ``max_model_len``.
    """
    blocks = num_speculative_tokens // block_size + 1
    length = blocks * block_size - num_speculative_tokens
    return length if length + max_tokens <= max_model_len else None


def verdict_counts(audit: SlotAudit) -> str:
    """One line: slots audited, outside, into another live request, into another of its own
    blocks (only when some were); rows at a boundary."""
    return (
        f"{audit.outside} of {audit.slots} first-pass query slots outside the request's blocks, "
        f"{audit.other_live} into another live request's block, "
        + (f"{audit.misplaced} in another of its own blocks, " if audit.misplaced else "")
        + f"{audit.boundary_rows} rows "
        f"ending on a block's first slot ({audit.passes} passes"
        + (
            f", {audit.unknown_rows} rows and {audit.unaudited_passes} passes unaudited)"
            if audit.unknown_rows or audit.unaudited_passes
            else ")"
        )
    )
