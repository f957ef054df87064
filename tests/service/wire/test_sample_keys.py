"""The keys of keyed sampling (service/wire/sample_keys.py) and the batch seed's way to its groups
(api.seeded_groups): deterministic, distinct where they must be, the whole int64 range."""

from __future__ import annotations

import numpy as np
import pytest

from das.service.wire.api import GroupRequest, RolloutRequest, seeded_groups
from das.service.wire.sample_keys import INT64_MAX, INT64_MIN, derive, fresh_seed, row_keys


def test_children_are_deterministic_distinct_and_int64():
    for parent in (0, 1, -1, INT64_MIN, INT64_MAX, 123456789):
        children = [derive(parent, i) for i in range(5000)]
        assert children == [derive(parent, i) for i in range(5000)]
        assert len(set(children)) == 5000
        assert all(INT64_MIN <= c <= INT64_MAX for c in children)
    assert derive(0, 0) != derive(1, 0)  # the parent matters, not only the index


def test_row_keys_are_a_function_of_key_and_position_only():
    keys = np.array([derive(7, i) for i in range(4)], dtype=np.int64)
    positions = np.array([0, 5, 5, 1000], dtype=np.int64)
    together = row_keys(keys, positions)
    alone = [int(row_keys(keys[i:i + 1], positions[i:i + 1])[0]) for i in range(4)]
    assert together.dtype == np.int64 and together.tolist() == alone
    grid = row_keys(np.repeat(keys, 64), np.tile(np.arange(64), 4))
    assert len(set(grid.tolist())) == 256  # no two (sample, position) cells share a key


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
