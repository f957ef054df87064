import numpy as np
import pytest

from das.scheduler.budget import BatchState, DraftPlan, OptimalPolicy, geometric_acceptance
from das.scheduler.cost_model import CostModel
from das.scheduler.exploration import EXPLORE_SHARE, EXPLORE_UNRATIONED_DRAFTS, Exploration


def _state(remaining, c_base=44e-3, c_tok=0.49e-3, c_spec=0.0, k_max=8):
    """A batch whose acceptance measured near zero: the optimum drafts nothing, which would also stop measuring."""
    n = len(remaining)
    return BatchState(np.asarray(remaining, float), geometric_acceptance(0.01, n, max(k_max, 1)), c_base, c_tok, k_max,
                      c_spec_s=c_spec)


def test_unmeasured_requests_get_a_k_max_draft_with_no_floor_the_others_keep_their_plan():
    state = _state(np.full(4, 300.0))
    for per_token in (False, True):
        plain = OptimalPolicy("token" if per_token else "lengths").plan(state)
        assert plain.lengths.tolist() == [0, 0, 0, 0]
        unmeasured = np.array([True, False, True, False])
        exploration = Exploration(share=0.5)  # credit for everyone at once
        plan = exploration.apply(plain, state, unmeasured)
        assert plan.lengths.tolist() == [8, 0, 8, 0] and plan.lengths.dtype == np.int32
        assert plan.min_prob[unmeasured].tolist() == [0.0, 0.0]
        assert plan.min_prob[~unmeasured].tolist() == plain.min_prob[~unmeasured].tolist()
        assert exploration.tokens == 16


def test_requests_already_drafting_nothing_to_measure_or_no_drafts_possible_leave_the_plan_alone():
    state = _state(np.full(4, 300.0))
    drafting = DraftPlan(np.array([2, 3, 1, 4], np.int32), np.zeros(4))
    assert Exploration(share=0.5).apply(drafting, state, np.ones(4, bool)) is drafting
    plain = DraftPlan(np.zeros(4, np.int32), np.zeros(4))
    assert Exploration(share=0.5).apply(plain, state, None) is plain
    assert Exploration(share=0.5).apply(plain, _state(np.full(4, 300.0), k_max=0), np.ones(4, bool)) is plain
    assert Exploration(share=0.0).apply(plain, state, np.ones(4, bool)) is plain


def test_the_longest_remaining_explore_first_and_the_others_follow_once_measured():
    remaining = np.array([100.0, 900.0, 300.0, 700.0, 500.0])
    # a compute-bound engine: one token is ~1/13 of a step, so the credit pays a grant of 8 every ~90 steps
    state = _state(remaining, c_base=75e-3, c_tok=5.85e-3)
    plain = DraftPlan(np.zeros(5, np.int32), np.zeros(5))
    unmeasured = np.ones(5, bool)
    exploration = Exploration()
    order = []
    for _ in range(600):
        plan = exploration.apply(plain, state, unmeasured)
        for i in np.flatnonzero(plan.lengths):
            order.append(int(i))
            unmeasured[i] = False  # measured: leaves the pool
    assert order == [1, 3, 4, 2, 0]


@pytest.mark.parametrize("seed", range(10))
def test_exploration_spends_at_most_its_share_of_the_estimated_time(seed):
    rng = np.random.default_rng(seed)
    exploration = Exploration()
    c_base, c_tok, c_spec = 75e-3 * rng.uniform(0.2, 2), 5.85e-3 * rng.uniform(0.01, 2), float(rng.uniform(0, 0.05))
    total_s = spent_s = 0.0
    for _ in range(500):
        n = int(rng.integers(1, 64))
        state = _state(rng.lognormal(5, 1, n), c_base=c_base, c_tok=c_tok, c_spec=c_spec)
        lengths = np.where(rng.random(n) < 0.1, rng.integers(1, 4, n), 0).astype(np.int32)
        plain = DraftPlan(lengths, np.zeros(n))
        plan = exploration.apply(plain, state, rng.random(n) < 0.5)
        extra = int(plan.lengths.sum() - lengths.sum())
        step_s = c_base + c_tok * (n + lengths.sum()) + (c_spec if lengths.any() else 0.0)
        total_s += step_s
        if extra:
            spent_s += c_tok * extra + (0.0 if lengths.any() else c_spec)
    assert exploration.tokens > 0
    # the credit never goes negative, and it is capped at one entry plus a token or a few steps' share
    assert spent_s <= EXPLORE_SHARE * total_s + 1e-12


