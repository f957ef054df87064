"""The draft budget policies: the closed form against KKT and a brute-force minimisation, its edge cases, the
baselines, the acceptance estimator and the input checks."""

from __future__ import annotations

import time

import numpy as np
import pytest

from das.scheduler.budget import (
    BatchState,
    BudgetPolicy,
    ClassPolicy,
    OptimalPolicy,
    UniformPolicy,
    estimate_drafter_params,
    solve_budget,
)

NO_CAP = 10**9  # a K_max that never binds, to test the uncapped model


def batch(remaining, capacity=0.8, efficiency=1.0, c_base_s=0.02, c_tok_s=2e-4, k_max=NO_CAP) -> BatchState:
    rem = np.asarray(remaining, dtype=float)
    return BatchState(remaining=rem, capacity=np.broadcast_to(capacity, rem.shape),
                      efficiency=np.broadcast_to(efficiency, rem.shape), c_base_s=c_base_s, c_tok_s=c_tok_s,
                      k_max=k_max)


def random_batch(rng: np.random.Generator, n: int, k_max: int = NO_CAP) -> BatchState:
    return BatchState(remaining=rng.lognormal(7, 1, n), capacity=rng.uniform(0.2, 1.0, n),
                      efficiency=rng.uniform(0.3, 3.0, n), c_base_s=10 ** rng.uniform(-3, -1),
                      c_tok_s=10 ** rng.uniform(-6, -3), k_max=k_max)


def g(n_fwd: float, b: BatchState) -> float:
    """sum_{l_i > N} 1 / (a_i (k_i - 1 + N / l_i)), written as in the corrected stationarity condition."""
    l, k, a = b.remaining, b.capacity, b.efficiency
    m = l > n_fwd
    return float(np.sum(1.0 / (a[m] * (k[m] - 1.0 + n_fwd / l[m]))))


def passes_needed(p: np.ndarray, b: BatchState) -> np.ndarray:
    """l_i (1 - k_i + k_i exp(-a_i p_i / l_i)): forward passes request i needs when it proposes p_i tokens."""
    l, k, a = b.remaining, b.capacity, b.efficiency
    return l * (1.0 - k + k * np.exp(-a * p / l))


def cost(n_fwd: float, p: np.ndarray, b: BatchState) -> float:
    return b.c_base_s * n_fwd + b.c_tok_s * float(p.sum())


# --- the closed form ------------------------------------------------------------------------------------------

def test_kkt_conditions_hold_on_random_batches():
    rng = np.random.default_rng(0)
    kinks = 0
    for _ in range(300):
        b = random_batch(rng, int(rng.integers(1, 300)))
        s = solve_budget(b)
        n_fwd, p, l = s.n_forward, s.proposed, b.remaining
        r = b.c_base_s / b.c_tok_s
        assert not s.cap_binding
        assert np.all(p >= 0) and np.all(p[l <= n_fwd] == 0)
        long = l > n_fwd
        # primal feasibility, tight for every request that drafts: it ends exactly at N
        np.testing.assert_allclose(passes_needed(p[long], _subset(b, long)), n_fwd, rtol=1e-9)
        assert np.all(passes_needed(p, b) <= n_fwd * (1 + 1e-9))
        # stationarity c_base = c_tok g(N), or a kink at some l_j where g jumps over c_base / c_tok
        if np.isclose(g(n_fwd, b), r, rtol=1e-6):
            continue
        kinks += 1
        assert np.any(np.isclose(l, n_fwd, rtol=1e-12, atol=0))
        eps = 1e-9 * n_fwd
        assert g(n_fwd + eps, b) <= r <= g(n_fwd - eps, b)
    assert 0 < kinks < 300  # both kinds of optimum were exercised


def _subset(b: BatchState, m: np.ndarray) -> BatchState:
    return BatchState(b.remaining[m], b.capacity[m], b.efficiency[m], b.c_base_s, b.c_tok_s, b.k_max)


