"""The replaying verify step (replay_kernel.py) against vLLM 0.20.1's own speculative
Gated DeltaNet kernel and a float64 reference, in Triton's interpreter on the CPU.

Each case is a batch of requests that runs several steps. The first step starts from a
given state in slot 0 with num_accepted_tokens 1, as after a prefill. Every later step
starts where the last one accepted: a random count of 1 .. T for each request. The
requests differ:

- "none": one token a step (a decode with no drafts, T = 1);
- "full": K + 1 tokens a step;
- "trim": a random T from 1 to K + 1 each step, and left out of the third step's batch
  (a request the scheduler passed over); it comes back with the count it kept;
- "toggle": K + 1 or 1 tokens, drawn each step (drafting turned off and on).

The second step also carries two padding rows (no tokens, null state indices), as a
batch under full CUDA graphs does.

The stock kernel runs on its own state tensor with all K + 1 slots a request. The
prototype runs on another tensor of the same layout; its rows live in each request's
last slot. Both tensors start with NaN in every slot but slot 0, so a read of anything
not yet written shows. After each step the state after the accepted tokens is read
from the stock kernel's slot (count - 1) and, for the prototype, written by its fold
kernel into a spare slot.

Run with the probe interpreter:
    /root/.cache/vllm-dflash/envs/probe-8b217dcc236b/bin/python check_replay.py
Options: --state-dtype float32|bfloat16 (default both), --case NAME, --mutations.
"""

import argparse
import os
import sys
import time
from dataclasses import dataclass, field

os.environ["TRITON_INTERPRET"] = "1"
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.environ.get("TREE", "/work/main/build/work/vllm-0.20.1"))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import vllm.triton_utils as triton_utils  # noqa: E402

# vLLM disables Triton where no GPU driver is active; the interpreter needs none.
triton_utils.triton, triton_utils.tl, triton_utils.HAS_TRITON = triton, tl, True
from vllm.model_executor.layers.fla.ops.fused_sigmoid_gating import (  # noqa: E402
    fused_sigmoid_gating_delta_rule_update as stock_update,
)

import replay_kernel as rk  # noqa: E402

IN_DTYPE = torch.bfloat16


@dataclass
class Case:
    name: str
    seed: int
    H: int
    HV: int
    Kd: int
    Vd: int
    num_spec: int
    steps: int
    kinds: list[str]
    mutate: str | None = None
    # What fills the slots nothing has written: NaN shows any read of them; finite noise
    # makes a wrong read show as a wrong number instead.
    fill: str = "nan"


CASES = [
    Case("k7-a", 0, 16, 48, 32, 32, 7, 6, ["none", "full", "trim", "toggle"]),
    Case("k7-b", 1, 16, 48, 32, 32, 7, 6, ["none", "full", "trim", "toggle"]),
    Case("k15", 2, 16, 48, 32, 32, 15, 4, ["none", "full", "toggle"]),
    Case("k3-v64", 3, 16, 48, 16, 64, 3, 5, ["none", "full", "trim", "toggle"]),
]

MUTATIONS = [
    # The count read one too high from the second step on: one row too many replayed.
    Case("mut-extra-row", 4, 16, 48, 32, 32, 3, 3, ["full", "full"], "extra-row", "noise"),
    # The rows not written from the second step on: the third step replays the first's.
    Case("mut-no-store", 4, 16, 48, 32, 32, 3, 3, ["full", "full"], "no-store", "noise"),
]


@dataclass
class StepRow:
    case: str
    dtype: str
    step: int
    tokens: str
    accepted: str
    o_rep_stock: float
    o_rep_ref: float
    o_stock_ref: float
    s_rep_stock: float
    s_rep_ref: float
    s_stock_ref: float
    o_scale: float
    s_scale: float
    finite: bool = True
    notes: list[str] = field(default_factory=list)


