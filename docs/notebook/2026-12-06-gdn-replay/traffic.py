"""Bytes of Gated DeltaNet recurrent state a verify step moves, stock against replay.

Pure arithmetic: a model, not a measurement. Milliseconds are bytes over
HBM_BYTES_PER_S, the H200's peak bandwidth: a lower bound that no kernel reaches.

Per layer and request, for a step of T = K + 1 tokens of which n are accepted:

- stock 0.20.1 (fused_sigmoid_gating_delta_rule_update, speculative path): reads one
  state and writes T states;
- replay (replay_kernel.py): reads one state and writes one; reads n - 1 rows of the
  last step and writes T - 1 rows of this one; the row writer reads those T - 1 tokens'
  k, v, a and b again from the step's activations;
- plain decoding (one token, no drafts): reads one state and writes one.

A state is value heads x value dim x key dim elements of the state dtype. A row is the
key heads' keys and the value heads' values in the input dtype, and g and beta for each
value head in float32. The inputs q, k, v, a, b and the output, which both paths read and
write once, are left out.

Run: python3 traffic.py
"""

from dataclasses import dataclass

HBM_BYTES_PER_S = 4.8e12
GB = 1e9


@dataclass(frozen=True)
class Geometry:
    name: str
    layers: int
    key_heads: int
    value_heads: int
    head_k: int
    head_v: int
    state_bytes: int
    input_bytes: int = 2

    @property
    def state(self) -> int:
        return self.value_heads * self.head_v * self.head_k * self.state_bytes

    @property
    def row(self) -> int:
        kv = (self.key_heads * self.head_k + self.value_heads * self.head_v) * self.input_bytes
        return kv + 2 * self.value_heads * 4

    @property
    def row_inputs(self) -> int:
        """k, v, a and b of one token, as the row writer reads them."""
        return (
            self.key_heads * self.head_k
            + self.value_heads * self.head_v
            + 2 * self.value_heads
        ) * self.input_bytes


def stock_bytes(g: Geometry, requests: int, K: int) -> int:
    T = K + 1
    return g.layers * requests * (g.state + T * g.state)


def replay_bytes(g: Geometry, requests: int, K: int, accepted: int) -> dict[str, int]:
    T = K + 1
    state = g.layers * requests * 2 * g.state
    rows = g.layers * requests * ((accepted - 1) * g.row + (T - 1) * (g.row + g.row_inputs))
    return {"state": state, "rows": rows, "total": state + rows}


def plain_bytes(g: Geometry, requests: int) -> int:
    return g.layers * requests * 2 * g.state


def ms(nbytes: float) -> float:
    return nbytes / HBM_BYTES_PER_S * 1e3


def table(g: Geometry, requests_list, ks) -> str:
    lines = [
        f"### {g.name}: {g.layers} GDN layers, {g.key_heads} key / {g.value_heads} value "
        f"heads, head dims {g.head_k}/{g.head_v}, state {g.state_bytes * 8}-bit "
        f"({g.state / 2**20:.2f} MiB a request a layer), row {g.row / 1024:.1f} KiB",
        "",
        "Bytes a step over all GDN layers; ms = bytes / 4.8 TB/s (model, lower bound). "
        "Replay counts every token accepted (n = T), its most rows read.",
        "",
        "| requests | K | stock GB | stock ms | replay GB (state + rows) | replay ms "
        "| stock / replay | plain decode GB | plain ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in requests_list:
        for K in ks:
            s = stock_bytes(g, r, K)
            rp = replay_bytes(g, r, K, accepted=K + 1)
            p = plain_bytes(g, r)
            lines.append(
                f"| {r} | {K} | {s / GB:.2f} | {ms(s):.3f} | {rp['total'] / GB:.3f} "
                f"({rp['state'] / GB:.3f} + {rp['rows'] / GB:.3f}) | {ms(rp['total']):.3f} "
                f"| {s / rp['total']:.1f}x | {p / GB:.3f} | {ms(p):.3f} |"
            )
    fit = [K for K in ks if K * g.row <= g.state]
    lines.append("")
    lines.append(
        f"The K rows fit in one spare slot for K in {fit} "
        f"(up to K = {g.state // g.row} rows a slot)."
    )
    return "\n".join(lines)


TRAINED = Geometry("trained pair (Qwen3.5 GDN shapes)", 18, 16, 48, 128, 128, 2)
QWEN36_FP32 = Geometry("Qwen3.6-27B, state float32", 48, 16, 48, 128, 128, 4)
QWEN36_BF16 = Geometry("Qwen3.6-27B, state bf16", 48, 16, 48, 128, 128, 2)


def main() -> None:
    print(table(TRAINED, [1, 16, 64], [15, 7, 3]))
    print()
    print(table(QWEN36_FP32, [1, 8, 32], [15, 7, 3]))
    print()
    print(table(QWEN36_BF16, [1, 8, 32], [15]))
    print()
    # What the K + 1 slots a request hold, and what replay needs of them (slot 0 and
    # the rows' slot). vLLM allocates whole pages (conv state beside the recurrent
    # state); this counts the recurrent state alone.
    for g, r, K in ((TRAINED, 64, 15), (QWEN36_FP32, 32, 15)):
        held = g.layers * r * (K + 1) * g.state
        used = g.layers * r * 2 * g.state
        print(
            f"{g.name}, {r} requests, K = {K}: recurrent state held {held / 2**30:.1f} GiB, "
            f"replay uses {used / 2**30:.1f} GiB of it"
        )
    print()
    # Replay's bytes at a lower acceptance: only the rows read change.
    g, r, K = TRAINED, 64, 15
    for n in (1, 5, 16):
        rp = replay_bytes(g, r, K, n)
        print(
            f"trained pair, 64 requests, K = 15, {n} accepted a step: replay "
            f"{rp['total'] / GB:.3f} GB, {ms(rp['total']):.3f} ms"
        )


if __name__ == "__main__":
    main()