def _brute_force(b: BatchState) -> tuple[float, float]:
    """(min cost, argmin N) by numeric minimisation that does not use the closed form: for a grid of N, each
    request's least p_i with passes_needed <= N by bisection on p_i, then the best N, zooming in 12 times
    (the cost is convex in N, so zooming around the best grid point converges). K_max: p_i <= K_max N."""
    l, k = b.remaining, b.capacity
    lo, hi = float(np.max(l * (1 - k))), float(l.max())
    best = (np.inf, hi)
    for _ in range(12):
        grid = np.linspace(lo, hi, 401)[1:]                  # N > max b_i: every p_i finite
        p_lo = np.zeros((grid.size, l.size))
        p_hi = np.full_like(p_lo, 1.0)
        while True:                                          # grow p_hi until every constraint is met
            short = np.any(passes_needed(p_hi, b) > grid[:, None], axis=1)
            if not short.any():
                break
            p_hi[short] *= 2
        for _ in range(100):
            mid = 0.5 * (p_lo + p_hi)
            ok = passes_needed(mid, b) <= grid[:, None]
            p_hi = np.where(ok, mid, p_hi)
            p_lo = np.where(ok, p_lo, mid)
        p_hi[l[None, :] <= grid[:, None]] = 0.0
        costs = b.c_base_s * grid + b.c_tok_s * p_hi.sum(axis=1)
        costs[np.any(p_hi > b.k_max * grid[:, None], axis=1)] = np.inf
        i = int(np.argmin(costs))
        if costs[i] < best[0]:
            best = (float(costs[i]), float(grid[i]))
        step = grid[1] - grid[0]
        lo, hi = max(lo, grid[i] - 2 * step), min(hi, grid[i] + 2 * step)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_matches_brute_force_on_two_and_three_requests(seed):
    rng = np.random.default_rng(100 + seed)
    n = 2 + seed % 2
    k_max = NO_CAP if seed < 8 else int(rng.integers(2, 6))
    b = BatchState(remaining=rng.uniform(50, 3000, n), capacity=rng.uniform(0.3, 1.0, n),
                   efficiency=rng.uniform(0.3, 2.0, n), c_base_s=10 ** rng.uniform(-3, -1),
                   c_tok_s=10 ** rng.uniform(-5, -3), k_max=k_max)
    s = solve_budget(b)
    ours = cost(s.n_forward, s.proposed, b)
    brute, n_brute = _brute_force(b)
    assert ours <= brute * (1 + 1e-9)            # the closed form is never beaten
    assert ours == pytest.approx(brute, rel=1e-6)
    assert s.n_forward == pytest.approx(n_brute, rel=1e-3)
    assert np.all(s.proposed <= k_max * s.n_forward * (1 + 1e-9))


def test_the_printed_paper_formula_is_not_the_optimum():
    # docs/design.md notes the paper's ln(1 - k (1 - N / l)); with k < 1 it misses the constraint the model imposes.
    b = batch([2000.0, 900.0], capacity=0.6, efficiency=1.2)
    s = solve_budget(b)
    l, k, a = b.remaining, b.capacity, b.efficiency
    m = l > s.n_forward
    paper = -(l[m] / a[m]) * np.log(1 - k[m] * (1 - s.n_forward / l[m]))
    assert np.all(passes_needed(paper, _subset(b, m)) > s.n_forward * 1.01)


def test_cap_binds_at_the_smallest_feasible_forward_count():
    # one long request and a cheap forward pass: the uncapped optimum would need far more than K_max per step
    b = batch([5000.0, 3000.0, 200.0], capacity=0.8, efficiency=1.0, c_base_s=0.05, c_tok_s=1e-5, k_max=8)
    s = solve_budget(b)
    uncapped = solve_budget(batch([5000.0, 3000.0, 200.0], capacity=0.8, efficiency=1.0, c_base_s=0.05,
                                  c_tok_s=1e-5))
    assert s.cap_binding and not uncapped.cap_binding
    assert s.n_forward > uncapped.n_forward
    assert s.proposed.max() == pytest.approx(8 * s.n_forward, rel=1e-8)
    assert s.draft_lengths.tolist() == [8, int(np.rint(s.proposed[1] / s.n_forward)), 0]
    assert s.draft_lengths[1] < 8


