"""The draft budget policies: the step model's optimum against a brute-force minimisation, its edge cases, the
baselines, the acceptance estimator and the input checks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from das.scheduler.budget import (
    BatchState,
    BudgetPolicy,
    ClassPolicy,
    DraftPlan,
    OptimalPolicy,
    UniformPolicy,
    estimate_drafter_params,
    geometric_acceptance,
    solve_budget,
)

# SmolLM2-360M's step costs on the 2-core CPU, live fit (seconds): where the exponential model this replaced
# bought K = 3 for drafts that always hold
SMOLLM2 = dict(c_base_s=0.047, c_tok_s=0.0026, c_spec_s=0.012)


def batch(remaining, ratio=0.8, c_base_s=0.02, c_tok_s=2e-4, k_max=8, c_spec_s=0.0, positions=None) -> BatchState:
    rem = np.asarray(remaining, dtype=float)
    return BatchState(rem, geometric_acceptance(ratio, rem.size, positions or max(k_max, 1)), c_base_s, c_tok_s,
                      k_max, c_spec_s=c_spec_s)


def random_batch(rng: np.random.Generator, n: int, k_max: int = 8, c_spec_s: float = 0.0) -> BatchState:
    acceptance = np.minimum.accumulate(rng.uniform(0.0, 1.0, (n, k_max)) ** rng.uniform(0.2, 3.0), axis=1)
    return BatchState(rng.lognormal(5, 1, n), acceptance, 10 ** rng.uniform(-3, -1), 10 ** rng.uniform(-6, -3),
                      k_max, c_spec_s=c_spec_s)


def passes(b: BatchState, k: np.ndarray) -> np.ndarray:
    """T_iK_i = l_i / (1 + q_i1 + ... + q_iK_i): the passes request i needs at draft length K_i."""
    f = 1.0 + np.concatenate([np.zeros((len(b), 1)), b.acceptance.cumsum(axis=1)], axis=1)
    return b.remaining / f[np.arange(len(b)), k]


def cost(b: BatchState, k: np.ndarray) -> float:
    """The model's cost of draft lengths k (c_tok sum_i l_i, paid whatever k is, left out)."""
    k = np.asarray(k)
    if not k.any():
        return b.c_base_s * float(b.remaining.max())
    t = passes(b, k)
    return (b.c_base_s + b.c_spec_s) * float(t.max()) + b.c_tok_s * float((k * t).sum())


def exact_cost(b: BatchState, k: np.ndarray) -> float:
    """The exact token term's cost of draft lengths k: only the drafts expected to be rejected pay c_tok."""
    k = np.asarray(k)
    if not k.any():
        return b.c_base_s * float(b.remaining.max())
    t = passes(b, k)
    accepted = np.concatenate([np.zeros((len(b), 1)), b.acceptance.cumsum(axis=1)], axis=1)[np.arange(len(b)), k]
    return (b.c_base_s + b.c_spec_s) * float(t.max()) + b.c_tok_s * float((t * (k - accepted)).sum())


# --- the optimum ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(12))
def test_matches_brute_force_over_every_draft_length(seed):
    rng = np.random.default_rng(seed)
    for _ in range(25):
        n, k_max = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        b = random_batch(rng, n, k_max, c_spec_s=float(rng.choice([0.0, 10 ** rng.uniform(-4, -1)])))
        best = min(cost(b, np.array(k)) for k in itertools.product(range(k_max + 1), repeat=n))
        s = solve_budget(b)
        assert cost(b, s.draft_lengths) == pytest.approx(best, rel=1e-9)
        drafting = s.draft_lengths > 0
        if drafting.any():
            assert s.n_forward == pytest.approx(passes(b, s.draft_lengths).max(), rel=1e-12)
            np.testing.assert_allclose(s.proposed, s.draft_lengths * passes(b, s.draft_lengths), rtol=1e-12)
        else:
            assert s.n_forward == b.remaining.max() and not s.proposed.any()


def test_drafts_that_always_hold_reach_k_max():
    """The case the exponential saturation got wrong: 8 requests of 200 tokens, every draft accepted, SmolLM2's
    CPU costs. K_max = 8 takes 200 / 9 passes; the exponential model bought K = 3."""
    for ratio in (1.0, 0.99):
        s = solve_budget(batch([200.0] * 8, ratio=ratio, **SMOLLM2))
        assert s.draft_lengths.tolist() == [8] * 8
    assert solve_budget(batch([200.0] * 8, ratio=1.0, **SMOLLM2)).n_forward == pytest.approx(200 / 9)


