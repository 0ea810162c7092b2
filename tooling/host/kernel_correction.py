"""Patch 36's kernel against the tensor operations it replaces, compiled as vLLM 0.20.1
compiles them, on the GPU: each request's computed tokens corrected after a batch change,
with asynchronous scheduling.

A request's row may read the previous values at an index another row writes (requests move
in the persistent batch), so the one program must land every read before any write. The
interpreter runs a program's operations in order; a compiled kernel is free to reorder
memory operations it does not see alias. Here the kernel runs compiled, on batches where
rows move, new rows come in and finished rows leave, and every value must equal what the
tensor operations give: these are token counts, so nothing is close enough but equal.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

from .kernel_timing import drain, host_us

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchChange:
    name: str
    max_num_reqs: int
    """The runner's buffers' length: the kernel's block."""
    num_reqs: int
    prev_num_reqs: int
    new_rows: int
    """Rows of this step with no row in the previous one (prev_positions -1)."""


#: One request (the bar's case), a batch of 16 and one of 64 in which rows move and requests
#: come and go, and a full buffer permuted whole, so that every row reads one another writes.
CHANGES = (
    BatchChange("one", 1024, 1, 1, 0),
    BatchChange("sixteen-moved", 1024, 16, 16, 2),
    BatchChange("sixty-four-churn", 1024, 64, 70, 5),
    BatchChange("full-permuted", 1024, 1024, 1024, 0),
    BatchChange("small-buffer", 256, 200, 256, 17),
)


@dataclass
class CorrectionOutcome:
    change: str
    computed_differ: int
    accepted_differ: int
    stock_host_us: float
    kernel_host_us: float

    @property
    def ok(self) -> bool:
        return self.computed_differ == 0 and self.accepted_differ == 0


def _inputs(change: BatchChange, device: Any) -> tuple[Any, ...]:
    import torch

    g = torch.Generator(device="cpu").manual_seed(change.max_num_reqs + change.num_reqs)
    k = 15
    m, n, prev = change.max_num_reqs, change.num_reqs, change.prev_num_reqs
    positions = torch.randperm(prev, generator=g)[:n].to(torch.int64)
    if n > prev:
        positions = torch.cat((positions, torch.full((n - prev,), -1, dtype=torch.int64)))
    positions[torch.randperm(n, generator=g)[: change.new_rows]] = -1

    def ints(size: int, low: int, high: int) -> Any:
        return torch.randint(low, high, (size,), generator=g, dtype=torch.int32)

    drafts = torch.where(ints(m, 0, 4) > 0, k, 0).to(torch.int32)
    return tuple(
        t.to(device)
        for t in (
            ints(m, 0, 100_000),  # num_computed_tokens
            ints(n, 1, k + 2),  # num_accepted_tokens
            positions,  # prev_positions
            ints(prev, 1, k + 2),  # valid_sampled_token_count
            drafts,  # prev_num_draft_tokens
            ints(n, 0, 100_000),  # cpu_num_computed_tokens
        )
    )


@functools.cache
def _stock_function() -> Any:
    """0.20.1's own function: these operations under its torch.compile decorator, made once
    as the module-level decorator makes it, so every batch runs one compiled function."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.spec_decode import utils

    return torch.compile(
        utils._update_num_computed_tokens_by_tensor_ops,
        dynamic=True,
        backend=current_platform.simple_compile_backend,
    )


#: The fault the check must find: 0.20.1's side told that every previous row accepted one
#: token more. A check that passed it could not fail.
CONTROL = "one more accepted"


def run_change(change: BatchChange, device: Any, control: bool = False) -> CorrectionOutcome:
    """``change`` on both paths; with ``control``, 0.20.1's side given ``CONTROL``."""
    from vllm.v1.spec_decode import utils

    logger.debug("correction case %s%s", change.name, f" ({CONTROL})" if control else "")
    compiled = _stock_function()
    inputs = _inputs(change, device)
    stock = [t.clone() for t in inputs]
    fused = [t.clone() for t in inputs]
    if control:
        stock[3] += 1  # valid_sampled_token_count
    compiled(*stock)
    utils.update_num_computed_tokens_for_batch_change(*fused)
    drain()
    computed = int((stock[0] != fused[0]).sum())
    accepted = int((stock[1] != fused[1]).sum())
    # Timed on the tensors already corrected: each call changes their values, not the work.
    return CorrectionOutcome(
        change.name,
        computed,
        accepted,
        host_us(lambda: compiled(*stock)),
        host_us(lambda: utils.update_num_computed_tokens_for_batch_change(*fused)),
    )
