"""The slot audit's arithmetic on crafted block tables, and the load client's own logic."""

from __future__ import annotations

from tooling.smoke import checks, load
from tooling.smoke.serving.slotaudit import SlotAudit, audit_first_pass, boundary_prompt_length

BLOCK = 16


def _slots(blocks_by_position: list[tuple[int, int]]) -> list[int]:
    # (block id, offset) -> slot, as the DFlash kernel computes it.
    return [b * BLOCK + o for b, o in blocks_by_position]


def test_slots_in_own_blocks_pass() -> None:
    owners = {"a": [3, 4], "b": [5, 7, 9]}
    # Two rows of K+1 = 4 query slots; row a crosses from block 3 into 4, row b's
    # last slot is the first of its block 9 (position 32, its third block).
    slots = _slots([(3, 14), (3, 15), (4, 0), (4, 1), (7, 13), (7, 14), (7, 15), (9, 0)])
    positions = [14, 15, 16, 17, 29, 30, 31, 32]
    audit = audit_first_pass(slots, positions, ["a", "b"], owners, BLOCK)
    assert (audit.slots, audit.outside, audit.other_live, audit.boundary_rows) == (8, 0, 0, 1)
    result = checks.check_slot_audit(audit.to_json())
    assert result.status == checks.PASS
    assert "1 rows ending on a block's first slot" in result.evidence


def test_no_row_ending_on_a_block_boundary_is_no_verdict() -> None:
    # Every slot in its own block, but no row's last slot opens a block: a K-slot
    # reservation (stock vLLM) would pass the same passes.
    owners = {"a": [3, 4]}
    slots = _slots([(3, 14), (3, 15), (4, 0), (4, 1)])
    audit = audit_first_pass(slots, [14, 15, 16, 17], ["a"], owners, BLOCK)
    assert (audit.outside, audit.boundary_rows) == (0, 0)
    result = checks.check_slot_audit(audit.to_json())
    assert result.status == checks.ERROR
    assert "no audited row ended on a block's first slot" in result.evidence
    assert "\n" not in result.evidence
    unserved = {"length": None, "block_size": 480, "not_served": "no room"}
    result = checks.check_slot_audit(audit.to_json(), unserved)
    assert (
        result.status == checks.ERROR and "(boundary prompt not served: no room)" in result.evidence
    )
    # A padded last slot is no write, so no boundary either.
    padded = audit_first_pass([*slots[:3], -1], [13, 14, 15, 16], ["a"], owners, BLOCK)
    assert padded.boundary_rows == 0


def test_unreserved_lookahead_into_a_stale_row_is_counted() -> None:
    # Request a's first prefill reserved one block (3); its lookahead spills past
    # it and the stale block-table tail points at block 7, which b owns, and at
    # the null block.
    owners = {"a": [3], "b": [7]}
    slots = [*_slots([(3, 15), (7, 0), (0, 1), (0, 2)]), -1, -1, -1, -1]
    audit = audit_first_pass(slots, list(range(8)), ["a", "b"], owners, BLOCK)
    assert audit.slots == 4  # padding slots are not writes
    assert audit.outside == 3
    assert audit.other_live == 1
    assert audit.null_block == 2
    assert audit.examples[0]["owned_by"] == ["b"]
    result = checks.check_slot_audit(audit.to_json())
    assert result.status == checks.FAIL
    assert "3 of 4" in result.evidence and "1 into another live" in result.evidence


def test_a_slot_in_another_of_the_requests_own_blocks_is_counted() -> None:
    # Request a owns blocks 3 and 5. Its lookahead's last slot (position 32, a third block
    # it was not given) reads a stale block-table entry that names block 3, its own first
    # block: the write lands in a block it owns, over the keys of positions 0..15.
    owners = {"a": [3, 5]}
    slots = _slots([(5, 13), (5, 14), (5, 15), (3, 0)])
    audit = audit_first_pass(slots, [29, 30, 31, 32], ["a"], owners, BLOCK)
    assert (audit.slots, audit.outside, audit.misplaced, audit.boundary_rows) == (4, 0, 1, 1)
    assert audit.examples == [
        {
            "request": "a",
            "position": 32,
            "slot": 48,
            "block": 3,
            "expected": None,
            "owned": [3, 5],
            "owned_by": [],
        }
    ]
    result = checks.check_slot_audit(audit.to_json())
    assert result.status == checks.FAIL
    assert "1 in another of its own blocks" in result.evidence
    # The same slots where the request's blocks lie in that order pass.
    fine = audit_first_pass(
        _slots([(5, 13), (5, 14), (5, 15), (3, 0)]),
        [29, 30, 31, 32],
        ["a"],
        {"a": [1, 5, 3]},
        BLOCK,
    )
    assert (fine.outside, fine.misplaced) == (0, 0)
    assert SlotAudit.from_json(audit.to_json()) == audit


def test_manager_blocks_larger_than_kernel_blocks() -> None:
    # Hybrid: manager block 2 of 64 tokens holds kernel blocks 8..11 of 16 tokens.
    owners = {"a": [2]}
    slots = [11 * 16 + 15, 12 * 16]  # last token of manager block 2, then block 3
    audit = audit_first_pass(slots, [0, 1], ["a"], owners, 64)
    assert (audit.slots, audit.outside) == (2, 1)


