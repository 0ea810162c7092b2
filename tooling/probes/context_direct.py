"""Fix 26: a DFlash step that verified no drafts writes its context K/V without the input kernel.

With drafting off (fix 23) a DFlash step still writes the drafter's context K/V of the tokens
the target computed, so that later drafts attend to every position. 0.20.1's path for that
is the drafter's first-pass input kernel (``copy_and_expand_dflash_inputs_kernel``), which lays
out the context beside the bonus token and K masks of every request, then a dozen tensor
operations for the query pass's metadata, none of which that step reads. In a step that
verified no drafts every computed token is context at its own position, in the slot the
runner already mapped it to in the drafter's KV-cache group.

The probe builds vLLM's V1 model runner on the CPU (``CPUModelRunner``) with a DFlash drafter
at K = ``K`` and asks its drafter to store the context of a step of no drafts: two decodes and
a prompt chunk of five tokens joining them, on a block table of distinct blocks and the
runner's slot mapping for it. It asks twice: with the positions as one row, and as a target
with M-RoPE (Qwen3.5 and 3.6) hands them, three rows of which the kernel reads the first.
The drafter's model is stood in for by a recorder of what it is asked to write (its K/V math
is not this fix's). The same step then goes through the input kernel itself, run by
Triton's interpreter in an interpreter of its own, for the context positions and slots it
lays out.

Present: in both forms the context is written at the kernel's positions and slots, every
token once, and the kernel did not run. Absent: it ran in either (or the drafter has no
context-only path at all: fix 23 absent). Unknown: the positions or slots differ from the
kernel's.
"""

from __future__ import annotations

from typing import Any

from . import _harness
from ._interpreted import NotInterpreted, run_interpreted
from ._v1 import without_v1_runner
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

NAME = "context_direct"
K = 15
BLOCK = 16
QUERY_LENS = [1, 1, 5]
SEQ_LENS = [40, 17, 5]
COLUMNS = 8
HIDDEN = 12


def _step() -> tuple[Any, Any, Any]:
    """(the drafter group's common metadata, the tokens' positions, their slots) for the
    probe's step, with the slots the runner maps each position to."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    starts = torch.zeros(len(QUERY_LENS) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(QUERY_LENS, dtype=torch.int32), 0)
    table = (torch.randperm(200, generator=torch.Generator().manual_seed(3)) + 1)[
        : len(QUERY_LENS) * COLUMNS
    ].view(len(QUERY_LENS), COLUMNS)
    positions, slots = [], []
    for r, (q, s) in enumerate(zip(QUERY_LENS, SEQ_LENS, strict=True)):
        for p in range(s - q, s):
            positions.append(p)
            slots.append(int(table[r, p // BLOCK]) * BLOCK + p % BLOCK)
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    cad = CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts.clone(),
        seq_lens=lens,
        num_reqs=len(QUERY_LENS),
        num_actual_tokens=len(positions),
        max_query_len=max(QUERY_LENS),
        max_seq_len=max(SEQ_LENS),
        block_table_tensor=table.to(torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        seq_lens_cpu_upper_bound=lens.clone(),
    )
    return cad, torch.tensor(positions, dtype=torch.int64), slots


def stored() -> dict[str, Any]:
    """What the drafter writes of the probe's step, and what the input kernel lays out for
    it (run where Triton interprets)."""
    import torch

    pair = _harness.write_tiny_pair(
        _harness.scratch_dir(), target_layers=8, target_layer_ids=[1, 3, 5]
    )
    runner = _harness.v1_runner(_harness.vllm_config(pair, num_speculative_tokens=K))
    drafter = runner.drafter
    if not hasattr(drafter, "store_context"):
        return {"store_context": False}
    drafter.block_size = BLOCK
    written: list[dict[str, Any]] = []

    class _Recorder:
        def combine_hidden_states(self, hidden: Any) -> Any:
            return hidden

        def precompute_and_store_context_kv(self, states: Any, positions: Any, slots: Any) -> None:
            written.append(
                {
                    "rows": int(states.shape[0]),
                    "positions": [int(p) for p in positions.tolist()],
                    "slots": [int(s) for s in slots.tolist()],
                }
            )

    drafter.model = _Recorder()
    laid_out = []
    layout = drafter.set_inputs_first_pass

    def _layout(*args: Any, **kwargs: Any) -> Any:
        laid_out.append(True)
        return layout(*args, **kwargs)

    drafter.set_inputs_first_pass = _layout
    cad, positions, slots = _step()
    n = positions.shape[0]
    hidden = torch.randn(n, HIDDEN)
    next_ids = torch.tensor([7] * len(QUERY_LENS), dtype=torch.int32)
    tokens = torch.arange(n, dtype=torch.int32)
    found: dict[str, Any] = {"store_context": True, "runner_slots": slots, "tokens": n}
    for target, given in _position_forms(positions).items():
        written.clear()
        laid_out.clear()
        drafter.store_context(tokens, given, hidden, next_ids, None, cad, None)
        found[target] = {"written": list(written), "layout_ran": bool(laid_out)}
        layout(tokens, next_ids, given, hidden, None, cad, None)
        found[target]["kernel"] = {
            "positions": [int(p) for p in drafter._context_positions_buffer[:n].tolist()],
            "slots": [int(s) for s in drafter._context_slot_mapping_buffer[:n].tolist()],
        }
    return found


def _position_forms(positions: Any) -> dict[str, Any]:
    """The step's positions as the runner hands them: one row, or for a target with M-RoPE
    (Qwen3.5 and 3.6) three rows of a wider buffer, sliced to the step's tokens, the other
    rows differing from the first as an image's would."""
    import torch

    n = positions.shape[0]
    rows = torch.zeros(3, n + 9, dtype=torch.int64)
    rows[0, :n] = positions
    rows[1, :n] = positions + 1000
    rows[2, :n] = positions + 2000
    return {"one row": positions, "M-RoPE rows": rows[:, :n]}