def reference(S, q, k, v, a, b, A_log, dt_bias, scale):
    """The recurrence in float64: outputs [T, HV, V] and the state after each token."""
    HV, H = v.shape[1], k.shape[1]
    G = HV // H
    outs, states = [], []
    S = S.clone()
    for t in range(q.shape[0]):
        x = a[t].double() + dt_bias.double()
        softplus = torch.where(x <= 20.0, torch.log1p(torch.exp(x)), x)
        g = -torch.exp(A_log.double()) * softplus
        beta = torch.sigmoid(b[t].double())
        qt, kt = q[t].double(), k[t].double()
        qn = qt / torch.sqrt((qt * qt).sum(-1, keepdim=True) + 1e-6) * scale
        kn = kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + 1e-6)
        qn, kn = qn.repeat_interleave(G, 0), kn.repeat_interleave(G, 0)
        S = S * torch.exp(g)[:, None, None]
        u = (v[t].double() - torch.einsum("hvk,hk->hv", S, kn)) * beta[:, None]
        S = S + u[:, :, None] * kn[:, None, :]
        outs.append(torch.einsum("hvk,hk->hv", S, qn))
        states.append(S.clone())
    return torch.stack(outs), states


def tokens_for(kind, step, K, gen):
    if kind == "none":
        return 1
    if kind == "full":
        return K + 1
    if kind == "trim":
        return int(torch.randint(1, K + 2, (1,), generator=gen))
    if kind == "toggle":
        return K + 1 if int(torch.randint(0, 2, (1,), generator=gen)) else 1
    raise ValueError(kind)


