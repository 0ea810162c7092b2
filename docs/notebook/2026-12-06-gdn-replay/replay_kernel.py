"""A prototype of a replaying verify step for vLLM 0.20.1's Gated DeltaNet layers.

vLLM 0.20.1's speculative path (``fused_sigmoid_gating_delta_rule_update`` with
``num_accepted_tokens``) stores the recurrent state after every one of a request's T
tokens into the request's K + 1 state slots, and the next step reads the slot of the
last accepted token. This prototype keeps one state a request and a small buffer of
per-token rows instead.

What a request holds between steps:

- Slot 0 (column 0 of the state indices): the state after the first token of the
  request's last step. That token is always accepted, and it is what stock keeps in
  slot 0 too. After a prefill, slot 0 holds the prefill's final state, as in stock.
- The row buffer, inside another of the request's slots (the caller names it; the
  check uses the last one): one row for each of the last step's tokens 1 .. T - 1.
  A row is the token's key and value as the kernel received them (the input dtype),
  and its gate g and beta as the kernel computed them (float32). These are exactly
  what the recurrence needs, so replaying a row repeats the stock kernel's arithmetic.

The count the kernel reads is vLLM's own ``num_accepted_tokens`` (1 .. K + 1). The
state after the last accepted token is slot 0 with the first ``num_accepted_tokens - 1``
rows replayed on it. A count of 1 replays nothing, which is what a prefill, a step of
no drafts and every count reset in the runner leave.

A verify step is two launches, in this order:

1. ``replay_verify_kernel``: load slot 0, replay the rows, run the step's first token,
   store that state into slot 0 (the one state write), run the other tokens and write
   every token's output. It reads the old rows and never writes them.
2. ``store_rows_kernel``: write the step's tokens 1 .. T - 1 as the new rows.

The rows are written in a second launch because the key rows and the gate rows are
shared: every value head of a key head, and every block of the value dimension, reads
them. A program that wrote new rows could overwrite a row that another program of the
same launch has still to replay.

``fold_kernel`` writes the state after a given count into any slot (a copy of the
accepted state, as prefix caching's "align" mode needs, and as the check uses).

Limits of the prototype: the whole key dimension in one block, as stock asserts (NK == 1);
the query and key are always normalised in the kernel (the speculative caller always
asks for it); Gated DeltaNet only (no KDA gates).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _gates(a_val, b_val, A_log_val, dt_bias_val, softplus_beta, threshold):
    """g and beta as the stock kernel computes them."""
    x = a_val.to(tl.float32) + dt_bias_val.to(tl.float32)
    softplus_x = tl.where(
        softplus_beta * x <= threshold,
        (1 / softplus_beta) * tl.log(1 + tl.exp(softplus_beta * x)),
        x,
    )
    b_g = -tl.exp(A_log_val.to(tl.float32)) * softplus_x
    b_beta = tl.sigmoid(b_val.to(tl.float32))
    return b_g, b_beta


@triton.jit
def _l2norm(x):
    return x * tl.rsqrt(tl.sum(x * x) + 1e-6)


@triton.jit
def _delta_step(b_h, b_k, b_v, b_g, b_beta):
    """One token of the gated delta rule on a [BV, BK] tile, as stock orders it."""
    b_h *= tl.exp(b_g)
    b_v -= tl.sum(b_h * b_k[None, :], 1)
    b_v *= b_beta
    b_h += b_v[:, None] * b_k[None, :]
    return b_h


@triton.jit
def _replay_rows(b_h, p_rk, p_rv, p_rg, n_rows, mask_k, mask_v, KV_ROW, HV):
    """``b_h`` with the first ``n_rows`` buffered rows applied."""
    for r in range(0, n_rows):
        b_k = tl.load(p_rk + r * KV_ROW, mask=mask_k, other=0).to(tl.float32)
        b_v = tl.load(p_rv + r * KV_ROW, mask=mask_v, other=0).to(tl.float32)
        b_g = tl.load(p_rg + r * 2 * HV)
        b_beta = tl.load(p_rg + r * 2 * HV + HV)
        b_k = _l2norm(b_k)
        b_h = _delta_step(b_h, b_k, b_v, b_g, b_beta)
    return b_h


@triton.jit
def replay_verify_kernel(
    A_log,
    a,
    b,
    dt_bias,
    q,
    k,
    v,
    o,
    state,
    buf_kv,
    buf_gb,
    cu_seqlens,
    state_indices,
    buf_indices,
    num_accepted_tokens,
    scale,
    softplus_beta,
    threshold,
    stride_state_slot,
    stride_indices_seq,
    stride_buf_indices_seq,
    stride_kv_slot,
    stride_gb_slot,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    KV_ROW: tl.constexpr,
    GB_OFF: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)

    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = eos - bos
    if T == 0:
        # A padding row.
        return
    slot = tl.load(state_indices + i_n * stride_indices_seq).to(tl.int64)
    if slot <= 0:
        # The null block: stock skips such a row too.
        return
    buf_slot = tl.load(buf_indices + i_n * stride_buf_indices_seq).to(tl.int64)
    n_rows = tl.load(num_accepted_tokens + i_n).to(tl.int64) - 1

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_v[:, None] & mask_k[None, :]

    # The state after the first token of the last step.
    p_h = state + slot * stride_state_slot + i_hv * V * K + o_v[:, None] * K + o_k[None, :]
    b_h = tl.load(p_h, mask=mask_h, other=0).to(tl.float32)

    # The last step's accepted tokens after its first, from the rows.
    p_rk = buf_kv + buf_slot * stride_kv_slot + i_h * K + o_k
    p_rv = buf_kv + buf_slot * stride_kv_slot + H * K + i_hv * V + o_v
    p_rg = buf_gb + buf_slot * stride_gb_slot + GB_OFF + i_hv
    b_h = _replay_rows(b_h, p_rk, p_rv, p_rg, n_rows, mask_k, mask_v, KV_ROW, HV)

    p_q = q + (bos * H + i_h) * K + o_k
    p_k = k + (bos * H + i_h) * K + o_k
    p_v = v + (bos * HV + i_hv) * V + o_v
    p_a = a + bos * HV + i_hv
    p_b = b + bos * HV + i_hv
    p_o = o + (bos * HV + i_hv) * V + o_v
    b_A_log = tl.load(A_log + i_hv)
    b_dt_bias = tl.load(dt_bias + i_hv)

    for i_t in range(0, T):
        b_q = tl.load(p_q, mask=mask_k, other=0).to(tl.float32)
        b_k = tl.load(p_k, mask=mask_k, other=0).to(tl.float32)
        b_v = tl.load(p_v, mask=mask_v, other=0).to(tl.float32)
        b_g, b_beta = _gates(
            tl.load(p_a), tl.load(p_b), b_A_log, b_dt_bias, softplus_beta, threshold
        )
        b_q = _l2norm(b_q) * scale
        b_k = _l2norm(b_k)
        b_h = _delta_step(b_h, b_k, b_v, b_g, b_beta)
        b_o = tl.sum(b_h * b_q[None, :], 1)
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=mask_v)
        if i_t == 0:
            # The one state write of the step.
            tl.store(p_h, b_h.to(p_h.dtype.element_ty), mask=mask_h)
        p_q += H * K
        p_k += H * K
        p_v += HV * V
        p_a += HV
        p_b += HV
        p_o += HV * V


@triton.jit
def store_rows_kernel(
    A_log,
    a,
    b,
    dt_bias,
    k,
    v,
    buf_kv,
    buf_gb,
    cu_seqlens,
    state_indices,
    buf_indices,
    softplus_beta,
    threshold,
    stride_indices_seq,
    stride_buf_indices_seq,
    stride_kv_slot,
    stride_gb_slot,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BHK: tl.constexpr,
    BHVV: tl.constexpr,
    BHV: tl.constexpr,
    KV_ROW: tl.constexpr,
    GB_OFF: tl.constexpr,
):
    """Row ``i_r`` of request ``i_n``: its token ``i_r + 1`` of this step."""
    i_n, i_r = tl.program_id(0), tl.program_id(1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    if i_r + 1 >= eos - bos:
        return
    slot = tl.load(state_indices + i_n * stride_indices_seq).to(tl.int64)
    if slot <= 0:
        return
    buf_slot = tl.load(buf_indices + i_n * stride_buf_indices_seq).to(tl.int64)
    t = bos + i_r + 1
    p_row = buf_kv + buf_slot * stride_kv_slot + i_r * KV_ROW

    o_hk = tl.arange(0, BHK)
    m_hk = o_hk < H * K
    tl.store(p_row + o_hk, tl.load(k + t * H * K + o_hk, mask=m_hk), mask=m_hk)

    o_hvv = tl.arange(0, BHVV)
    m_hvv = o_hvv < HV * V
    tl.store(
        p_row + H * K + o_hvv, tl.load(v + t * HV * V + o_hvv, mask=m_hvv), mask=m_hvv
    )

    o_hv = tl.arange(0, BHV)
    m_hv = o_hv < HV
    b_g, b_beta = _gates(
        tl.load(a + t * HV + o_hv, mask=m_hv, other=0),
        tl.load(b + t * HV + o_hv, mask=m_hv, other=0),
        tl.load(A_log + o_hv, mask=m_hv, other=0),
        tl.load(dt_bias + o_hv, mask=m_hv, other=0),
        softplus_beta,
        threshold,
    )
    p_g = buf_gb + buf_slot * stride_gb_slot + GB_OFF + i_r * 2 * HV + o_hv
    tl.store(p_g, b_g, mask=m_hv)
    tl.store(p_g + HV, b_beta, mask=m_hv)


@triton.jit
def fold_kernel(
    state,
    buf_kv,
    buf_gb,
    src_indices,
    dst_indices,
    buf_indices,
    num_accepted_tokens,
    stride_state_slot,
    stride_src_seq,
    stride_dst_seq,
    stride_buf_indices_seq,
    stride_kv_slot,
    stride_gb_slot,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    KV_ROW: tl.constexpr,
    GB_OFF: tl.constexpr,
):
    """Slot ``src`` with the first ``num_accepted_tokens - 1`` rows replayed, into slot
    ``dst``. ``dst`` may be ``src``; it must not be the row buffer's slot."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    src = tl.load(src_indices + i_n * stride_src_seq).to(tl.int64)
    dst = tl.load(dst_indices + i_n * stride_dst_seq).to(tl.int64)
    if (src <= 0) | (dst <= 0):
        return
    buf_slot = tl.load(buf_indices + i_n * stride_buf_indices_seq).to(tl.int64)
    n_rows = tl.load(num_accepted_tokens + i_n).to(tl.int64) - 1

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_v[:, None] & mask_k[None, :]
    o_tile = i_hv * V * K + o_v[:, None] * K + o_k[None, :]
    b_h = tl.load(
        state + src * stride_state_slot + o_tile, mask=mask_h, other=0
    ).to(tl.float32)
    p_rk = buf_kv + buf_slot * stride_kv_slot + i_h * K + o_k
    p_rv = buf_kv + buf_slot * stride_kv_slot + H * K + i_hv * V + o_v
    p_rg = buf_gb + buf_slot * stride_gb_slot + GB_OFF + i_hv
    b_h = _replay_rows(b_h, p_rk, p_rv, p_rg, n_rows, mask_k, mask_v, KV_ROW, HV)
    p_dst = state + dst * stride_state_slot + o_tile
    tl.store(p_dst, b_h.to(p_dst.dtype.element_ty), mask=mask_h)