def test_drafts_that_never_hold_are_not_proposed():
    b = BatchState(np.full(4, 500.0), np.zeros((4, 8)), 0.05, 1e-4, 8)
    assert not solve_budget(b).draft_lengths.any()


def test_the_longest_requests_draft_first():
    """A full batch of poor drafters at a compute-bound cost: only the one that decides the makespan drafts."""
    s = solve_budget(batch([100.0] * 63 + [400.0], ratio=0.4, **SMOLLM2))
    assert s.draft_lengths[:63].tolist() == [0] * 63 and s.draft_lengths[63] > 0
    assert not solve_budget(batch([300.0] * 64, ratio=0.4, **SMOLLM2)).draft_lengths.any()


def test_longer_remaining_never_gets_fewer_drafts():
    rng = np.random.default_rng(2)
    for _ in range(200):
        n = int(rng.integers(2, 40))
        q = geometric_acceptance(float(rng.uniform(0.1, 1.0)), n, 8)
        b = BatchState(rng.lognormal(5, 1, n), q, 10 ** rng.uniform(-3, -1), 10 ** rng.uniform(-6, -3), 8)
        order = b.remaining.argsort()
        assert np.all(np.diff(solve_budget(b).draft_lengths[order]) >= 0)


def test_order_of_requests_does_not_matter():
    rng = np.random.default_rng(4)
    for _ in range(50):
        b = random_batch(rng, int(rng.integers(1, 30)))
        perm = rng.permutation(len(b))
        shuffled = BatchState(b.remaining[perm], b.acceptance[perm], b.c_base_s, b.c_tok_s, b.k_max)
        np.testing.assert_array_equal(solve_budget(shuffled).draft_lengths, solve_budget(b).draft_lengths[perm])


def test_free_drafts_reach_the_shortest_makespan_with_the_fewest_drafts():
    b = batch([900.0, 300.0, 10.0], ratio=0.7, c_tok_s=0.0, k_max=8)
    s = solve_budget(b)
    assert s.n_forward == pytest.approx(passes(b, np.full(3, 8)).max())
    for i, k in enumerate(s.draft_lengths):
        fewer = s.draft_lengths.copy()
        fewer[i] = k - 1
        assert k == 0 or passes(b, fewer)[i] > s.n_forward  # one draft token less would miss N
    assert s.marginal.tolist() == [0.0 if k else np.inf for k in s.draft_lengths]


@pytest.mark.parametrize("kwargs", [dict(c_base_s=0.0), dict(k_max=0)])
def test_no_drafts_when_forwards_are_free_or_drafts_impossible(kwargs):
    s = solve_budget(batch([100.0, 900.0], **kwargs))
    assert s.draft_lengths.tolist() == [0, 0] and s.n_forward == 900.0 and s.marginal.tolist() == [np.inf] * 2


def test_empty_and_finished_batches():
    assert solve_budget(batch([])).draft_lengths.shape == (0,)
    s = solve_budget(batch([0.0, 0.0]))
    assert s.draft_lengths.tolist() == [0, 0] and s.n_forward == 0.0


def test_draft_lengths_stop_at_the_measured_positions():
    s = solve_budget(batch([5000.0], ratio=1.0, c_base_s=0.05, c_tok_s=1e-5, k_max=16, positions=3))
    assert s.draft_lengths.tolist() == [3]


@pytest.mark.parametrize("seed", range(6))
def test_the_exact_token_term_matches_brute_force_too(seed):
    rng = np.random.default_rng(100 + seed)
    for _ in range(25):
        n, k_max = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        b = random_batch(rng, n, k_max, c_spec_s=float(rng.choice([0.0, 10 ** rng.uniform(-4, -1)])))
        best = min(exact_cost(b, np.array(k)) for k in itertools.product(range(k_max + 1), repeat=n))
        assert exact_cost(b, solve_budget(b, exact_tokens=True).draft_lengths) == pytest.approx(best, rel=1e-9)


def test_the_exact_token_term_drafts_where_the_charged_one_calls_it_a_loss():
    """Ten equal agent turns (docs/results/2026-11-28-agent-time.md): c_base 34 ms, c_tok 2.3 ms, a drafted step 5.9 ms
    dearer, acceptance 0.75 a position. Charged in full, drafting K = 2 looks 5% dearer than none; counted exactly
    it is 17% cheaper."""
    b = batch([200.0] * 10, ratio=0.75, c_base_s=0.034, c_tok_s=0.0023, c_spec_s=0.0059)
    assert not solve_budget(b).draft_lengths.any()
    exact = solve_budget(b, exact_tokens=True).draft_lengths
    assert (exact >= 2).all()
    assert OptimalPolicy("lengths", exact_tokens=True).draft_lengths(b).tolist() == exact.tolist()
    assert OptimalPolicy("token", exact_tokens=True).name == "das-token-exact"


