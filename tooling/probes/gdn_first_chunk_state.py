"""Fix 31: a Gated DeltaNet row that starts its request reads no state.

A request's first step on a hybrid target can be one token: a one-token prompt, or a first
chunk the token budget cut to one. vLLM 0.20.1's GDN builder counts every one-token row of a
step without speculative rows as a decode, and the decode kernels (the convolution's update,
the recurrent rule) load the row's state slot unconditionally. State slots are recycled and
never zeroed, so such a request starts from whatever its slot's last owner left there and
comes back wrong from its first token, with no error. On the trained pair (one H100, K = 7,
prefix caching, eager) ``tooling fuzz gpu`` found a one-token prompt whose first token was
not the target's (checked against the target in float32 on the CPU); plain vLLM has the same
defect where the slot it gets is dirty.

The probe builds the metadata of such steps with this release's GDN builder, on a CUDA device
as served (``_cuda_on_cpu``), from the served config of a hybrid target, plain and with a
DFlash drafter at K = 3, prefix caching on (Mamba cache mode "align") and FULL_AND_PIECEWISE
graphs: a one-token prompt alone, after decodes (plain) or after requests verifying drafts
(DFlash), and the last one-token piece of a chunked prompt, which has context. For each row
it reads what the GDN layer loads: a speculative row and a decode row load their slot; on the
prefill path a row loads it where ``has_initial_state`` says so.

Present: no row that starts its request loads a state, and every row with context does.
Absent: a row that starts its request loads its slot. Unknown: a row with context that loads
no state (another defect than this fix's), or a build that fails.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import _harness
from ._cuda_on_cpu import cuda_on_cpu
from .gdn_metadata_groups import Setup, _align_indices, _batch, _builders
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

NAME = "gdn_first_chunk_state"
K = 3


@dataclasses.dataclass(frozen=True)
class Step:
    """A step's rows: query and sequence lengths, drafts handed to GDN (-1: not a
    speculative row) and whether each is still in its prompt."""

    query_lens: list[int]
    seq_lens: list[int]
    drafts: list[int]
    prefilling: list[bool]

    def starts(self, row: int) -> bool:
        """Whether the row is its request's first step (no context)."""
        return self.seq_lens[row] == self.query_lens[row]


STEPS: dict[int, dict[str, Step]] = {
    0: {
        "a one-token prompt alone": Step([1], [1], [-1], [True]),
        "decodes, then a one-token prompt": Step(
            [1, 1, 1], [40, 18, 1], [-1, -1, -1], [False, False, True]
        ),
        "a prompt's last one-token piece": Step([1], [30], [-1], [True]),
    },
    K: {
        "a one-token prompt alone": Step([1], [1], [-1], [True]),
        "verifying drafts, then a one-token prompt": Step(
            [K + 1, K + 1, 1], [40, 18, 1], [K, K, -1], [False, False, True]
        ),
        "a prompt's last one-token piece": Step([1], [30], [-1], [True]),
    },
}


def _loads(built: Any, step: Step) -> list[bool]:
    """Whether the GDN layer loads each row's state slot for ``built``."""
    spec = int(built.num_spec_decodes or 0)
    loads, non_spec = [], 0
    for drafts in step.drafts:
        if spec and drafts >= 0:
            loads.append(True)
            continue
        if int(built.num_prefills) > 0:
            loads.append(bool(built.has_initial_state[non_spec]))
        else:
            loads.append(True)
        non_spec += 1
    return loads


def _read(builder: Any, k: int, step: Step) -> list[bool]:
    import torch

    batch = _batch(step.query_lens, step.seq_lens, 1)
    if hasattr(batch, "is_prefilling"):
        batch.is_prefilling = torch.tensor(step.prefilling)
    extra = {}
    if k:
        extra = {
            "num_accepted_tokens": torch.ones(len(step.drafts), dtype=torch.int32),
            "num_decode_draft_tokens_cpu": torch.tensor(step.drafts, dtype=torch.int32),
        }
    _align_indices((builder,), (batch,))
    return _loads(builder.build(0, batch, **extra), step)


def _readings(k: int) -> dict[str, tuple[Step, list[bool]]]:
    from vllm.config import set_current_vllm_config

    setup = Setup("DFlash" if k else "plain", k, {}, "")
    with cuda_on_cpu() as device:
        config, _, builder, _ = _builders(setup, device)
        with set_current_vllm_config(config):
            return {kind: (step, _read(builder, k, step)) for kind, step in STEPS[k].items()}


def run() -> ProbeResult:
    _harness.install_cpu_platform()
    stale, lost = [], []
    for k in STEPS:
        name = f"DFlash K={k}" if k else "plain"
        for kind, (step, loads) in _readings(k).items():
            for row, load in enumerate(loads):
                if step.starts(row) and load:
                    stale.append(f"{name}, {kind}: row {row} loads its slot")
                elif not step.starts(row) and not load:
                    lost.append(f"{name}, {kind}: row {row} has context and loads no state")
    if lost:
        return ProbeResult(
            probe=NAME,
            status=UNKNOWN,
            evidence=f"the GDN metadata drops a row's state, another defect: {lost}",
            details={"lost": lost, "stale": stale},
        )
    return ProbeResult(
        probe=NAME,
        status=ABSENT if stale else PRESENT,
        evidence=(
            "FULL_AND_PIECEWISE, prefix caching, plain and DFlash K=3: "
            + (
                f"a row that starts its request loads a recycled state slot ({'; '.join(stale)})"
                if stale
                else "no row that starts its request loads a state; every row with context does"
            )
        ),
        details={"stale": stale},
    )