def test_a_plain_step_explores_only_once_the_credit_also_pays_the_drafted_step_price():
    state = _state(np.full(32, 200.0), c_base=40e-3, c_tok=0.5e-3, c_spec=0.2)
    plain = DraftPlan(np.zeros(32, np.int32), np.zeros(32))
    exploration = Exploration()
    steps_until = next(i for i in range(4000) if exploration.apply(plain, state, np.ones(32, bool)).lengths.any())
    # share 0.5% of a 56 ms step a step: the 200 ms entry price and a 4 ms grant take ~730 steps of credit
    assert 650 <= steps_until <= 800
    # in a tail step whose share is below one grant's cost, exploration still comes (never stops for good): the
    # credit's cap is never below one grant's price, so the 8 x 5.85 ms are paid after ~120 steps of 0.4 ms
    tail = _state(np.array([50.0]), c_base=75e-3, c_tok=5.85e-3)
    exploration = Exploration()
    assert any(exploration.apply(DraftPlan(np.zeros(1, np.int32), np.zeros(1)), tail, np.ones(1, bool)).lengths.any()
               for _ in range(150))


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError, match="share"):
        Exploration(share=1.5)
    with pytest.raises(ValueError, match="burst"):
        Exploration(burst=0.5)


def test_until_the_engine_has_measured_enough_drafts_every_unmeasured_request_explores():
    state = _state(np.full(6, 300.0), c_base=75e-3, c_tok=5.85e-3)
    plain = DraftPlan(np.zeros(6, np.int32), np.full(6, 0.4))
    unmeasured = np.array([True, True, False, True, True, True])
    exploration = Exploration()
    plan = exploration.apply(plain, state, unmeasured, measured_drafts=10)
    assert plan.lengths.tolist() == [1, 1, 0, 1, 1, 1] and plan.min_prob.tolist() == [0.0, 0.0, 0.4, 0.0, 0.0, 0.0]
    assert exploration.credit_s == 0.0  # unrationed exploring neither earns nor spends credit
    rationed = exploration.apply(plain, state, unmeasured, measured_drafts=EXPLORE_UNRATIONED_DRAFTS)
    assert not rationed.lengths.any()  # one step's 0.5% of ~110 ms buys no grant of 8 x 5.85 ms yet


def test_accepted_exploration_tokens_are_refunded_so_drafts_that_hold_keep_being_measured():
    """A compute-bound engine (a token ~1/17 of a step, a drafted step 4 ms dearer) whose explored tokens are all
    accepted: refunded the price of a plainly decoded token each, exploration keeps measuring every few steps;
    rejected, the credit pays a grant of 8 tokens about every 80 steps."""
    state = _state(np.full(8, 300.0), c_base=38e-3, c_tok=2.2e-3, c_spec=4e-3)
    plain = DraftPlan(np.zeros(8, np.int32), np.zeros(8))
    granted = {}
    for refunded in (True, False):
        exploration = Exploration()  # measured_drafts left at inf: past the engine's unrationed start
        for _ in range(200):
            plan = exploration.apply(plain, state, np.ones(8, bool))
            assert plan.explored is not None or not plan.lengths.any()
            if plan.lengths.any():
                assert plan.explored.tolist() == (plan.lengths > 0).tolist()
            if refunded:
                exploration.refund(int(plan.lengths.sum()), CostModel("t", state.c_base_s, state.c_tok_s, "test"), 8)
        granted[refunded] = exploration.tokens
    assert 0 < granted[False] <= 24 and granted[True] >= 4 * granted[False]