def test_a_drafted_step_price_keeps_marginal_drafts_out():
    """Drafts that would pay with drafted steps free do not when each drafted step costs more than they save."""
    free = solve_budget(batch([200.0] * 8, ratio=0.7, c_base_s=0.047, c_tok_s=0.0026))
    priced = solve_budget(batch([200.0] * 8, ratio=0.7, c_base_s=0.047, c_tok_s=0.0026, c_spec_s=0.03))
    assert free.draft_lengths.any() and not priced.draft_lengths.any()


def test_marginal_is_the_last_tokens_modeled_acceptance():
    rng = np.random.default_rng(3)
    for _ in range(50):
        b = random_batch(rng, int(rng.integers(1, 40)))
        s = solve_budget(b)
        on = s.draft_lengths > 0
        rows = np.flatnonzero(on)
        np.testing.assert_array_equal(s.marginal[rows], b.acceptance[rows, s.draft_lengths[rows] - 1])
        assert np.all(s.marginal[~on] == np.inf)


def test_plan_per_token_and_by_lengths():
    b = batch([20.0] * 15 + [900.0], ratio=0.6, c_base_s=6e-3, c_tok_s=3e-5, k_max=16)
    s = solve_budget(b)
    per_token = OptimalPolicy("token").plan(b)
    assert per_token.lengths.tolist() == [16 if k > 0 else 0 for k in s.draft_lengths]
    np.testing.assert_array_equal(per_token.min_prob, s.marginal)
    by_lengths = OptimalPolicy("lengths").plan(b)
    np.testing.assert_array_equal(by_lengths.lengths, s.draft_lengths)
    assert by_lengths.min_prob.tolist() == [0.0] * 16 and OptimalPolicy("token").name == "das-token"
    for policy in (UniformPolicy(4), ClassPolicy()):
        plan = policy.plan(b)
        np.testing.assert_array_equal(plan.lengths, policy.draft_lengths(b))
        assert plan.min_prob.tolist() == [0.0] * 16


def test_confidence_prices_each_draft_token_by_the_requests_that_must_advance_with_it():
    b = batch([400.0, 190.0, 190.0, 0.0], ratio=0.6, c_base_s=30e-3, c_tok_s=2e-3, k_max=8, c_spec_s=4e-3)
    plan = OptimalPolicy("confidence").plan(b)
    c_draft, saved = 2e-3 + 4e-3 / 8, 30e-3  # a pass saved saves its fixed part: the others' tokens are computed anyway
    assert plan.lengths.tolist() == [8, 8, 8, 0]  # a request with nothing left drafts nothing
    # the longest alone decides the batch's end (the others are predicted under half its length): its tokens are
    # worth a whole pass's fixed part; the two tied ones (m = 3 requests at least as long) save a step only if they end
    # last, which one pulling ahead with its drafts makes less likely: c_base / (2m - 1)
    np.testing.assert_allclose(plan.min_prob[:3], [c_draft / (c_draft + saved)] + [c_draft / (c_draft + saved / 5)] * 2)
    np.testing.assert_allclose(plan.value[:3], [saved, saved / 5, saved / 5])
    assert plan.min_prob[3] == np.inf and plan.explored is None
    many = OptimalPolicy("confidence").plan(batch([300.0] * 64, c_base_s=30e-3, c_tok_s=2e-3, k_max=8))
    assert np.all(many.min_prob > 0.8)  # 64 equally long on a per-token-bound step: only near-certain drafts pay
    # the regime: the same batch where a pass is mostly fixed cost (a GPU's 7B step) drafts far less likely tokens
    gpu = OptimalPolicy("confidence").plan(batch([300.0] * 64, c_base_s=7.6e-3, c_tok_s=31.5e-6, k_max=8))
    assert np.all(gpu.min_prob < 0.4)
    # a step's per-token work is no part of the value: twenty more short requests (a dearer step) leave the longest
    # one's floor where it was
    wide = OptimalPolicy("confidence").plan(batch([400.0, 190.0, 190.0] + [50.0] * 20, ratio=0.6, c_base_s=30e-3,
                                                     c_tok_s=2e-3, k_max=8, c_spec_s=4e-3))
    assert wide.min_prob[0] == pytest.approx(plan.min_prob[0])
    near = OptimalPolicy("confidence").plan(batch([400.0, 210.0], c_base_s=30e-3, c_tok_s=2e-3, k_max=8))
    assert near.min_prob[0] == near.min_prob[1]  # within a factor of two: either may end last
    # the counts play no part: a request whose measured acceptance is nil is priced the same
    cold = BatchState(b.remaining, np.zeros((4, 8)), b.c_base_s, b.c_tok_s, 8, b.c_spec_s)
    np.testing.assert_array_equal(OptimalPolicy("confidence").plan(cold).min_prob, plan.min_prob)
    # a dearer drafted step (the guard's price rides on c_spec) raises every floor
    dear = BatchState(b.remaining, b.acceptance, b.c_base_s, b.c_tok_s, 8, c_spec_s=0.1)
    assert np.all(OptimalPolicy("confidence").plan(dear).min_prob[:3] > plan.min_prob[:3])
    assert OptimalPolicy("confidence").draft_lengths(b).tolist() == [8, 8, 8, 0]
    assert OptimalPolicy("confidence").name == "das"
    assert OptimalPolicy("confidence").plan(batch([10.0], k_max=0)).lengths.tolist() == [0]
    with pytest.raises(ValueError, match="confidence plan takes no exact_tokens"):
        OptimalPolicy("confidence", exact_tokens=True)
    with pytest.raises(ValueError, match="plan must be one of"):
        OptimalPolicy("fastest")


