"""Fix 34: a verify step's inputs reach the device in one upload and two copies.

With a drafter and asynchronous scheduling (vLLM's default), each step of vLLM 0.20.1's V1
runner finds where the previous step's sampled token and drafts go in its input ids with a
Python loop over the requests, makes four index tensors of what it found (each a copy to
the device) and scatters twice; it then makes a tensor of each of the five arrays of the
speculative metadata, from pageable memory (five more copies), and gathers the drafts in two
indexings. On the GPU host each is a launch or a copy the host waits to stage, and at one
request the runner's inputs were DFlash's largest host cost beside the drafter.

The probe drives the V1 model runner (``CPUModelRunner``) for a hybrid target with a DFlash
drafter at K = 3 through its own ``execute_model`` up to the model's forward, with vLLM's real
Scheduler (``accepted_state``'s harness), and the runner's asynchronous state as its
asynchronous path leaves it (``async_drift_skip``'s): the previous step's rows, its sampled
tokens and drafts as device tensors, each a value of its own. Four requests prefill, then
verify their K drafts (the steady step); after that step the drafts handed on are K, K, K - 1
and 1, so the next step is not uniform and takes the general path.

For both verify steps it reads what the forward gets: each request's input ids (its last
sampled token, then its drafts from the previous step's drafts, by row) and the speculative
metadata the rejection sampler reads (draft counts and their running sums, the logits, target
and bonus indices, the drafts gathered), values and dtypes, each checked against what they
must be from the step's layout. In the uniform step it counts, inside the runner's
``_prepare_input_ids`` and ``_calc_spec_decode_metadata``, the tensors of host data moved to
the device one by one (``Tensor.to`` with a device: on a GPU each a copy of its own) and the
tensor operations dispatched, views left out.

Present: both steps' inputs are right, and the uniform step moves no tensor to the device one
by one and dispatches at most ``MAX_OPS`` operations. Absent: right, but the uniform step
moves tensors one by one or dispatches more. Unknown: any value or dtype wrong (another
defect than this fix's), no V1 runner (0.34.0's V2 runner keeps its inputs in device buffers
of its own), or steps that do not run as written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._v1 import CannotStep, v1_steps
from .accepted_state import K, _Served
from .async_drift_skip import _asynchronous
from .result import ABSENT, PRESENT, UNKNOWN, ProbeResult

NAME = "spec_inputs_upload"
RIDS = ["r0", "r1", "r2", "r3"]
#: The drafts each request hands on after the uniform step: not all K, so the next step
#: takes the general path.
UNEVEN = {"r0": K, "r1": K, "r2": K - 1, "r3": 1}
#: Operations other than views the uniform step's input ids and metadata may dispatch: the
#: upload of the packed metadata, the gather of the drafts and the two copies of the ids,
#: with a little room; the general path dispatches several times as many.
MAX_OPS = 6
COUNTED = ("_prepare_input_ids", "_calc_spec_decode_metadata")


@dataclass
class Count:
    """What the counted methods did in one step."""

    ops: int = 0
    uploads: int = 0
    """Tensors of host data moved to the runner's device with ``Tensor.to``: on a GPU each
    a copy of its own."""


@dataclass
class Seen:
    """One verify step's inputs as the forward gets them, and what is wrong in them."""

    count: Count
    wrong: list[str] = field(default_factory=list)


def _counting(runner: Any, count: Count) -> dict[str, Any]:
    """Wrap the runner's counted methods so that each call adds to ``count``; the methods
    replaced, to put back."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            # A view (a slice, a dtype view) launches nothing on the GPU.
            count.ops += not func.is_view
            return func(*args, **(kwargs or {}))

    class _Uploads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            if func is torch.Tensor.to:
                given = [*args[1:], kwargs.get("device")]
                count.uploads += any(isinstance(a, (torch.device, str)) for a in given)
            return func(*args, **kwargs)

    real = {name: getattr(runner, name) for name in COUNTED}

    def counted(method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            with _Uploads(), _Ops():
                return method(*args, **kwargs)

        return call

    for name, method in real.items():
        setattr(runner, name, counted(method))
    return real


def _handed_on(served: _Served, sampled: list[int], drafts: list[list[int]]) -> None:
    """The previous step's sampled tokens and drafts as the asynchronous path leaves them
    on the device: a column of tokens a row, and a row of K drafts a request."""
    import torch

    runner = served.runner
    _asynchronous(served)
    runner.input_batch.prev_sampled_token_ids = torch.tensor(sampled, dtype=torch.int32)[:, None]
    runner._draft_token_ids = torch.tensor(drafts, dtype=torch.int64)


def _expected(rows: list[str], drafted: dict[str, int], sampled: list[int], drafts: Any) -> Any:
    """What the forward must get for a step of ``rows`` (in the batch's order, each at its
    previous row) verifying ``drafted[r]`` drafts: the input ids and the metadata's arrays."""
    ids: list[int] = []
    logits: list[int] = []
    target: list[int] = []
    bonus: list[int] = []
    for i, rid in enumerate(rows):
        n = drafted[rid]
        start = len(ids)
        ids += [sampled[i], *drafts[i][:n]]
        logits += range(start, start + n + 1)
        target += range(len(logits) - n - 1, len(logits) - 1)
        bonus.append(len(logits) - 1)
    counts = [drafted[r] for r in rows]
    running = [sum(counts[: i + 1]) for i in range(len(counts))]
    sampled_running = [sum(c + 1 for c in counts[: i + 1]) for i in range(len(counts))]
    gathered = [ids[logits[t + 1]] for t in target]
    arrays = {
        "cu_num_draft_tokens": (running, "int32"),
        "cu_num_sampled_tokens": (sampled_running, "int32"),
        "logits_indices": (logits, "int64"),
        "target_logits_indices": (target, "int32"),
        "bonus_logits_indices": (bonus, "int32"),
        "draft_token_ids": (gathered, "int32"),
    }
    return ids, counts, arrays


