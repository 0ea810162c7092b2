"""Fix 27: a hybrid target's accepted counts after a step of no drafts are not read back.

On a hybrid target with a drafter, vLLM's V1 runner counts each request's accepted tokens
after every step (``_update_states_after_model_execute``) and reads them back from the GPU:
with prefix caching (Mamba cache mode "align") by ``.cpu()`` at once, which waits for the
step's forward and sampling; otherwise by a copy the next step's preparation waits for. With
asynchronous scheduling that wait keeps the runner's next step from overlapping the GPU's
work, which a plain engine's does. After a step that verified no drafts (the speculation
budget's drafting off, fix 23, or a step of prompts alone) each request accepted its one
sampled token, which the runner knows without the GPU.

The probe builds vLLM's V1 model runner on the CPU (``CPUModelRunner``) for a hybrid target
with a DFlash drafter at K = 3, in both Mamba cache modes, and hands its
``_update_states_after_model_execute`` the sampler's output of a step of four requests: one
token each (no drafts), then a verify step's (the rejection sampler's tokens, -1 past the
last accepted). The CUDA event the runner records for the copy and the state copy of the
"align" mode (``postprocess_mamba``) are stood in for by recorders; a ``TorchFunctionMode``
records each ``.cpu()``, ``.numpy()`` of a device buffer and copy into the host's counts.

Present: after the step of one token each, the counts read 1 on the host and on the device,
with no read back and no event recorded, in both modes; the "align" mode's state copy runs
after it as before, and at most once after the verify step (fix 39 leaves it out where no
request can complete a block, as in this batch of none); and the verify step's counts are
right. Absent: the counts of
the step without drafts are read back from the device. Unknown: any count that is wrong, or
a state copy run where it should not be or missing where it should.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from . import _harness
from ._v1 import RecordedEvent, count_reads, state_copies_recorded, without_v1_runner
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

NAME = "accepted_no_read"
K = 3
ONE_TOKEN = [[5], [6], [7], [8]]
VERIFY = [[5, -1, -1, -1], [5, 6, 7, -1], [5, 6, 7, 8], [5, 6, -1, -1]]
MODES = ("align", "none")


def _runner(mode: str) -> Any:
    config = _harness.vllm_config(
        _harness.hybrid_pair(),
        method="dflash",
        num_speculative_tokens=K,
        block_size=16,
        prefix_caching=mode == "align",
        mamba_cache_mode=mode,
    )
    runner = _harness.v1_runner(config)
    # Stood in for: what the "align" mode's state copy is handed (the KV-cache setup and the
    # model's copy functions), which the recorder of that copy does not read.
    runner.kv_cache_config = None
    runner.model = SimpleNamespace(get_mamba_state_copy_func=lambda: ())
    # The block size is all fix 39's test of whether a block can complete reads of them.
    bufs = SimpleNamespace(mamba_spec=SimpleNamespace(block_size=16))
    runner._get_mamba_copy_bufs = lambda: bufs
    runner._get_mamba_bufs = lambda: None
    runner.mamba_state_idx = {}
    return runner


def _after(runner: Any, tokens: list[list[int]]) -> dict[str, Any]:
    """What the runner does after a step that sampled ``tokens``: the counts it keeps on the
    host and the device, the reads back it made, the events it recorded."""
    import torch

    device = runner.num_accepted_tokens.gpu
    host = runner.input_batch.num_accepted_tokens_cpu_tensor
    event = RecordedEvent()
    runner.num_accepted_tokens_event = event
    copies: list[bool] = []
    n = len(tokens)
    host[:n] = 0
    device[:n] = 0
    step = SimpleNamespace(num_scheduled_tokens={}, scheduled_spec_decode_tokens={})
    # The release's state copy of the "align" mode, whatever its name there (0.22.0 fused it
    # on the GPU as postprocess_mamba_align_gpu).
    with (
        state_copies_recorded("postprocess_", lambda *a, **k: copies.append(True)),
        count_reads(device, host) as reads,
    ):
        runner._update_states_after_model_execute(torch.tensor(tokens, dtype=torch.int32), step)
    return {
        "host": [int(c) for c in host[:n].tolist()],
        "device": [int(c) for c in device[:n].tolist()],
        "reads": reads,
        "events": event.recorded,
        "state_copies": len(copies),
    }


def _read_back(step: dict[str, Any]) -> bool:
    return bool(step["reads"] or step["events"])


def run() -> ProbeResult:
    why = "the V2 runner keeps accepted counts in its own request state (the ledger's reading)"
    if (unknown := without_v1_runner(NAME, why)) is not None:
        return unknown
    seen: dict[str, dict[str, Any]] = {}
    try:
        for mode in MODES:
            runner = _runner(mode)
            seen[mode] = {"one token": _after(runner, ONE_TOKEN), "verify": _after(runner, VERIFY)}
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        return ProbeResult(
            probe=NAME,
            status=UNKNOWN,
            evidence="the runner could not be asked: " + " ".join(str(e).split())[:300],
        )
    wants = {"one token": [1, 1, 1, 1], "verify": [sum(t != -1 for t in row) for row in VERIFY]}
    # The host's counts are the runner's own where it read nothing back; a read back may be
    # the state copy's (stood in for) on a release that fused the two.
    wrong = [
        f"{mode}, {step}: {found[step]}"
        for mode, found in seen.items()
        for step, want in wants.items()
        if found[step]["device"] != want
        or (found[step]["host"] != want and not _read_back(found[step]))
    ]
    evidence = "; ".join(
        f"Mamba cache mode {mode!r}: after a step of one token each, counts "
        + str(found["one token"]["host"])
        + (
            f", read back ({', '.join(found['one token']['reads']) or 'an event recorded'})"
            if _read_back(found["one token"])
            else ", not read back"
        )
        + f"; after a verify step, counts {found['verify']['host']}"
        for mode, found in seen.items()
    )
    # After the verify step the "align" mode's copy may be left out where no request can
    # complete a block (fix 39; this batch holds none), so only the "none" mode is held there.
    wrong += [
        f"{mode}, {step}: the state copy ran {found[step]['state_copies']} times"
        for mode, found in seen.items()
        for step in wants
        if found[step]["state_copies"] > (mode == "align")
        or (step == "one token" and found[step]["state_copies"] != (mode == "align"))
    ]
    if wrong:
        return ProbeResult(probe=NAME, status=UNKNOWN, evidence="wrong counts: " + "; ".join(wrong))
    read_back = any(_read_back(f["one token"]) for f in seen.values())
    return ProbeResult(
        probe=NAME,
        status=ABSENT if read_back else PRESENT,
        evidence=f"hybrid target, DFlash K={K}: " + evidence,
        details=seen,
    )