def _ask() -> dict[str, Any]:
    try:
        return dict(run_interpreted("context_direct", "stored"))
    except NotInterpreted as e:
        return {"error": str(e)}


def run() -> ProbeResult:
    why = "the V2 runner's DFlash speculator writes its context itself (the ledger's reading)"
    if (unknown := without_v1_runner(NAME, why)) is not None:
        return unknown
    found = _ask()
    if "error" in found:
        return ProbeResult(
            probe=NAME, status=UNKNOWN, evidence=f"the drafter could not be asked: {found['error']}"
        )
    if not found["store_context"]:
        return ProbeResult(
            probe=NAME,
            status=ABSENT,
            evidence="the DFlash drafter has no context-only path (fix 23 absent): a step of no "
            "drafts runs its whole first pass",
        )
    forms = ("one row", "M-RoPE rows")
    wrong = [form for form in forms if not _right(found, form)]
    evidence = (
        f"DFlash K={K}, a step of no drafts ({found['tokens']} tokens: two decodes and a prompt "
        f"chunk of five), positions as "
        + "; as ".join(
            f"{form}: the context written at {found[form]['written']}, the input kernel lays "
            f"out {found[form]['kernel']}, the kernel "
            + ("ran" if found[form]["layout_ran"] else "did not run")
            for form in forms
        )
    )
    if wrong:
        return ProbeResult(
            probe=NAME, status=UNKNOWN, evidence=f"wrong context ({', '.join(wrong)}): {evidence}"
        )
    ran = [form for form in forms if found[form]["layout_ran"]]
    return ProbeResult(
        probe=NAME,
        status=ABSENT if ran else PRESENT,
        evidence=evidence,
        details={form: found[form] for form in forms},
    )


def _right(found: dict[str, Any], form: str) -> bool:
    """Whether the context of ``form`` was written once, at the kernel's positions and at
    the runner's slots (which are the kernel's)."""
    written, kernel = found[form]["written"], found[form]["kernel"]
    return (
        len(written) == 1
        and written[0]["rows"] == found["tokens"]
        and written[0]["positions"] == kernel["positions"]
        and written[0]["slots"] == kernel["slots"] == found["runner_slots"]
    )