def test_draft_lengths_are_proposals_spread_over_the_forward_passes():
    rng = np.random.default_rng(5)
    for _ in range(50):
        b = random_batch(rng, 64, k_max=int(rng.integers(1, 33)))
        s = solve_budget(b)
        expected = np.clip(np.rint(s.proposed / s.n_forward), 0, b.k_max)
        assert s.draft_lengths.dtype == np.int32
        np.testing.assert_array_equal(s.draft_lengths, expected)


def test_longer_remaining_never_gets_fewer_drafts():
    rng = np.random.default_rng(7)
    for _ in range(200):
        n = int(rng.integers(2, 200))
        b = batch(rng.lognormal(7, 1, n), capacity=rng.uniform(0.2, 1.0), efficiency=rng.uniform(0.3, 3.0),
                  c_base_s=10 ** rng.uniform(-3, -1), c_tok_s=10 ** rng.uniform(-6, -3),
                  k_max=int(rng.integers(1, 33)))
        s = solve_budget(b)
        order = np.argsort(b.remaining)
        assert np.all(np.diff(s.proposed[order]) >= -1e-9 * s.proposed.max())
        assert np.all(np.diff(s.draft_lengths[order]) >= 0)


def test_order_of_requests_does_not_matter():
    rng = np.random.default_rng(8)
    b = random_batch(rng, 100, k_max=16)
    perm = rng.permutation(100)
    shuffled = BatchState(b.remaining[perm], b.capacity[perm], b.efficiency[perm], b.c_base_s, b.c_tok_s, 16)
    a, c = solve_budget(b), solve_budget(shuffled)
    assert c.n_forward == pytest.approx(a.n_forward, rel=1e-12)
    np.testing.assert_array_equal(c.draft_lengths, a.draft_lengths[perm])


def test_cheap_forward_passes_give_every_long_request_drafts():
    # c_base >> c_tok: all requests (all longer than max l (1 - k) = 200) are sped up, the longest the most
    rem = np.linspace(500.0, 2000.0, 16)
    s = solve_budget(batch(rem, capacity=0.9, c_base_s=0.05, c_tok_s=1e-7, k_max=16))
    assert np.all(s.draft_lengths > 0)
    assert s.draft_lengths[-1] == 16 and s.draft_lengths[0] < s.draft_lengths[-1]


