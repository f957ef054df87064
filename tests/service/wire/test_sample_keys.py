"""The keys of keyed sampling (service/wire/sample_keys.py; the rows' keys: tests/service/engine/vllm/test_row_keys.py)
and the batch seed's way to its groups (api.seeded_groups): deterministic, distinct where they must be, the whole
int64 range."""

from __future__ import annotations

import pytest

from das.service.wire.api import GroupRequest, RolloutRequest, seeded_groups
from das.service.wire.sample_keys import GOLDEN, INT64_MAX, INT64_MIN, MASK64, derive, fresh_seed, mix64


def test_children_are_deterministic_distinct_and_int64():
    for parent in (0, 1, -1, INT64_MIN, INT64_MAX, 123456789):
        children = [derive(parent, i) for i in range(5000)]
        assert children == [derive(parent, i) for i in range(5000)]
        assert len(set(children)) == 5000
        assert all(INT64_MIN <= c <= INT64_MAX for c in children)
    assert derive(0, 0) != derive(1, 0)  # the parent matters, not only the index


def test_derive_is_splitmix64_of_the_parent_plus_the_golden_step_in_int64():
    # the mix of one known word (SplitMix64's published first output for seed 0 is mix64(GOLDEN))
    assert mix64(GOLDEN) == 0xE220A8397B1DCDAF
    assert derive(0, 0) == mix64(GOLDEN) - 2**64  # above INT64_MAX: read back as a negative int64
    assert derive(-1, 1) & MASK64 == mix64((2 * GOLDEN - 1) & MASK64)  # -1 is the word 2**64 - 1


def test_fresh_seeds_differ_and_fit_int64():
    seeds = {fresh_seed() for _ in range(100)}
    assert len(seeds) == 100 and all(INT64_MIN <= s <= INT64_MAX for s in seeds)


def test_a_batch_seed_fills_missing_group_seeds_by_position():
    groups = [GroupRequest(problem_id="a", prompt="x"), GroupRequest(problem_id="b", prompt="y",
                                                                       sampling={"seed": 5}),
              GroupRequest(problem_id="c", prompt="z")]
    seeded = seeded_groups(groups, 11)
    assert [g.sampling.seed for g in seeded] == [derive(11, 0), 5, derive(11, 2)]
    assert seeded_groups(groups, 11) == seeded and seeded_groups(groups, 12)[0].sampling.seed != derive(11, 0)
    assert [g.problem_id for g in seeded] == ["a", "b", "c"] and groups[0].sampling.seed is None  # copies


@pytest.mark.parametrize("field", ["seed"])
def test_seeds_outside_int64_are_refused(field):
    with pytest.raises(ValueError, match=field):
        RolloutRequest(groups=[GroupRequest(problem_id="a", prompt="x")], seed=INT64_MAX + 1)
    with pytest.raises(ValueError, match=field):
        GroupRequest(problem_id="a", prompt="x", sampling={"seed": INT64_MIN - 1})
