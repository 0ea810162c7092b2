"""vLLM 0.20.1's Gated DeltaNet recurrent kernel (fused_sigmoid_gating_delta_rule_update) in
Triton's interpreter on a CPU: a verify step of three tokens of which two stand, then a step
of one token with no drafts, read two ways: from the first state slot (the non-speculative
path, as 0.20.1 takes a step in which no request has drafts) and from the slot of the last
accepted token (the speculative path, num_accepted_tokens). The reference runs the two
accepted tokens alone from the same start.

Run with the probe interpreter, a vLLM tree on its path:
    TREE=build/work/vllm-0.20.1 $(.venv/bin/tooling probe-env) THIS_FILE
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.environ.get("TREE", "build/work/vllm-0.20.1"))

import torch
import triton
import triton.language as tl
import vllm.triton_utils as triton_utils

# vLLM disables Triton where no GPU driver is active; the interpreter needs none.
triton_utils.triton, triton_utils.tl, triton_utils.HAS_TRITON = triton, tl, True
from vllm.model_executor.layers.fla.ops.fused_sigmoid_gating import (  # noqa: E402
    fused_sigmoid_gating_delta_rule_update as recurrent,
)

torch.manual_seed(0)
H, HV, K, V, SLOTS, ACCEPTED = 1, 2, 16, 16, 4, 2
A_LOG, DT_BIAS = torch.full((HV,), -1.0), torch.zeros(HV)


def tokens(n):
    shapes = ((1, n, H, K), (1, n, H, K), (1, n, HV, V), (1, n, HV), (1, n, HV))
    return [torch.randn(s) * 0.3 for s in shapes]


def step(inputs, state, indices, accepted):
    q, k, v, a, b = inputs
    starts = torch.tensor([0, q.shape[1]], dtype=torch.int32)
    out, _ = recurrent(
        A_log=A_LOG,
        a=a,
        b=b,
        dt_bias=DT_BIAS,
        q=q,
        k=k,
        v=v,
        initial_state=state,
        inplace_final_state=True,
        cu_seqlens=starts,
        ssm_state_indices=indices,
        num_accepted_tokens=None
        if accepted is None
        else torch.tensor([accepted], dtype=torch.int32),
        use_qk_l2norm_in_kernel=True,
    )
    return out


# Row 0 is the null block; the request's K + 1 slots are rows 1..SLOTS.
slots = torch.arange(1, SLOTS + 1, dtype=torch.int32).view(1, SLOTS)
first = slots[:, :1].reshape(1).contiguous()
state = torch.zeros(SLOTS + 1, HV, V, K)
state[1] = torch.randn(HV, V, K) * 0.1
start = state[1].clone()
verify = tokens(3)
step(verify, state, slots, 1)
reference = torch.zeros_like(state)
reference[1] = start
step([t[:, :ACCEPTED] for t in verify], reference, slots, 1)
accepted_state = reference[ACCEPTED].clone()
print(
    "slot of the last accepted token holds the reference state:",
    torch.allclose(state[ACCEPTED], accepted_state, atol=1e-6),
)
print("first slot holds it:", torch.allclose(state[1], accepted_state, atol=1e-6))
after = tokens(1)
non_spec, spec, ref = state.clone(), state.clone(), reference.clone()
ref[1] = accepted_state
out_ref = step(after, ref, first, None)
out_non_spec = step(after, non_spec, first, None)
out_spec = step(after, spec, slots, ACCEPTED)
print(
    "next step, first slot read: max |output - reference| =",
    f"{float((out_non_spec - out_ref).abs().max()):.6f}",
)
print(
    "next step, slot of the last accepted token read: max |output - reference| =",
    f"{float((out_spec - out_ref).abs().max()):.6f};",
    "its state written to the first slot equals the reference:",
    torch.allclose(spec[1], ref[1], atol=1e-6),
)