def test_expensive_tokens_leave_short_requests_without_drafts():
    rem = np.array([50.0, 120.0, 300.0, 800.0, 3000.0])
    s = solve_budget(batch(rem, c_base_s=0.01, c_tok_s=1e-3, k_max=16))   # r = 10 tokens
    assert s.draft_lengths[:4].tolist() == [0, 0, 0, 0]
    assert s.proposed[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert s.proposed[4] > 0 and s.draft_lengths[4] > 0
    # tokens dearer than the longest request's first drafts are worth (r < 1 / (a k)): nobody drafts
    none = solve_budget(batch(rem, c_base_s=0.01, c_tok_s=0.02, k_max=16))
    assert none.draft_lengths.tolist() == [0] * 5 and none.n_forward == 3000.0
    # and drafts grow for everyone as tokens get cheaper
    cheaper = solve_budget(batch(rem, c_base_s=0.01, c_tok_s=1e-6, k_max=16))
    assert np.all(cheaper.draft_lengths >= s.draft_lengths) and cheaper.draft_lengths.sum() > s.draft_lengths.sum()


def test_full_capacity_requests():
    # k_i = 1: b_i = 0, p_i = (l_i / a_i) ln(l_i / N)
    b = batch([1000.0, 400.0, 100.0], capacity=1.0, efficiency=0.5, c_base_s=0.01, c_tok_s=1e-4)
    s = solve_budget(b)
    m = b.remaining > s.n_forward
    np.testing.assert_allclose(s.proposed[m], (b.remaining[m] / 0.5) * np.log(b.remaining[m] / s.n_forward))
    assert np.isfinite(s.n_forward) and 0 < s.n_forward < 1000


def test_free_drafts_are_the_limit_of_cheap_drafts():
    rng = np.random.default_rng(9)
    for _ in range(20):
        b = random_batch(rng, 50, k_max=int(rng.integers(1, 20)))
        free = solve_budget(BatchState(b.remaining, b.capacity, b.efficiency, 0.01, 0.0, b.k_max))
        cheap = solve_budget(BatchState(b.remaining, b.capacity, b.efficiency, 0.01, 1e-13, b.k_max))
        assert free.cap_binding and cheap.cap_binding
        assert free.n_forward == pytest.approx(cheap.n_forward, rel=1e-6)
        assert np.abs(free.draft_lengths.astype(int) - cheap.draft_lengths).max() <= 1


@pytest.mark.parametrize("kwargs", [dict(c_base_s=0.0, c_tok_s=1e-4), dict(k_max=0), dict(c_base_s=1e-320)])
def test_no_drafts_when_forwards_are_free_or_drafts_impossible(kwargs):
    s = solve_budget(batch([100.0, 700.0, 0.0, 50.0], **kwargs))
    assert s.draft_lengths.tolist() == [0, 0, 0, 0] and s.proposed.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert s.n_forward == 700.0


def test_empty_and_finished_batches():
    assert solve_budget(batch([])).draft_lengths.shape == (0,)
    assert solve_budget(batch([0.0, 0.0])).draft_lengths.tolist() == [0, 0]
    s = solve_budget(batch([0.0, 500.0, 0.0], k_max=16))
    assert s.draft_lengths[0] == 0 and s.draft_lengths[2] == 0 and s.draft_lengths[1] > 0


def test_extreme_cost_ratios_stay_finite():
    for c_tok in (1e-300, 1e-30, 1e-12, 1.0, 1e30):
        s = solve_budget(batch([10.0, 1e6, 3.0], capacity=[1e-6, 0.99, 1.0], efficiency=[1e4, 0.01, 5.0],
                               c_base_s=1.0, c_tok_s=c_tok, k_max=16))
        assert np.isfinite(s.n_forward) and np.all(np.isfinite(s.proposed))
        assert np.all((s.draft_lengths >= 0) & (s.draft_lengths <= 16))


# --- the policies ---------------------------------------------------------------------------------------------

def test_policies_share_the_interface():
    b = batch([100.0, 5000.0, 900.0], k_max=16)
    for policy in (UniformPolicy(8), ClassPolicy(), ClassPolicy(short=0), OptimalPolicy()):
        assert isinstance(policy, BudgetPolicy)
        k = policy.draft_lengths(b)
        assert k.dtype == np.int32 and k.shape == (3,) and np.all((k >= 0) & (k <= 16))
    assert [UniformPolicy(4).name, ClassPolicy().name, ClassPolicy(short=0).name, OptimalPolicy().name] == \
        ["uniform-4", "classes", "classes-16-8-0", "das"]
    np.testing.assert_array_equal(OptimalPolicy().draft_lengths(b), solve_budget(b).draft_lengths)


def test_uniform_policy():
    b = batch([100.0, 5000.0, 0.0], k_max=6)
    assert UniformPolicy(4).draft_lengths(b).tolist() == [4, 4, 4]
    assert UniformPolicy(16).draft_lengths(b).tolist() == [6, 6, 6]     # clipped to the engine's K_max
    assert UniformPolicy(0).draft_lengths(b).tolist() == [0, 0, 0]
    for bad in (-1, 2.5, True, "4"):
        with pytest.raises(ValueError, match="integer >= 0"):
            UniformPolicy(bad)  # type: ignore[arg-type]


def test_class_policy_terciles():
    rem = np.arange(1.0, 10.0)[::-1]                                   # 9, 8, ..., 1
    b = batch(rem, k_max=16)
    assert ClassPolicy().draft_lengths(b).tolist() == [16, 16, 16, 8, 8, 8, 4, 4, 4]
    assert ClassPolicy(short=0).draft_lengths(b).tolist() == [16, 16, 16, 8, 8, 8, 0, 0, 0]
    assert ClassPolicy().draft_lengths(batch(rem, k_max=10)).tolist() == [10] * 3 + [8] * 3 + [4] * 3
    # equal lengths and a lone request are all long: few or indistinguishable requests are where drafts pay
    assert ClassPolicy().draft_lengths(batch([300.0] * 4, k_max=16)).tolist() == [16] * 4
    assert ClassPolicy().draft_lengths(batch([7.0], k_max=16)).tolist() == [16]
    assert ClassPolicy().draft_lengths(batch([], k_max=16)).shape == (0,)


def test_class_policy_fixed_thresholds():
    p = ClassPolicy(thresholds=(1000, 4000))
    assert p.name == "classes-16-8-4"
    assert p.draft_lengths(batch([10.0, 999.0, 1000.0, 3999.0, 4000.0, 9e4], k_max=16)).tolist() == \
        [4, 4, 8, 8, 16, 16]
    for bad in dict(long=-1), dict(medium=1.5), dict(short=True), dict(thresholds=(5, 1)), \
            dict(thresholds=(-1, 5)), dict(thresholds=(0, np.inf)), dict(thresholds=(1, 2, 3)), \
            dict(thresholds=("a", 2)):
        with pytest.raises(ValueError, match="ClassPolicy"):
            ClassPolicy(**bad)  # type: ignore[arg-type]


def test_optimal_policy_cost_per_call_is_bounded():
    # A guard against algorithmic regressions (e.g. an O(n^2) solver), not the benchmark quoted in the module:
    # the figures there are 27-80 us; 2 ms leaves room for a heavily loaded test machine.
    rng = np.random.default_rng(11)
    b = random_batch(rng, 256, k_max=16)
    policy = OptimalPolicy()
    times = []
    for _ in range(300):
        t0 = time.perf_counter()
        policy.draft_lengths(b)
        times.append(time.perf_counter() - t0)
    assert float(np.median(times)) < 2e-3


# --- acceptance estimator -------------------------------------------------------------------------------------

def test_estimator_recovers_a_geometric_drafter():
    rho, steps, depth = 0.7, 10**7, 8
    survival = rho ** np.arange(1, depth + 1)
    est = estimate_drafter_params(np.full(depth, steps), steps * survival)
    e = survival.sum()
    assert est.capacity == pytest.approx(e / (1 + e), rel=1e-5)
    assert est.efficiency * est.capacity == pytest.approx(rho, rel=1e-5)   # k a = first-position acceptance


def test_estimator_without_observations_returns_the_prior_and_valid_inputs():
    est = estimate_drafter_params(np.zeros((3, 16)), np.zeros((3, 16)), prior_capacity=0.5)
    e = (0.5 ** np.arange(1, 17)).sum()
    np.testing.assert_allclose(est.capacity, e / (1 + e))
    np.testing.assert_allclose(est.efficiency * est.capacity, 0.5)
    # nothing ever accepted: still strictly inside the model's domain
    zero = estimate_drafter_params(np.full((2, 4), 1e6), np.zeros((2, 4)))
    BatchState(np.ones(2), zero.capacity, zero.efficiency, 0.01, 1e-4, 4)
    assert np.all(zero.capacity > 0) and np.all(zero.efficiency > 0)


def test_estimator_orders_better_drafters_higher():
    proposed = np.full((2, 4), 1000.0)
    accepted = np.array([[900, 800, 700, 600], [300, 100, 30, 10]], dtype=float)
    est = estimate_drafter_params(proposed, accepted)
    assert est.capacity[0] > est.capacity[1]


@pytest.mark.parametrize("proposed, accepted, kwargs", [
    (np.ones(3), np.ones(4), {}),
    (np.ones((2, 2, 2)), np.ones((2, 2, 2)), {}),
    (np.ones(0), np.ones(0), {}),
    (np.ones(3), np.full(3, 2.0), {}),
    (np.ones(3), np.full(3, -1.0), {}),
    (np.full(3, np.nan), np.ones(3), {}),
    (np.ones(3), np.ones(3), dict(prior_capacity=1.0)),
    (np.ones(3), np.ones(3), dict(prior_steps=0.0)),
])
def test_estimator_rejects_bad_counts(proposed, accepted, kwargs):
    with pytest.raises(ValueError):
        estimate_drafter_params(proposed, accepted, **kwargs)


# --- input checks ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(remaining=[-1.0, 5.0]), "remaining must be finite and >= 0"),
    (dict(remaining=[np.nan, 5.0]), "remaining must be finite"),
    (dict(remaining=[np.inf, 5.0]), "remaining must be finite"),
    (dict(capacity=[0.0, 0.5]), r"capacity must be in \(0, 1\]"),
    (dict(capacity=[1.5, 0.5]), r"capacity must be in \(0, 1\]"),
    (dict(capacity=[np.nan, 0.5]), r"capacity must be in \(0, 1\]"),
    (dict(efficiency=[0.0, 1.0]), "efficiency must be finite and > 0"),
    (dict(efficiency=[-1.0, 1.0]), "efficiency must be finite and > 0"),
    (dict(efficiency=[1e-320, 1.0]), "efficiency is too small"),
    (dict(capacity=[0.5, 0.5, 0.5]), "one shape"),
    (dict(remaining=[[1.0, 2.0]], capacity=[[0.5, 0.5]], efficiency=[[1.0, 1.0]]), "1-D"),
    (dict(remaining=3.0, capacity=0.5, efficiency=1.0), "1-D"),
    (dict(remaining=["a", "b"]), "numeric"),
    (dict(k_max=-1), "k_max must be >= 0"),
    (dict(k_max=2.5), "k_max must be an integer"),
    (dict(k_max=True), "bool"),
    (dict(c_base_s=-0.1), "c_base_s must be finite and >= 0"),
    (dict(c_tok_s=np.nan), "c_tok_s must be finite"),
    (dict(c_tok_s="x"), "c_tok_s must be a number"),
    (dict(c_base_s=0.0, c_tok_s=0.0), "cannot both be 0"),
])
def test_bad_batch_states_are_rejected(kwargs, match):
    args = dict(remaining=[10.0, 5.0], capacity=[0.5, 0.5], efficiency=[1.0, 1.0], c_base_s=0.01,
                c_tok_s=1e-4, k_max=8)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        BatchState(**args)