@dataclass(frozen=True)
class RowLayout:
    """Where the rows sit inside one state slot.

    Key and value rows first, ``kv_row`` elements of the input dtype each; the gate
    rows after them from float32 element ``gb_off`` of the slot, ``2 * HV`` each."""

    rows: int
    kv_row: int
    gb_off: int
    bytes_used: int


def row_layout(
    H: int, HV: int, K: int, V: int, rows: int, in_dtype: torch.dtype, slot_bytes: int
) -> RowLayout:
    kv_row = H * K + HV * V
    in_size = torch.empty(0, dtype=in_dtype).element_size()
    kv_bytes = rows * kv_row * in_size
    gb_byte_off = (kv_bytes + 15) // 16 * 16
    bytes_used = gb_byte_off + rows * 2 * HV * 4
    if bytes_used > slot_bytes:
        raise ValueError(
            f"{rows} rows take {bytes_used} bytes; a state slot has {slot_bytes}"
        )
    return RowLayout(rows, kv_row, gb_byte_off // 4, bytes_used)


def buffer_views(state: torch.Tensor, in_dtype: torch.dtype):
    """The state tensor's memory seen as the input dtype and as float32, one row a slot."""
    flat = state.flatten(1)
    return flat.view(in_dtype), flat.view(torch.float32)


def _shapes(k: torch.Tensor, v: torch.Tensor, state: torch.Tensor):
    _, _, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    assert state.shape[1:] == (HV, V, K), "the state is [slots, HV, V, K]"
    assert HV % H == 0
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 32)
    return H, HV, K, V, BK, BV


