"""The strict lossless check's prompts (``trainer/checked.py``): the places the recipe fills,
and the choice, for each, of the seeded window whose greedy completion comes nearest a tie
the fewest times. The margins are given here as the recipe's greedy runs would give them."""

from __future__ import annotations

import numpy as np
import pytest

from tooling.trainer.checked import (
    NEAR_TIE,
    CheckedPrompt,
    choose_decisive,
    engine_settings,
    lossless_slots,
)

ENGINE = engine_settings(256)


def slots(candidates: int = 4):
    stream = np.arange(5000) % 997
    return lossless_slots(stream, (3, 7), ENGINE, 8, seed=11, candidates=candidates)


def test_every_place_has_its_candidates_of_one_shape() -> None:
    places = slots()
    names = [tuple(p.name for p in s.candidates[0]) for s in places]
    assert names == [
        ("k3-len3",),
        ("k3-len4",),
        ("k3-len5",),
        ("k7-len7",),
        ("k7-len8",),
        ("k7-len9",),
        (f"chunk-tail-{ENGINE['max_num_batched_tokens'] + 1}",),
        ("prefix-a", "prefix-b", "prefix-a-again"),
        ("to-max-model-len",),
    ]
    for place in places:
        assert len(place.candidates) == 4
        # One batch per place: one prompt length, one completion length.
        shapes = {(len(p.token_ids), p.max_new_tokens) for c in place.candidates for p in c}
        assert len(shapes) == 1
        # Seeded windows, not one window four times.
        assert len({tuple(c[0].token_ids) for c in place.candidates}) > 1
    assert slots()[3].candidates == places[3].candidates  # the same seed, the same windows


def margins_by_first_token(table: dict[int, list[float]]):
    """What a greedy run would answer, keyed by each prompt's first token."""
    asked: list[list[CheckedPrompt]] = []

    def margins_of(batch: list[CheckedPrompt]) -> list[list[float]]:
        asked.append(batch)
        return [table.get(p.token_ids[0], [1.0] * p.max_new_tokens) for p in batch]

    return margins_of, asked


def test_the_candidate_nearest_a_tie_the_fewest_times_is_kept() -> None:
    place = slots()[4]  # k7-len8
    first = [c[0].token_ids[0] for c in place.candidates]
    table = {
        first[0]: [0.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0],  # one exact tie
        first[1]: [NEAR_TIE, 0.5, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0],  # one within NEAR_TIE
        first[2]: [0.25, 0.5, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0],  # none: kept
        first[3]: [0.3, 0.5, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0],  # none, a larger smallest margin
    }
    margins_of, asked = margins_by_first_token(table)
    chosen = choose_decisive([place], margins_of)
    # first[3] also has no near tie and its smallest margin is larger: it wins that tie-break.
    assert [p.token_ids for p in chosen.prompts] == [place.candidates[3][0].token_ids]
    assert chosen.near_ties == {"k7-len8": 0}
    assert chosen.margins == {"k7-len8": table[first[3]]}
    assert len(asked) == 1 and len(asked[0]) == 4  # every candidate in one batch


def test_the_prefix_place_counts_both_completions_and_keeps_its_repeat() -> None:
    place = slots()[7]
    a = [c[0].token_ids[0] for c in place.candidates]
    # prefix-a and prefix-b start alike (b shares a's prefix), so both rows come from one key:
    # a candidate's two completions are scored together.
    table = {a[0]: [0.0] * 8, a[1]: [1.0] * 8, a[2]: [0.0] * 8, a[3]: [1.0] * 8}
    margins_of, asked = margins_by_first_token(table)
    chosen = choose_decisive([place], margins_of)
    assert [p.name for p in chosen.prompts] == ["prefix-a", "prefix-b", "prefix-a-again"]
    assert chosen.prompts[0].token_ids == place.candidates[1][0].token_ids
    assert chosen.prompts[2].token_ids == chosen.prompts[0].token_ids
    # The repeat is one completion: asked once per candidate, reported once.
    assert len(asked[0]) == 2 * 4
    assert set(chosen.margins) == {"prefix-a", "prefix-b"}


def test_when_every_candidate_has_ties_the_fewest_win_and_are_counted() -> None:
    place = slots()[8]  # to-max-model-len
    new = place.candidates[0][0].max_new_tokens
    first = [c[0].token_ids[0] for c in place.candidates]
    table = {f: [0.0] * (3 - i % 3) + [1.0] * (new - 3 + i % 3) for i, f in enumerate(first)}
    margins_of, _ = margins_by_first_token(table)
    chosen = choose_decisive([place], margins_of)
    assert chosen.near_ties == {"to-max-model-len": 1}
    assert chosen.prompts[0].token_ids == place.candidates[2][0].token_ids


@pytest.mark.parametrize("count", [1, 16])
def test_the_choice_keeps_the_places_order(count: int) -> None:
    places = slots(count)
    margins_of, asked = margins_by_first_token({})
    chosen = choose_decisive(places, margins_of)
    assert [p.name for p in chosen.prompts] == [p.name for s in places for p in s.candidates[0]]
    assert len(asked) == len(places)