def test_batch_state_is_frozen_and_owns_its_arrays():
    rem = np.array([10.0, 20.0])
    b = BatchState(rem, np.array([0.5, 0.5]), np.array([1.0, 1.0]), 0.01, 1e-4, np.int64(8))
    rem[0] = 99.0
    assert b.remaining[0] == 10.0 and b.k_max == 8 and isinstance(b.k_max, int) and len(b) == 2
    with pytest.raises(ValueError):
        b.remaining[0] = 1.0
    with pytest.raises(AttributeError):
        b.k_max = 3  # type: ignore[misc]


def test_marginal_is_the_last_tokens_modeled_acceptance_and_the_token_price():
    """Uncapped: for every drafting request, marginal_i = k_i a_i exp(-a_i p_i / l_i), the modeled acceptance of
    its last proposed token, and c_tok / marginal_i (its pass's value lambda_i) sums to c_base over them (less
    when the optimum is the kink at a request's own length, which then takes the rest without drafting)."""
    rng = np.random.default_rng(3)
    for _ in range(50):
        b = random_batch(rng, int(rng.integers(1, 40)))
        s = solve_budget(b)
        on = s.proposed > 0
        l, k, a = b.remaining, b.capacity, b.efficiency
        np.testing.assert_allclose(s.marginal[on], (k * a * np.exp(-a * s.proposed / l))[on], rtol=1e-6)
        assert np.all(s.marginal[~on] == np.inf)
        if on.any():
            prices = np.sum(b.c_tok_s / s.marginal[on])
            kink = np.any(np.isclose(l, s.n_forward, rtol=1e-9))
            assert prices <= b.c_base_s * (1 + 1e-6) and (kink or prices == pytest.approx(b.c_base_s, rel=1e-6))