# --- the baselines --------------------------------------------------------------------------------------------

def test_policies_share_the_interface():
    b = batch([100.0, 5000.0, 900.0], k_max=16)
    policies = (UniformPolicy(8), ClassPolicy(), ClassPolicy(short=0), OptimalPolicy(), OptimalPolicy("lengths"))
    for policy in policies:
        assert isinstance(policy, BudgetPolicy)
        k = policy.draft_lengths(b)
        assert k.dtype == np.int32 and k.shape == (3,) and np.all((k >= 0) & (k <= 16))
    assert [UniformPolicy(4).name, ClassPolicy().name, ClassPolicy(short=0).name, OptimalPolicy().name,
            OptimalPolicy("lengths").name] == ["uniform-4", "classes", "classes-16-8-0", "das", "das-lengths"]
    np.testing.assert_array_equal(OptimalPolicy("lengths").draft_lengths(b), solve_budget(b).draft_lengths)


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



# --- acceptance estimator -------------------------------------------------------------------------------------

def test_estimator_recovers_a_geometric_drafter():
    rho, steps, depth = 0.7, 10**7, 8
    survival = rho ** np.arange(1, depth + 1)
    est = estimate_drafter_params(np.full(depth, steps), steps * survival)
    np.testing.assert_allclose(est.acceptance, survival, rtol=1e-5)
    assert est.tokens_per_step == pytest.approx(1 + survival.sum(), rel=1e-5)


def test_estimator_without_observations_returns_the_prior_and_valid_inputs():
    est = estimate_drafter_params(np.zeros((3, 16)), np.zeros((3, 16)), prior_ratio=0.5)
    np.testing.assert_allclose(est.acceptance, geometric_acceptance(0.5, 3, 16))
    zero = estimate_drafter_params(np.full((2, 4), 1e6), np.zeros((2, 4)))
    BatchState(np.ones(2), zero.acceptance, 0.01, 1e-4, 4)
    assert np.all(zero.acceptance > 0)


def test_estimator_orders_better_drafters_higher():
    proposed = np.full((2, 4), 1000.0)
    accepted = np.array([[900, 800, 700, 600], [300, 100, 30, 10]], dtype=float)
    est = estimate_drafter_params(proposed, accepted)
    assert est.tokens_per_step[0] > est.tokens_per_step[1]


@pytest.mark.parametrize("proposed, accepted, kwargs", [
    (np.ones(3), np.ones(4), {}),
    (np.ones((2, 2, 2)), np.ones((2, 2, 2)), {}),
    (np.ones(0), np.ones(0), {}),
    (np.ones(3), np.full(3, 2.0), {}),
    (np.ones(3), np.full(3, -1.0), {}),
    (np.full(3, np.nan), np.ones(3), {}),
    (np.ones(3), np.ones(3), dict(prior_ratio=1.0)),
    (np.ones(3), np.ones(3), dict(prior_steps=0.0)),
    (np.ones(3), np.ones(3), dict(prior_q=np.array([0.5, 0.0, 0.5]))),
])
def test_estimator_rejects_bad_counts(proposed, accepted, kwargs):
    with pytest.raises(ValueError):
        estimate_drafter_params(proposed, accepted, **kwargs)