def test_audits_add_up_and_nothing_audited_is_an_error() -> None:
    total = SlotAudit()
    total.add(audit_first_pass([0], [0], ["x"], {}, BLOCK))
    assert total.unknown_rows == 1 and total.slots == 0 and total.boundary_rows == 0
    assert checks.check_slot_audit(total.to_json()).status == checks.ERROR
    total.add(audit_first_pass([3 * BLOCK], [BLOCK], ["a"], {"a": [2, 3]}, BLOCK))
    total.add(audit_first_pass([4 * BLOCK], [2 * BLOCK], ["a"], {"a": [2, 3, 4]}, BLOCK))
    assert (total.passes, total.slots, total.boundary_rows) == (3, 2, 2)
    assert SlotAudit.from_json(total.to_json()) == total


def test_boundary_prompt_ends_its_first_pass_on_a_block_s_first_slot() -> None:
    # The seed-shaped hybrid pair's blocks at K=15, and a tiny pair's.
    assert boundary_prompt_length(480, 15, 64, 2048) == 465
    assert boundary_prompt_length(16, 3, 40, 1024) == 13
    # K >= B: the first m with m*B > K.
    assert boundary_prompt_length(16, 16, 40, 1024) == 16
    assert boundary_prompt_length(16, 20, 40, 1024) == 12
    assert boundary_prompt_length(4, 15, 40, 1024) == 1
    for block, k in ((480, 15), (16, 3), (16, 16), (4, 15), (7, 5)):
        length = boundary_prompt_length(block, k, 0, 10**6)
        assert length is not None and length >= 1 and (length + k) % block == 0
        assert length - block < 1  # the smallest such length
    # The prompt and its new tokens must fit max_model_len.
    assert boundary_prompt_length(480, 15, 35, 500) == 465
    assert boundary_prompt_length(480, 15, 36, 500) is None
    assert boundary_prompt_length(480, 15, 64, 400) is None


def test_load_items_are_distinct_shared_prefix_prompts() -> None:
    base = list(range(100, 300))
    items = load.load_items(base, 64, seed=2, vocab=(10, 1000))
    assert len({i.prompt for i in items}) == 64
    for n, item in enumerate(items):
        length = load.PREFIX_LENGTHS[n % len(load.PREFIX_LENGTHS)]
        assert list(item.prompt[:length]) == base[:length]
        assert load.OUTPUT_TOKENS[0] <= item.max_tokens <= load.OUTPUT_TOKENS[1]
    assert len({i.max_tokens for i in items}) > 10
    assert items == load.load_items(base, 64, seed=2, vocab=(10, 1000))


def test_percentiles_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert load.percentile(values, 50) == 50.0
    assert load.percentile(values, 99) == 99.0
    assert load.percentile([3.0], 99) == 3.0
    assert load.percentile([], 50) is None


def _burst(failed: int, cached: int, tps: float) -> dict:
    return {
        "requests": 64,
        "failed": failed,
        "tokens_per_s": tps,
        "p50_latency_s": 0.1,
        "p99_latency_s": 0.3,
        "cached_tokens": cached,
    }


def test_load_verdicts() -> None:
    plain = {"first": _burst(0, 10, 50), "measured": _burst(0, 3000, 900)}
    good = {"first": _burst(0, 10, 40), "measured": _burst(0, 3000, 1500), "acceptance_length": 2.1}
    assert checks.check_load(good, plain).status == checks.PASS
    dropped = {"first": _burst(0, 10, 40), "measured": _burst(0, 2900, 1500)}
    assert checks.check_load(dropped, plain).status == checks.FAIL
    failing = {"first": _burst(1, 10, 40), "measured": _burst(0, 3000, 1500)}
    assert checks.check_load(failing, plain).status == checks.FAIL
    assert "1 failed" in checks.check_load(failing, plain).evidence


def test_warm_cache_verdict_uses_run_b_and_its_captured_layers() -> None:
    good = {"agreement": 0.998, "feature_layers": {"nearest": [2, 4, 6]}}
    stale = {"agreement": 0.995, "feature_layers": {"nearest": [1, 3, 5]}}
    broken = {"agreement": 0.483}
    runs = {"A": broken, "B": good, "C": good}
    assert checks.check_warm_cache(runs, 0.99, (2, 4, 6)).status == checks.PASS
    runs["B"] = stale  # drafter right, features of the other build's layers
    assert checks.check_warm_cache(runs, 0.99, (2, 4, 6)).status == checks.FAIL
    runs["B"] = broken
    result = checks.check_warm_cache(runs, 0.99, (2, 4, 6))
    assert result.status == checks.FAIL and "B 48.3%" in result.evidence
    assert checks.check_warm_cache({"A": broken}, 0.99, (2, 4, 6)).status == checks.ERROR


def test_aux_layers_fail_when_the_drafter_got_other_layers() -> None:
    result = checks.check_aux_layers((2, 4, 6), (2, 4, 6), "log", captured=(1, 3, 5))
    assert result.status == checks.FAIL and "HF layers (1, 3, 5)" in result.evidence
    assert checks.check_aux_layers((2, 4, 6), (2, 4, 6), "log", captured=(2, 4, 6)).passed