def test_one_request_left_is_worth_c_tok_over_c_base_per_token_whatever_the_drafter_or_cap():
    for capacity, efficiency, k_max in ((0.2, 0.5, 8), (0.95, 2.0, 8), (0.6, 1.0, NO_CAP)):
        s = solve_budget(batch([900.0], capacity=capacity, efficiency=efficiency, c_base_s=44e-3,
                               c_tok_s=0.49e-3, k_max=k_max))
        assert s.marginal[0] == pytest.approx(0.49 / 44, rel=1e-9)
    free = solve_budget(batch([900.0, 10.0], c_tok_s=0.0, k_max=8))
    assert free.marginal.tolist() == [0.0, np.inf]  # drafts free for the long one; the short one is not drafting


def test_plan_per_token_and_by_lengths():
    b = batch([20.0] * 15 + [900.0], capacity=0.6, c_base_s=6e-3, c_tok_s=3e-5, k_max=16)
    s = solve_budget(b)
    per_token = OptimalPolicy(per_token=True).plan(b)
    assert per_token.lengths.tolist() == [16 if p > 0 else 0 for p in s.proposed]
    np.testing.assert_array_equal(per_token.min_prob, s.marginal)
    by_lengths = OptimalPolicy().plan(b)
    np.testing.assert_array_equal(by_lengths.lengths, s.draft_lengths)
    assert by_lengths.min_prob.tolist() == [0.0] * 16 and OptimalPolicy(per_token=True).name == "das-token"
    for policy in (UniformPolicy(4), ClassPolicy()):
        plan = policy.plan(b)
        np.testing.assert_array_equal(plan.lengths, policy.draft_lengths(b))
        assert plan.min_prob.tolist() == [0.0] * 16