# --- input checks ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(remaining=[-1.0, 5.0]), "remaining must be finite and >= 0"),
    (dict(remaining=[np.nan, 5.0]), "remaining must be finite"),
    (dict(remaining=[np.inf, 5.0]), "remaining must be finite"),
    (dict(acceptance=[[1.5, 0.5], [0.5, 0.5]]), r"probabilities in \[0, 1\]"),
    (dict(acceptance=[[-0.1, 0.0], [0.5, 0.5]]), r"probabilities in \[0, 1\]"),
    (dict(acceptance=[[np.nan, 0.5], [0.5, 0.5]]), r"probabilities in \[0, 1\]"),
    (dict(acceptance=[[0.5, 0.5]]), r"shape \(n, J\)"),
    (dict(acceptance=[0.5, 0.5]), r"shape \(n, J\)"),
    (dict(acceptance=np.zeros((2, 0))), r"J >= 1"),
    (dict(remaining=[[1.0, 2.0]]), "1-D"),
    (dict(remaining=3.0), "1-D"),
    (dict(remaining=["a", "b"]), "numeric"),
    (dict(k_max=-1), "k_max must be >= 0"),
    (dict(k_max=2.5), "k_max must be an integer"),
    (dict(k_max=True), "bool"),
    (dict(c_base_s=-0.1), "c_base_s must be finite and >= 0"),
    (dict(c_tok_s=np.nan), "c_tok_s must be finite"),
    (dict(c_tok_s="x"), "c_tok_s must be a number"),
    (dict(c_spec_s=-1.0), "c_spec_s must be finite and >= 0"),
    (dict(c_base_s=0.0, c_tok_s=0.0), "cannot both be 0"),
])
def test_bad_batch_states_are_rejected(kwargs, match):
    args = dict(remaining=[10.0, 5.0], acceptance=[[0.5, 0.25], [0.5, 0.25]], c_base_s=0.01, c_tok_s=1e-4,
                k_max=8)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        BatchState(**args)


def test_batch_state_is_frozen_owns_its_arrays_and_keeps_acceptance_nonincreasing():
    rem = np.array([10.0, 20.0])
    q = np.array([[0.5, 0.7, 0.2], [0.9, 0.9, 0.95]])
    b = BatchState(rem, q, 0.01, 1e-4, np.int64(8))
    rem[0] = 99.0
    q[0, 0] = 0.0
    assert b.remaining[0] == 10.0 and b.k_max == 8 and isinstance(b.k_max, int) and len(b) == 2
    # a longer accepted prefix cannot be likelier than a shorter one
    assert b.acceptance.tolist() == [[0.5, 0.5, 0.2], [0.9, 0.9, 0.9]]
    with pytest.raises(ValueError):
        b.remaining[0] = 1.0
    with pytest.raises(ValueError):
        b.acceptance[0, 0] = 1.0
    with pytest.raises(AttributeError):
        b.k_max = 3  # type: ignore[misc]


def test_a_step_pays_its_fixed_price_only_where_its_drafts_expected_saving_covers_it():
    plan = DraftPlan(np.array([4, 4], np.int32), np.zeros(2), value=np.array([1.0, 0.5]), token_s=0.1, step_s=0.5)
    offsets = np.array([0, 2, 3])
    # request 0's two tokens, request 1's one: 0.9 (1 + 0.1) + 0.5 (1 + 0.1) + 0.8 (0.5 + 0.1) - 3 x 0.1 = 1.72 s
    probs = np.array([0.9, 0.5, 0.8], np.float32)
    assert plan.pays(probs, offsets)
    assert DraftPlan(plan.lengths, plan.min_prob, value=plan.value, token_s=0.1, step_s=1.7).pays(probs, offsets)
    assert not DraftPlan(plan.lengths, plan.min_prob, value=plan.value, token_s=0.1, step_s=1.75).pays(probs, offsets)
    # no price (the fixed baselines' plans), no fixed price, or no drafts: nothing to weigh
    assert DraftPlan(plan.lengths, plan.min_prob).pays(probs, offsets)
    assert DraftPlan(plan.lengths, plan.min_prob, value=plan.value, token_s=0.1).pays(probs, offsets)
    assert plan.pays(np.zeros(0, np.float32), np.array([0, 0, 0]))
    # the confidence plan prices its step: the drafted step's fixed price, a token's cost, each request's value
    b = batch([400.0, 190.0], c_base_s=30e-3, c_tok_s=2e-3, k_max=8, c_spec_s=4e-3)
    priced = OptimalPolicy().plan(b)
    assert priced.step_s == pytest.approx(4e-3) and priced.token_s == pytest.approx(2e-3)
    np.testing.assert_allclose(priced.value, [30e-3, 30e-3 / 3])  # the shorter one is tied with the longest: 2m - 1 = 3