def _read(served: _Served, out: Any, sampled: list[int], drafts: Any, count: Count) -> Seen:
    """Run ``out``'s step to the forward and compare what it gets with ``_expected``."""
    runner = served.runner
    got: dict[str, Any] = {}
    prepare = runner._prepare_inputs

    def kept(*args: Any, **kwargs: Any) -> Any:
        got["returned"] = prepare(*args, **kwargs)
        return got["returned"]

    runner._prepare_inputs = kept
    real = _counting(runner, count)
    try:
        served.execute(out)
    finally:
        del runner._prepare_inputs
        for name in real:
            delattr(runner, name)
    rows = list(runner.input_batch.req_ids)
    drafted = {r: len(out.scheduled_spec_decode_tokens.get(r, ())) for r in rows}
    ids, counts, arrays = _expected(rows, drafted, sampled, drafts)
    seen = Seen(count)
    total = out.total_num_scheduled_tokens
    if (given := [int(t) for t in runner.input_ids.gpu[:total].tolist()]) != ids:
        seen.wrong.append(f"input ids {given} (wanted {ids})")
    _, metadata = got["returned"]
    if metadata is None or list(metadata.num_draft_tokens) != counts:
        seen.wrong.append(f"speculative metadata {metadata} (wanted draft counts {counts})")
        return seen
    for name, (want, dtype) in arrays.items():
        tensor = getattr(metadata, name)
        values = [int(v) for v in tensor.tolist()]
        if values != want or str(tensor.dtype) != f"torch.{dtype}":
            seen.wrong.append(f"{name} {values} {tensor.dtype} (wanted {want} torch.{dtype})")
    return seen


def _steps() -> dict[str, Seen]:
    from vllm.v1.outputs import DraftTokenIds

    served = _Served()
    sched = served.scheduler
    out = served.drafted(RIDS)
    if dict(out.num_scheduled_tokens) != dict.fromkeys(RIDS, K + 1):
        raise CannotStep(f"the verify step scheduled {dict(out.num_scheduled_tokens)}")
    # Each value its own, so that a token in the wrong place shows.
    sampled = [500 + i for i in range(len(RIDS))]
    drafts = [[600 + 10 * i + j for j in range(K)] for i in range(len(RIDS))]
    _handed_on(served, sampled, drafts)
    seen = {"uniform": _read(served, out, sampled, drafts, Count())}
    served.sampled(out, dict.fromkeys(RIDS, 2))
    sched.update_draft_token_ids(DraftTokenIds(RIDS, [[8] * UNEVEN[r] for r in RIDS]))
    out = sched.schedule()
    sampled = [700 + i for i in range(len(RIDS))]
    drafts = [[800 + 10 * i + j for j in range(K)] for i in range(len(RIDS))]
    _handed_on(served, sampled, drafts)
    seen["uneven"] = _read(served, out, sampled, drafts, Count())
    return seen


def run() -> ProbeResult:
    why = "the V2 runner keeps its inputs in device buffers of its own (the ledger's reading)"
    seen = v1_steps(NAME, why, _steps)
    if isinstance(seen, ProbeResult):
        return seen
    wrong = {step: s.wrong for step, s in seen.items() if s.wrong}
    uniform = seen["uniform"].count
    details = {
        "uniform": {"operations": uniform.ops, "uploads": uniform.uploads},
        "max_ops": MAX_OPS,
    }
    if wrong:
        return ProbeResult(
            probe=NAME,
            status=UNKNOWN,
            evidence=f"a verify step's inputs are wrong, another defect than this fix's: {wrong}",
            details=details,
        )
    fast = uniform.uploads == 0 and uniform.ops <= MAX_OPS
    return ProbeResult(
        probe=NAME,
        status=PRESENT if fast else ABSENT,
        evidence=(
            f"hybrid target, DFlash K={K}, asynchronous scheduling: both verify steps' input "
            f"ids and speculative metadata are right; the uniform step moved "
            f"{uniform.uploads} tensors of host data to the device one by one and dispatched "
            f"{uniform.ops} operations (none and at most {MAX_OPS} wanted)"
        ),
        details=details,
    )
