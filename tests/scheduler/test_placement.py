"""Placement of groups on engines: LPT against known instances, round robin, and input checks."""

from __future__ import annotations

import numpy as np
import pytest

from das.scheduler.placement import Placement, group_load, place_groups, round_robin


def _check_consistent(p: Placement, loads: np.ndarray, engines: int, existing: np.ndarray | None = None) -> None:
    """Every group on exactly one engine, orders agree with the assignment, loads add up."""
    assert p.assignment.shape == loads.shape and len(p.order) == engines
    assert sorted(np.concatenate(p.order).tolist()) == list(range(loads.size))
    for e, groups in enumerate(p.order):
        assert np.all(p.assignment[groups] == e)
    expected = np.zeros(engines) if existing is None else existing.copy()
    np.add.at(expected, p.assignment, loads)
    np.testing.assert_allclose(p.loads, expected)


def test_lpt_on_grahams_three_engine_instance():
    # Graham's tight example for 3 machines: LPT gives 11 where 9 is optimal ({5,4}, {5,4}, {3,3,3}).
    loads = np.array([3, 5, 3, 4, 5, 3, 4], dtype=float)
    p = place_groups(loads, 3)
    _check_consistent(p, loads, 3)
    # 5 -> e0, 5 -> e1, 4 -> e2, 4 -> e2 (least, 4), 3 -> e0, 3 -> e1, 3 -> e0 (8, 8, 8: lowest index)
    assert p.assignment.tolist() == [0, 0, 1, 2, 1, 0, 2]
    assert p.loads.tolist() == [11.0, 8.0, 8.0] and p.max_load == 11.0
    assert p.max_load <= (4 / 3 - 1 / 9) * 9 + 1e-12  # Graham's bound, tight here


def test_lpt_optimal_on_a_perfectly_divisible_instance():
    loads = np.array([7, 1, 6, 2, 5, 3, 4, 4], dtype=float)
    p = place_groups(loads, 4)
    assert p.loads.tolist() == [8.0, 8.0, 8.0, 8.0]


def test_inside_an_engine_groups_start_longest_first():
    rng = np.random.default_rng(3)
    loads = rng.lognormal(7, 1, 40)
    p = place_groups(loads, 3)
    for groups in p.order:
        assert np.all(np.diff(loads[groups]) <= 0)


def test_ties_are_deterministic():
    loads = np.ones(6)
    p = place_groups(loads, 3)
    assert p.assignment.tolist() == [0, 1, 2, 0, 1, 2]
    assert [o.tolist() for o in p.order] == [[0, 3], [1, 4], [2, 5]]


def test_existing_loads_are_filled_first():
    p = place_groups([4.0, 3.0, 2.0], 3, existing_loads=[10.0, 0.0, 5.0])
    _check_consistent(p, np.array([4.0, 3.0, 2.0]), 3, np.array([10.0, 0.0, 5.0]))
    # 4 -> e1 (0), 3 -> e1 (4 < 5), 2 -> e2 (5 < 7)
    assert p.assignment.tolist() == [1, 1, 2]
    assert p.loads.tolist() == [10.0, 7.0, 7.0]


def test_lpt_never_worse_than_round_robin_on_random_batches():
    # RL-sized batches: 8-256 groups with long-tailed loads on 2-16 engines, fixed seeds.
    worse = []
    for seed in range(400):
        rng = np.random.default_rng(seed)
        engines = int(rng.integers(2, 17))
        loads = rng.lognormal(7, 1, int(rng.integers(8, 257))) * rng.integers(1, 17)
        lpt, rr = place_groups(loads, engines), round_robin(loads, engines)
        _check_consistent(lpt, loads, engines)
        _check_consistent(rr, loads, engines)
        if lpt.max_load > rr.max_load * (1 + 1e-12):
            worse.append(seed)
        # LPT <= (4/3 - 1/(3E)) OPT and OPT >= max(mean load, largest group)
        lower = max(loads.sum() / engines, loads.max())
        assert lpt.max_load <= (4 / 3 - 1 / (3 * engines)) * max(lower, rr.max_load) + 1e-9
    assert worse == []


def test_round_robin_can_win_on_a_tiny_instance_but_stays_within_grahams_bound():
    loads = [2.0, 3.0, 2.0, 3.0, 2.0]
    assert round_robin(loads, 2).max_load == 6.0
    assert place_groups(loads, 2).max_load == 7.0
    assert 7.0 <= (4 / 3 - 1 / 6) * 6.0 + 1e-12


def test_round_robin_assigns_in_arrival_order():
    p = round_robin([5.0, 1.0, 1.0, 9.0, 2.0], 2)
    assert p.assignment.tolist() == [0, 1, 0, 1, 0]
    assert [o.tolist() for o in p.order] == [[0, 2, 4], [1, 3]]
    assert p.loads.tolist() == [8.0, 10.0]


def test_more_engines_than_groups_and_no_groups():
    p = place_groups([3.0, 1.0], 4)
    assert p.assignment.tolist() == [0, 1] and p.loads.tolist() == [3.0, 1.0, 0.0, 0.0]
    assert [o.tolist() for o in p.order] == [[0], [1], [], []]
    empty = place_groups([], 2, existing_loads=[1.0, 2.0])
    assert empty.assignment.size == 0 and empty.loads.tolist() == [1.0, 2.0]
    assert round_robin([], 3).loads.tolist() == [0.0, 0.0, 0.0]


def test_placement_is_frozen():
    p = place_groups([1.0], 1)
    with pytest.raises(AttributeError):
        p.loads = np.zeros(1)  # type: ignore[misc]


def test_group_load_is_the_sum_of_predicted_lengths():
    assert group_load([100.0, 250.0, 50.0]) == 400.0
    for bad in ([], [1.0, -1.0], [np.nan], [[1.0, 2.0]]):
        with pytest.raises(ValueError):
            group_load(bad)


@pytest.mark.parametrize("fn", [place_groups, round_robin])
@pytest.mark.parametrize("loads, engines, existing, match", [
    ([1.0, -2.0], 2, None, "finite and >= 0"),
    ([1.0, np.nan], 2, None, "finite and >= 0"),
    ([1.0, np.inf], 2, None, "finite and >= 0"),
    ([[1.0, 2.0]], 2, None, "1-D"),
    (["a"], 2, None, "numeric"),
    ([1.0], 0, None, "engines must be >= 1"),
    ([1.0], -3, None, "engines must be >= 1"),
    ([1.0], 2.5, None, "integer"),
    ([1.0], True, None, "bool"),
    ([1.0], 2, [0.0], "one entry per engine"),
    ([1.0], 2, [0.0, -1.0], "existing_loads must be finite"),
])
def test_bad_inputs_are_rejected(fn, loads, engines, existing, match):
    with pytest.raises(ValueError, match=match):
        fn(loads, engines, existing)