# --- the price of a drafted step ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
def test_with_a_drafted_step_price_the_optimum_drafts_only_when_it_beats_no_drafts(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 64))
    rem = rng.lognormal(5, 1, n)
    cap, eff = rng.uniform(0.2, 0.95, n), rng.uniform(0.3, 3, n)
    c_base, c_tok, c_spec = 40e-3, float(rng.uniform(0.05e-3, 2e-3)), float(rng.uniform(0, 80e-3))
    priced = solve_budget(BatchState(rem, cap, eff, c_base, c_tok, 8, c_spec_s=c_spec))
    as_base = solve_budget(BatchState(rem, cap, eff, c_base + c_spec, c_tok, 8))
    if priced.draft_lengths.any():
        # the drafted step's price is paid on every pass: the same optimum as a base cost of c_base + c_spec,
        # and cheaper than running every pass plain
        assert np.array_equal(priced.draft_lengths, as_base.draft_lengths)
        assert (c_base + c_spec) * priced.n_forward + c_tok * priced.proposed.sum() < c_base * rem.max()
    else:
        assert priced.n_forward == pytest.approx(rem.max())
        drafted_cost = (c_base + c_spec) * as_base.n_forward + c_tok * as_base.proposed.sum()
        assert not as_base.draft_lengths.any() or drafted_cost >= c_base * rem.max()
