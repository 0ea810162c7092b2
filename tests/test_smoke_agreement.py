"""The reference comparison's counts: shards add up to what one process counts."""

from __future__ import annotations

import json
import random

from tooling.smoke.serving.agreement import Tally, shard_prompts, with_tolerance


def _proposals(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        drafts = [rng.randrange(5) for _ in range(3)]
        ours = [d if rng.random() < 0.7 else rng.randrange(5) for d in drafts]
        pairs = zip(drafts, ours, strict=True)
        gaps = [0.0 if d == o else rng.choice([0.004, 0.2, 1.5]) for d, o in pairs]
        out.append(
            {
                "prompt": i % 7,
                "group": "sequential" if i % 7 < 2 else "concurrent",
                "drafts": drafts,
                "ours": ours,
                "gaps": gaps,
                "accepted": (rng.randrange(4), rng.randrange(4)),
            }
        )
    return out


def _tally(proposals: list[dict]) -> Tally:
    """What a child counts over ``proposals``: each prompt's layer distances once, one
    skipped proposal per prompt, a second per proposal."""
    t = Tally(context="engine", tie_tolerance=2**-7, expected_layers=[2, 4], device="cpu")
    for p in proposals:
        t.record(p["group"], p["drafts"], p["ours"], p["gaps"], p["accepted"])
        t.other.add(p["drafts"], p["drafts"][:1] + p["ours"][1:])
        t.seconds["drafter"] = t.seconds.get("drafter", 0.0) + 1.0
    for prompt in sorted({p["prompt"] for p in proposals}):
        t.distances.absorb([[prompt, 1.0, 9.0 - prompt], [1.0, 8.0 - prompt, 2.0]], [10.0] * 3)
        t.skipped["no_context"] += 1
    return t


def test_shards_merged_give_the_one_process_result() -> None:
    proposals = _proposals(0, 120)
    whole = _tally(proposals)
    parts = [
        _tally([p for p in proposals if p["prompt"] in shard])
        for shard in shard_prompts({i: 1 for i in range(7)}, 3)
    ]
    # Through JSON, as the children hand them over.
    merged = Tally.merged([Tally.from_json(json.loads(json.dumps(t.to_json()))) for t in parts])
    a, b = merged.result(), whole.result()
    assert a["mismatches"] > 10 and 0 < a["agreement"] < 1
    assert a["agreement"] != a["exact_agreement"]  # the 0.004 margins are within 2^-7
    assert set(a["group_agreement"]) == {"sequential", "concurrent"}
    assert a["feature_layers"]["nearest"] == [1, 0]
    assert a["skipped"] == {"no_context": 7, "bonus_mismatch": 0}
    assert a == b  # seconds included: the work summed over the shards
    assert sorted(merged.mismatches) == sorted(whole.mismatches)


def test_a_result_gated_again_counts_the_mismatches_within_the_new_tolerance() -> None:
    """The runner gates at the plain noise the run measured, known only after the
    comparison: the figures must equal what the child would have counted at it."""
    proposals = _proposals(2, 90)
    floor = _tally(proposals).result()
    wide = _tally(proposals)
    wide.tie_tolerance = 0.25
    regated = with_tolerance(floor, 0.25)
    assert regated == wide.result()
    margins = floor["mismatch_detail"]
    assert regated["tolerated"] == sum(1 for m in margins if m[2] <= 0.25) > floor["tolerated"]
    assert regated["agreement"] > floor["agreement"] > floor["exact_agreement"]
    for group, rate in regated["group_agreement"].items():
        assert rate >= floor["group_agreement"][group]
    # A tolerance of 0 tolerates nothing, exact ties included: the exact figures.
    exact = with_tolerance(floor, 0.0)
    assert exact["agreement"] == floor["exact_agreement"]
    assert exact["group_agreement"] == floor["group_exact_agreement"]


def test_an_empty_shard_adds_nothing() -> None:
    one = _tally(_proposals(1, 30))
    empty = Tally(context="engine", tie_tolerance=2**-7, expected_layers=[2, 4], device="cpu")
    merged = Tally.merged([empty, one]).result()
    assert merged == one.result()
    assert merged["compared_tokens"] == 90


def test_shards_keep_prompts_whole_and_balance_proposals() -> None:
    counts = {0: 50, 1: 40, 2: 30, 3: 20, 4: 10, 5: 10}
    plan = shard_prompts(counts, 3)
    assert sorted(i for shard in plan for i in shard) == list(counts)
    loads = [sum(counts[i] for i in shard) for shard in plan]
    assert max(loads) - min(loads) <= 10
    assert all(shard == sorted(shard) for shard in plan)
    # Fewer prompts than shards: no empty shard is planned.
    assert shard_prompts({7: 3}, 4) == [[7]]
    assert shard_prompts({}, 4) == []