def run_case(c: Case, state_dtype: torch.dtype) -> tuple[list[StepRow], list[str]]:
    gen = torch.Generator().manual_seed(c.seed)
    H, HV, Kd, Vd, K = c.H, c.HV, c.Kd, c.Vd, c.num_spec
    R = len(c.kinds)
    slots_per = K + 1
    scratch0 = 1 + R * slots_per
    num_slots = scratch0 + R
    scale = Kd**-0.5

    A_log = (torch.rand(HV, generator=gen) * 3 - 2).float()
    dt_bias = (torch.rand(HV, generator=gen) * 2 - 1).float()

    def slot(r, j):
        return 1 + r * slots_per + j

    if c.fill == "nan":
        st_stock = torch.full((num_slots, HV, Vd, Kd), float("nan"), dtype=state_dtype)
    else:
        st_stock = (torch.randn(num_slots, HV, Vd, Kd, generator=gen) * 0.3).to(state_dtype)
    st_rep = st_stock.clone()
    st_stock[0] = 0
    st_rep[0] = 0
    S_ref = []
    for r in range(R):
        s0 = (torch.randn(HV, Vd, Kd, generator=gen) * 0.3).to(state_dtype)
        st_stock[slot(r, 0)] = s0
        st_rep[slot(r, 0)] = s0
        S_ref.append(s0.double())
    untouched = st_rep.clone()
    # The count each request's last step accepted: 1, as after a prefill.
    acc = [1] * R
    layout = rk.row_layout(H, HV, Kd, Vd, K, IN_DTYPE, HV * Vd * Kd * st_rep.element_size())

    rows_out: list[StepRow] = []
    problems: list[str] = []
    for s in range(c.steps):
        present = [
            r for r in range(R) if not (c.kinds[r] == "trim" and s == 2 and c.steps > 3)
        ]
        Ts = {r: tokens_for(c.kinds[r], s, K, gen) for r in present}
        pad = 2 if s == 1 else 0
        inputs = {}
        for r in present:
            T = Ts[r]
            inputs[r] = (
                torch.randn(T, H, Kd, generator=gen).to(IN_DTYPE),
                torch.randn(T, H, Kd, generator=gen).to(IN_DTYPE),
                torch.randn(T, HV, Vd, generator=gen).to(IN_DTYPE),
                torch.randn(T, HV, generator=gen).to(IN_DTYPE),
                torch.randn(T, HV, generator=gen).to(IN_DTYPE),
            )
        q, k, v, a, b = (
            torch.cat([inputs[r][i] for r in present]).unsqueeze(0) for i in range(5)
        )
        lens = [Ts[r] for r in present] + [0] * pad
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
        idx = torch.zeros(len(lens), slots_per, dtype=torch.int32)
        for i, r in enumerate(present):
            idx[i] = torch.arange(slot(r, 0), slot(r, 0) + slots_per, dtype=torch.int32)
        num_acc = torch.ones(len(lens), dtype=torch.int32)
        for i, r in enumerate(present):
            num_acc[i] = acc[r]

        o_stock, _ = stock_update(
            A_log=A_log,
            a=a,
            b=b,
            dt_bias=dt_bias,
            q=q,
            k=k,
            v=v,
            initial_state=st_stock,
            inplace_final_state=True,
            cu_seqlens=cu,
            ssm_state_indices=idx,
            num_accepted_tokens=num_acc,
            use_qk_l2norm_in_kernel=True,
        )
        # A mutation acts from the second step on, after one clean step wrote rows.
        mutate = c.mutate if s >= 1 else None
        rep_acc = num_acc + 1 if mutate == "extra-row" else num_acc
        o_rep = rk.replay_verify(
            A_log,
            a,
            b,
            dt_bias,
            q,
            k,
            v,
            st_rep,
            cu,
            idx,
            idx[:, K],
            rep_acc,
            rows=K,
            store_rows=mutate != "no-store",
        )
        o_stock, o_rep = o_stock.reshape(-1, HV, Vd), o_rep.reshape(-1, HV, Vd)

        # What each request accepts.
        new_acc = {r: int(torch.randint(1, Ts[r] + 1, (1,), generator=gen)) for r in present}
        src = torch.zeros(len(present), dtype=torch.int32)
        dst = torch.zeros(len(present), dtype=torch.int32)
        buf = torch.zeros(len(present), dtype=torch.int32)
        fold_acc = torch.zeros(len(present), dtype=torch.int32)
        for i, r in enumerate(present):
            src[i], dst[i], buf[i] = slot(r, 0), scratch0 + r, slot(r, K)
            fold_acc[i] = new_acc[r]
        rk.fold(st_rep, src, dst, buf, fold_acc, IN_DTYPE, H, K)

        e = dict(ors=0.0, orr=0.0, osr=0.0, srs=0.0, srr=0.0, ssr=0.0, osc=0.0, ssc=0.0)

        def worst(key, diff):
            # NaN counts as the worst error (Python's max would drop it).
            x = float(diff.abs().max())
            e[key] = float("inf") if x != x else max(e[key], x)

        finite = True
        for i, r in enumerate(present):
            lo, hi = int(cu[i]), int(cu[i + 1])
            out_ref, states = reference(S_ref[r], *inputs[r], A_log, dt_bias, scale)
            n = new_acc[r]
            s_stock = st_stock[slot(r, n - 1)].double()
            s_rep = st_rep[scratch0 + r].double()
            s_ref = states[n - 1]
            orp, ost = o_rep[lo:hi].double(), o_stock[lo:hi].double()
            finite &= bool(torch.isfinite(orp).all() and torch.isfinite(s_rep).all())
            worst("ors", (orp - ost))
            worst("orr", (orp - out_ref))
            worst("osr", (ost - out_ref))
            worst("srs", (s_rep - s_stock))
            worst("srr", (s_rep - s_ref))
            worst("ssr", (s_stock - s_ref))
            worst("osc", out_ref)
            worst("ssc", s_ref)
            # The next step starts from the accepted state; the reference keeps float64.
            S_ref[r] = s_ref
            acc[r] = n
        rows_out.append(
            StepRow(
                c.name,
                str(state_dtype).replace("torch.", ""),
                s,
                " ".join(str(Ts.get(r, "-")) for r in range(R)) + (f" +{pad}pad" if pad else ""),
                " ".join(str(new_acc.get(r, "-")) for r in range(R)),
                e["ors"],
                e["orr"],
                e["osr"],
                e["srs"],
                e["srr"],
                e["ssr"],
                e["osc"],
                e["ssc"],
                finite,
            )
        )

    # The prototype writes slot 0 and the rows' slot only: slots 1 .. K - 1 keep their
    # first bytes, and so does the rows' slot past the bytes the layout uses.
    def same_bytes(x, y):
        return torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))

    for r in range(R):
        for j in range(1, K):
            if not same_bytes(st_rep[slot(r, j)], untouched[slot(r, j)]):
                problems.append(f"{c.name}: request {r} slot {j} was written")
        first_unused = -(-layout.bytes_used // st_rep.element_size())
        if not same_bytes(
            st_rep[slot(r, K)].flatten()[first_unused:],
            untouched[slot(r, K)].flatten()[first_unused:],
        ):
            problems.append(f"{c.name}: request {r} rows' slot written past its rows")
    return rows_out, problems


def fmt(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}"


def verdict(rows: list[StepRow], dtype: str) -> tuple[bool, str]:
    """fp32 state: the prototype equals stock exactly (same arithmetic, same order).
    bf16 state: the two round the state at different tokens (stock after the last
    accepted token, the prototype after the first token of the step), so they differ
    by rounding; the prototype's error against float64 must stay within twice stock's."""
    if not all(r.finite for r in rows):
        return False, "non-finite values"
    o_rr = max(r.o_rep_ref for r in rows)
    o_sr = max(r.o_stock_ref for r in rows)
    s_rr = max(r.s_rep_ref for r in rows)
    s_sr = max(r.s_stock_ref for r in rows)
    if dtype == "float32":
        ok = max(r.o_rep_stock for r in rows) == 0 and max(r.s_rep_stock for r in rows) <= 1e-6
        why = "prototype equals stock exactly" if ok else "prototype differs from stock"
        ok &= o_rr <= 2 * o_sr + 1e-6 and s_rr <= 2 * s_sr + 1e-6
        return ok, why
    ok = o_rr <= 2 * o_sr and s_rr <= 2 * s_sr
    why = (
        f"vs float64: outputs {fmt(o_rr)} (stock {fmt(o_sr)}), "
        f"accepted state {fmt(s_rr)} (stock {fmt(s_sr)})"
    )
    return ok, why


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--state-dtype", choices=["float32", "bfloat16"], action="append")
    p.add_argument("--case", action="append")
    p.add_argument("--mutations", action="store_true", help="run the mutations instead")
    args = p.parse_args()
    dtypes = args.state_dtype or ["float32", "bfloat16"]
    cases = MUTATIONS if args.mutations else CASES
    if args.case:
        cases = [c for c in cases if c.name in args.case]

    print(
        "| case | state | step | T a request | accepted | out rep-stock | out rep-ref "
        "| out stock-ref | state rep-stock | state rep-ref | state stock-ref | max|out| "
        "| max|state| |"
    )
    print("|" + "---|" * 13)
    all_ok = True
    summary = []
    for dname in dtypes:
        dtype = getattr(torch, dname)
        for c in cases:
            t0 = time.time()
            rows, problems = run_case(c, dtype)
            for r in rows:
                print(
                    f"| {r.case} | {r.dtype} | {r.step} | {r.tokens} | {r.accepted} | "
                    f"{fmt(r.o_rep_stock)} | {fmt(r.o_rep_ref)} | {fmt(r.o_stock_ref)} | "
                    f"{fmt(r.s_rep_stock)} | {fmt(r.s_rep_ref)} | {fmt(r.s_stock_ref)} | "
                    f"{r.o_scale:.2f} | {r.s_scale:.2f} |",
                    flush=True,
                )
            ok, why = verdict(rows, dname)
            ok &= not problems
            all_ok &= ok
            summary.append(
                f"{c.name} {dname}: {'PASS' if ok else 'FAIL'} ({why}"
                + (f"; {'; '.join(problems)}" if problems else "")
                + f") in {time.time() - t0:.0f} s"
            )
    print()
    for line in summary:
        print(line)
    if args.mutations:
        print("mutations: each must FAIL;", "all failed" if not all_ok and all(
            "FAIL" in s for s in summary) else "SOME PASSED")
    else:
        print("overall:", "PASS" if all_ok else "FAIL")


if __name__ == "__main__":
    main()