def _layout_for(state, k, rows, H, HV, K, V) -> RowLayout:
    slot_bytes = HV * V * K * state.element_size()
    return row_layout(H, HV, K, V, rows, k.dtype, slot_bytes)


def replay_verify(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    buf_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
    rows: int,
    scale: float | None = None,
    softplus_beta: float = 1.0,
    threshold: float = 20.0,
    store_rows: bool = True,
) -> torch.Tensor:
    """A verify step: outputs [1, tokens, HV, V]; slot 0 and the rows updated in place.

    ``state_indices`` is [requests, K + 1] (column 0 is read) or [requests];
    ``buf_indices`` names each request's row slot; ``rows`` is the rows a slot holds
    (K, the most drafts a step verifies)."""
    H, HV, K, V, BK, BV = _shapes(k, v, state)
    assert k.shape[0] == 1, "varlen batches only, as the speculative caller passes"
    N = len(cu_seqlens) - 1
    if scale is None:
        scale = K**-0.5
    layout = _layout_for(state, k, rows, H, HV, K, V)
    buf_kv, buf_gb = buffer_views(state, k.dtype)
    q, k, v, a, b = (x.contiguous() for x in (q, k, v, a, b))
    o = q.new_empty(1, q.shape[1], HV, V)
    NV = triton.cdiv(V, BV)
    replay_verify_kernel[(NV, N * HV)](
        A_log,
        a,
        b,
        dt_bias,
        q,
        k,
        v,
        o,
        state,
        buf_kv,
        buf_gb,
        cu_seqlens,
        state_indices,
        buf_indices,
        num_accepted_tokens,
        scale,
        softplus_beta,
        threshold,
        state.stride(0),
        state_indices.stride(0),
        buf_indices.stride(0),
        buf_kv.stride(0),
        buf_gb.stride(0),
        H=H,
        HV=HV,
        K=K,
        V=V,
        BK=BK,
        BV=BV,
        KV_ROW=layout.kv_row,
        GB_OFF=layout.gb_off,
        num_warps=4,
        num_stages=3,
    )
    if store_rows and rows > 0:
        store_rows_kernel[(N, rows)](
            A_log,
            a,
            b,
            dt_bias,
            k,
            v,
            buf_kv,
            buf_gb,
            cu_seqlens,
            state_indices,
            buf_indices,
            softplus_beta,
            threshold,
            state_indices.stride(0),
            buf_indices.stride(0),
            buf_kv.stride(0),
            buf_gb.stride(0),
            H=H,
            HV=HV,
            K=K,
            V=V,
            BHK=triton.next_power_of_2(H * K),
            BHVV=triton.next_power_of_2(HV * V),
            BHV=triton.next_power_of_2(HV),
            KV_ROW=layout.kv_row,
            GB_OFF=layout.gb_off,
            num_warps=4,
        )
    return o


def fold(
    state: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    buf_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
    in_dtype: torch.dtype,
    H: int,
    rows: int,
) -> None:
    """Write each request's state after its last accepted token into ``dst_indices``."""
    _, HV, V, K = state.shape
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 32)
    slot_bytes = HV * V * K * state.element_size()
    layout = row_layout(H, HV, K, V, rows, in_dtype, slot_bytes)
    buf_kv, buf_gb = buffer_views(state, in_dtype)
    N = src_indices.shape[0]
    fold_kernel[(triton.cdiv(V, BV), N * HV)](
        state,
        buf_kv,
        buf_gb,
        src_indices,
        dst_indices,
        buf_indices,
        num_accepted_tokens,
        state.stride(0),
        src_indices.stride(0),
        dst_indices.stride(0),
        buf_indices.stride(0),
        buf_kv.stride(0),
        buf_gb.stride(0),
        H=H,
        HV=HV,
        K=K,
        V=V,
        BK=BK,
        BV=BV,
        KV_ROW=layout.kv_row,
        GB_OFF=layout.gb_off,
        num_warps=4,
    )
