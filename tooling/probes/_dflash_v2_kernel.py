"""Fix 10 on the V2 runner (0.34.0): no DFlash query past max_model_len writes a KV slot of
its request's own context.

The V2 runner drafts at every step; the DFlash speculator's input kernel
(``_prepare_dflash_inputs_kernel``) places the bonus token and K masks at positions
last + 1 .. last + 1 + K. A position at or past max_model_len has no block of its own: its
block index is clamped into the request's last block (the block table is max_model_len
wide), and the slot it gets is one a valid earlier position of the request already holds.

The probe runs that real Triton kernel in Triton's interpreter on the CPU, in an
interpreter of its own (vLLM must import Triton with the interpreter on and no GPU), for one
request whose last valid position is max_model_len - K + 1 (K = 7, 16-token blocks, a
max_model_len of 64), and compares each query's slot with the slots of positions 0 .. last.
Fixed: no query slot is one of them (a query past the end writes nowhere).
"""

from __future__ import annotations

from typing import Any

from ._interpreted import NotInterpreted, run_interpreted

BLOCK = 16
MAX_MODEL_LEN = 64
K = 7
TABLE = [10, 11, 12, 13]
#: The request's last valid position: its first pass reaches max_model_len + 2.
LAST = MAX_MODEL_LEN - K + 1


def _slot(position: int) -> int:
    return TABLE[position // BLOCK] * BLOCK + position % BLOCK


def query_slots() -> list[int]:
    """The kernel's query slots for the probe's request (run where Triton interprets)."""
    import torch
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator

    queries = K + 1
    n = 64
    table = torch.tensor([TABLE], dtype=torch.int32)

    def zeros(size: int, dtype: Any, fill: int = 0) -> Any:
        return torch.full((size,), fill, dtype=dtype)

    i32, i64 = torch.int32, torch.int64
    slots = zeros(n, i64, -7)
    kernel = speculator._prepare_dflash_inputs_kernel
    pads = speculator._NUM_PAD_PROGRAMS
    kernel[(1 + pads, 1)](
        zeros(n, i32), zeros(n, i64), torch.zeros(n, dtype=torch.bool), zeros(4, i32),
        zeros(4, i32), slots, zeros(n, i64), zeros(n, i64), zeros(n, i32), zeros(n, i64),
        zeros(n, i32), torch.zeros(4), zeros(4, i64),
        # The target step: two context tokens, the last at LAST, none rejected.
        torch.tensor([LAST - 1, LAST], dtype=i64), torch.tensor([0, 2], dtype=i32),
        torch.tensor([0], dtype=i32), zeros(4, i64, 5), zeros(4, i32),
        torch.tensor([1], dtype=i32), torch.tensor([0], dtype=i32), torch.zeros(4),
        zeros(4, i64), table, table.stride(0), 99, BLOCK, queries, K, 4, n, MAX_MODEL_LEN,
        0, 1,
        SAMPLE_FROM_ANCHOR=False, PAD_SLOT_ID=-1, CP_SIZE=1, CP_INTERLEAVE=1,
        BLOCK_SIZE=128, NUM_PAD_PROGRAMS=pads,
    )  # fmt: skip
    return [int(s) for s in slots[:queries].tolist()]


def ask() -> dict[str, Any]:
    """``query_slots`` in a fresh interpreter with Triton's interpreter on; what it found."""
    try:
        slots = run_interpreted("_dflash_v2_kernel", "query_slots")
    except NotInterpreted as e:
        return {"error": f"the kernel did not run: {e}"}
    positions = list(range(LAST + 1, LAST + 2 + K))
    held = {_slot(p): p for p in range(LAST + 1)}
    overwritten = [[p, s, held[s]] for p, s in zip(positions, slots, strict=True) if s in held]
    return {"positions": positions, "slots": slots, "overwritten": overwritten}
