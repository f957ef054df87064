from __future__ import annotations

import numpy as np
import pytest

from das.scheduler.budget import DrafterParams, geometric_acceptance
from das.scheduler.budget_hook import (
    GUARD_PRICES,
    BatchView,
    StepSample,
    budget_hook_from_config,
)
from das.scheduler.cost_model import GENERIC_PRIOR
from das.scheduler.length import LengthCurve
from das.scheduler.policies import BUDGETS, budget_from_config, parse_budget


def batch_view(generated: list[int], predicted: list[float | None], max_tokens: list[int],
               curves: list[LengthCurve | None] | None = None) -> BatchView:
    """A BatchView from per-request values (None: prediction unknown), each curve read at its `generated`."""
    curves = curves if curves is not None else [None] * len(generated)
    return BatchView(np.asarray(generated, np.int64), np.array([np.nan if p is None else p for p in predicted]),
                     np.asarray(max_tokens, np.int64),
                     np.array([np.nan if c is None else c.at(g) for c, g in zip(curves, generated)]))


def views(*remaining: int, max_tokens: int = 1000) -> BatchView:
    return batch_view([0] * len(remaining), [float(r) for r in remaining], [max_tokens] * len(remaining))


def test_default_is_the_confidence_budget_on_an_online_fit_from_the_generic_prior():
    hook = budget_hook_from_config({}, k_max=6)
    assert hook.name == "das" and hook.fit is not None and hook.guard is not None
    assert hook.cost == GENERIC_PRIOR
    plan = hook.plan(views(*([10] * 31), 500))
    # everyone may draft; the long one's tokens need far less confidence than the short ones'
    assert plan.lengths.tolist() == [6] * 32 and plan.min_prob[-1] < 0.1 < 0.5 < plan.min_prob[:-1].min()


def test_das_lengths_plans_k_from_acceptance_counts():
    hook = budget_hook_from_config({"plan": "lengths"}, k_max=6)
    assert hook.name == "das-lengths"
    plan = hook.plan(views(*([10] * 31), 500))
    assert plan.lengths[-1] > 0 and plan.lengths[:-1].max() == 0  # the long one drafts, the short ones not
    assert budget_hook_from_config({"plan": "token"}, k_max=6).name == "das-token"
    assert budget_hook_from_config({"exact_tokens": True}, k_max=6).name == "das-lengths-exact"


def test_uniform_k_max():
    hook = budget_hook_from_config({"policy": "uniform"}, k_max=6)
    assert hook.name == "uniform-6" and hook.guard is None  # a fixed baseline: the guard never adjusts it
    plan = hook.plan(views(10, 500))
    assert plan.lengths.tolist() == [6, 6] and plan.min_prob.tolist() == [0.0, 0.0]  # no floor: all proposed


def test_the_budget_reads_the_live_fit_each_step():
    """An engine whose steps turn out nearly free per token (memory-bound) drafts for everyone; one whose tokens
    turn out dear (compute-bound) drafts only where few requests remain, from the same prior."""
    rng = np.random.default_rng(0)
    plans = {}
    for label, (c_base, c_tok) in {"memory-bound": (20e-3, 2e-6), "compute-bound": (20e-3, 2e-3)}.items():
        hook = budget_hook_from_config({"plan": "lengths", "prior": {"name": "p", "c_base_s": 20e-3, "c_tok_s": 0.2e-3,
                                                  "source": "test"}}, k_max=8)
        for _ in range(400):
            n = int(rng.integers(8, 200))
            hook.observe(StepSample(c_base + c_tok * n, n, n, 0, 0))
        assert hook.cost.c_tok_s == pytest.approx(c_tok, rel=0.05, abs=5e-6)  # the prior said 0.2e-3
        plans[label] = hook.plan(views(*([300] * 32)), DrafterParams(geometric_acceptance(0.8, 32, 8))).lengths
    assert plans["memory-bound"].min() >= 4 and plans["compute-bound"].max() == 0


def test_a_dear_drafted_step_switches_drafting_off_where_it_would_pay_per_token():
    batch = views(*([200] * 16))
    drafter = DrafterParams(geometric_acceptance(0.5, 16, 8))
    cheap = budget_hook_from_config({"plan": "lengths", "c_base_s": 40e-3, "c_tok_s": 0.5e-3, "online": False}, k_max=8)
    dear = budget_hook_from_config({"plan": "lengths", "c_base_s": 40e-3, "c_tok_s": 0.5e-3, "c_spec_s": 200e-3, "online": False},
                                   k_max=8)
    assert cheap.plan(batch, drafter).lengths.min() > 0
    assert dear.plan(batch, drafter).lengths.max() == 0


def test_the_drafted_step_price_is_read_at_the_batch_size():
    """A price per running request: the same requests drafting pay it in a batch of 2, not in one of 64."""
    hook = budget_hook_from_config({"plan": "lengths", "c_base_s": 40e-3, "c_tok_s": 0.5e-3, "c_spec_s": 2e-3, "c_spec_req_s": 4e-3,
                                    "online": False}, k_max=8)
    tail = hook.plan(views(200, 180), DrafterParams(geometric_acceptance(0.5, 2, 8)))
    full = hook.plan(views(*([200] * 64)), DrafterParams(geometric_acceptance(0.5, 64, 8)))
    assert tail.lengths.min() > 0 and full.lengths.max() == 0


def losing(hook, steps: int = 200) -> None:
    for _ in range(steps):  # 32 requests, 64 drafts, 2 accepted, a step twice the plain one: a loss
        hook.observe(StepSample(0.11, 96, 32, 64, 2))


def test_the_guard_backs_off_while_drafted_steps_lose_and_recovers_when_they_win():
    """At the top price a batch whose drafts pay modestly drafts nothing; winning drafted steps bring it back."""
    hook = budget_hook_from_config({"plan": "lengths", "c_base_s": 40e-3, "c_tok_s": 0.5e-3, "online": False}, k_max=8)
    modest = (views(*([300] * 16)), DrafterParams(geometric_acceptance(0.6, 16, 8)))
    assert hook.plan(*modest).lengths.min() > 0
    losing(hook)
    assert hook.guard.price == GUARD_PRICES[-1]
    assert hook.plan(*modest).lengths.max() == 0
    for _ in range(200):  # 4 requests, 32 drafts, 20 accepted: a win
        hook.observe(StepSample(0.06, 36, 4, 32, 20))
    assert hook.guard.price == 0.0 and hook.plan(*modest).lengths.min() > 0
    assert hook.stats()["guard_raised"] == len(GUARD_PRICES) - 1 and hook.stats()["guard_price"] == 0.0


def test_a_raised_guard_leaves_drafts_that_always_hold_at_k_max_and_unfiltered():
    """The guard prices drafted steps; it does not filter draft tokens by the drafter's own probabilities (a
    continuation seen once is rated 1/3): drafts measured to hold ~100% still pay at the top price."""
    hook = budget_hook_from_config({"plan": "lengths", "c_base_s": 40e-3, "c_tok_s": 0.5e-3, "online": False}, k_max=8)
    losing(hook)
    plan = hook.plan(views(*([200] * 8)), DrafterParams(geometric_acceptance(0.99, 8, 8)))
    assert plan.lengths.tolist() == [8] * 8 and plan.min_prob.tolist() == [0.0] * 8


def test_the_confidence_floors_follow_the_live_fit_and_the_guard():
    """The default budget's floors: near 0 where tokens are nearly free (memory-bound), high for a batch of many
    equally long requests where they are dear (compute-bound); a guard at its top price raises every floor."""
    batch = views(*([300] * 32))
    floors = {}
    for label, c_tok in {"memory-bound": 2e-6, "compute-bound": 2e-3}.items():
        hook = budget_hook_from_config({"prior": {"name": "p", "c_base_s": 20e-3, "c_tok_s": 0.2e-3,
                                                  "source": "test"}}, k_max=8)
        for n in range(8, 200, 3):
            hook.observe(StepSample(20e-3 + c_tok * n, n, n, 0, 0))
        floors[label] = hook.plan(batch).min_prob
    assert floors["memory-bound"].max() < 0.02 and floors["compute-bound"].min() > 0.3
    hook = budget_hook_from_config({"c_base_s": 40e-3, "c_tok_s": 0.5e-3, "online": False}, k_max=8)
    calm = hook.plan(views(200, 150, 40)).min_prob
    losing(hook)
    assert hook.guard.price == GUARD_PRICES[-1]
    raised = hook.plan(views(200, 150, 40)).min_prob
    assert np.all(raised > calm + 0.05)


def test_exploration_tokens_go_out_under_a_raised_guard_so_it_can_come_down():
    """With the guard at its top price the optimum leaves new requests of poor prior acceptance without drafts:
    exploration still gives each one token at the step's real price (floor 0), or nothing is verified, no request
    gets measured and the guard (which moves on drafted steps) only comes down by relaxing."""
    hook = budget_hook_from_config({"plan": "lengths", "c_base_s": 40e-3, "c_tok_s": 0.5e-3, "online": False}, k_max=8)
    losing(hook)
    assert hook.guard.price == GUARD_PRICES[-1]
    plan = hook.plan(views(*([200] * 8)), DrafterParams(geometric_acceptance(0.05, 8, 8), np.ones(8, bool), 0.0))
    explored = plan.lengths > 0
    assert explored.all() and np.all(plan.min_prob[explored] == 0.0)
    for _ in range(hook.guard.patience):  # those steps win: once their average does, the guard comes down a level
        hook.observe(StepSample(0.06, 16, 8, 8, 8))
    assert hook.guard.price == GUARD_PRICES[-2]
    for _ in range(hook.guard.recover):  # and on, a level every few winning drafted steps
        hook.observe(StepSample(0.06, 16, 8, 8, 8))
    assert hook.guard.price == GUARD_PRICES[-3]


def test_a_guard_that_stopped_all_drafting_comes_down_to_measure_again():
    hook = budget_hook_from_config({"c_base_s": 40e-3, "c_tok_s": 0.5e-3, "online": False}, k_max=8)
    losing(hook)
    assert hook.guard.price == GUARD_PRICES[-1]
    for _ in range(hook.guard.relax - 1):  # plain steps: nothing worth drafting at the price, nothing measured
        hook.observe(StepSample(0.06, 32, 32, 0, 0))
    assert hook.guard.price == GUARD_PRICES[-1]
    hook.observe(StepSample(0.06, 32, 32, 0, 0))
    assert hook.guard.price == GUARD_PRICES[-2]
    hook.observe(StepSample(0.11, 96, 32, 64, 2))  # a drafted step restarts the count
    for _ in range(hook.guard.relax - 1):
        hook.observe(StepSample(0.06, 32, 32, 0, 0))
    assert hook.guard.price == GUARD_PRICES[-2]


def test_the_cost_warmups_probe_steps_price_a_drafted_step_without_moving_the_guard():
    """Plain and probe-drafted steps alternating at batch sizes 16..1, a drafted step dearer by 2 ms + 0.25 ms per
    request plus its token: the fit moves the price most of the way from the prior's 50 ms (the prior weighs two
    steps; its residual pull and the outlier weights of the first steps keep ~1/4 of the gap), and the guard, which
    would read a drafted step that accepted nothing as a loss, never sees them."""
    c_base, c_tok, c_spec, c_spec_req = 40e-3, 2e-3, 2e-3, 0.25e-3
    hook = budget_hook_from_config({"prior": {"name": "p", "c_base_s": c_base, "c_tok_s": c_tok, "c_spec_s": 50e-3,
                                              "source": "test"}}, k_max=8)
    for n in range(16, 0, -1):
        hook.observe(StepSample(c_base + c_tok * n, n, n, 0, 0))
        hook.observe(StepSample(c_base + c_tok * (n + 1) + c_spec + c_spec_req * n, n + 1, n, 1, 0, probe=True))
    for n in (1, 16):
        assert c_spec + c_spec_req * n < hook.cost.spec_price(n) < 0.35 * 50e-3
    assert hook.guard.gain is None and hook.guard.price == 0.0


@pytest.mark.parametrize("prior", [{"name": "x", "c_base_s": -1.0, "c_tok_s": 0.0, "source": "?"},
                                   {"name": "x", "c_base_s": float("nan"), "c_tok_s": 1.0, "source": "?"},
                                   {"c_base_s": 1.0}, "not a dict"])
def test_a_bad_prior_is_a_clear_error(prior):
    with pytest.raises(ValueError, match="prior"):
        budget_hook_from_config({"prior": prior}, k_max=8)


def test_classes_give_long_predicted_samples_more_drafts():
    hook = budget_hook_from_config({"policy": "classes", "long": 12, "medium": 6, "short": 0}, k_max=16)
    assert hook.plan(views(900, 50, 400)).lengths.tolist() == [12, 0, 6]


def test_das_policy_drafts_the_long_tail():
    lengths = budget_hook_from_config({"policy": "das", "c_base_s": 6e-3, "c_tok_s": 3e-5},
                                      k_max=16).plan(views(*([20] * 15), 900)).lengths
    assert lengths[-1] > 0 and lengths[-1] >= lengths[:-1].max()
    plan = budget_hook_from_config({"policy": "das", "c_base_s": 6e-3, "c_tok_s": 3e-5, "plan": "token"},
                                   k_max=16).plan(views(*([20] * 15), 900))
    assert plan.lengths[-1] == 16 and 0 < plan.min_prob[-1] < 1  # per token: up to K_max above a floor
    assert np.all(plan.min_prob[plan.lengths == 0] == np.inf)


def test_measured_acceptance_decides_who_drafts():
    """Per-request drafter parameters replace the hook's constants. On the CPU cost model with 48 similar
    requests, a drafter measured to be rarely right is not worth a draft token; one measured to be usually right
    is, above the same per-token floor for every request; the last request alone drafts even at 0.2."""
    hook = budget_hook_from_config({"policy": "das", "c_base_s": 44e-3, "c_tok_s": 0.49e-3, "plan": "token"},
                                   k_max=8)
    batch = views(*([300] * 48))
    weak = hook.plan(batch, DrafterParams(geometric_acceptance(0.2, 48, 8)))
    strong = hook.plan(batch, DrafterParams(geometric_acceptance(0.9, 48, 8)))
    assert weak.lengths.tolist() == [0] * 48 and np.all(weak.min_prob == np.inf)
    assert strong.lengths.tolist() == [8] * 48 and np.allclose(strong.min_prob, strong.min_prob[0])
    assert 0 < strong.min_prob[0] < 1
    alone = hook.plan(views(300), DrafterParams(geometric_acceptance(0.2, 1, 8)))
    # alone it decides the makespan: it drafts, down to the modeled acceptance of its optimal draft length
    assert alone.lengths[0] == 8 and np.isclose(alone.min_prob[0], 0.2 ** np.arange(1, 9)).any()


def test_remaining_uses_the_prediction_capped_by_max_tokens_and_at_least_one():
    assert batch_view([100, 100, 500], [400.0, None, 400.0], [300, 300, 600]).remaining().tolist() == [200, 200, 1]


@pytest.mark.parametrize("config, message", [
    ({"policy": "fastest"}, "Input tag 'fastest' found using 'policy' does not match any of the expected tags: "
                            "'das', 'uniform', 'classes'"),
    ({"policy": "uniform", "K": 3}, "K\n  Extra inputs are not permitted"),
    ({"policy": "uniform", "k": -1}, "k\n  Input should be greater than or equal to 0"),
    ({"policy": "uniform", "long": 8}, "uniform.long\n  Extra inputs are not permitted"),
    ({"policy": "classes", "exact_tokens": True}, "classes.exact_tokens\n  Extra inputs are not permitted"),
    ({"policy": "uniform", "confidence": True}, "uniform.confidence\n  Extra inputs are not permitted"),
    ({"policy": "das", "k": 4}, "das.k\n  Extra inputs are not permitted"),
    ({"policy": "das", "plan": "fast"}, "Input should be 'confidence', 'lengths' or 'token'"),
    ({"policy": "das", "plan": "confidence", "exact_tokens": True}, "confidence plan takes no exact_tokens"),
    ({"policy": "das", "confidence": True, "per_token": True}, "takes neither per_token nor exact_tokens"),
    ({"prior": {"name": "p"}, "c_base_s": 1.0}, "not both"),
    ({"c_base_s": 0.0, "c_tok_s": 0.0}, "not both 0"),
])
def test_bad_settings_are_named(config, message):
    with pytest.raises(ValueError, match=message):
        budget_hook_from_config(config, k_max=8)
    with pytest.raises(ValueError, match=message):  # the same check where the service starts
        budget_from_config(config)


def test_the_policy_names_are_one_list():
    assert [parse_budget(name).budget_policy(8).name for name in BUDGETS] == ["das", "uniform-8", "classes"]
    assert budget_hook_from_config("uniform-3", k_max=8).name == "uniform-3"  # a name is a configuration too


def test_the_guard_default_is_the_budgets_own():
    """das is guarded unless told otherwise; the fixed baselines are never adjusted unless told to be."""
    guarded = {name: budget_hook_from_config(name, k_max=8).guard is not None
               for name in ("das", "das-lengths", "das-token", "uniform", "uniform-4", "classes")}
    assert guarded == {"das": True, "das-lengths": True, "das-token": True, "uniform": False, "uniform-4": False,
                       "classes": False}
    assert budget_hook_from_config({"guard": False}, k_max=8).guard is None
    assert budget_hook_from_config({"policy": "uniform", "guard": True}, k_max=8).guard is not None


def test_empty_batch():
    assert budget_hook_from_config({"policy": "das"}, k_max=8).plan(views()).lengths.shape == (0,)
    assert np.asarray(budget_hook_from_config({}, k_max=8).plan(views()).lengths).dtype == np.int32


def test_a_length_curve_keeps_a_sample_that_outlives_its_prediction_in_the_budget():
    """Predicted 100 tokens at submission; at 150 generated a fixed prediction leaves 1 token to go, the curve
    (conditioned on having got this far) says 400 to go, and the cap still bounds both."""
    curve = LengthCurve((0, 100), (100.0, 550.0), 600, 1.0)
    both = batch_view([150, 150, 150, 700], [100.0, 100.0, None, None], [1000, 1000, 300, 2000],
                        [None, curve, curve, curve])
    # fixed, curved, curved under a cap, and the tail model: 700 * (1 + 1)
    assert both.remaining().tolist() == [1.0, 400.0, 150.0, 700.0]
    hook = budget_hook_from_config({"policy": "das", "plan": "lengths", "c_base_s": 6e-3, "c_tok_s": 3e-5}, k_max=16)
    generated, predicted, caps = [20] * 15 + [150], [40.0] * 15 + [100.0], [1000] * 16
    curved = batch_view(generated, predicted, caps, [None] * 15 + [curve])
    fixed = batch_view(generated, predicted, caps)
    assert hook.plan(curved).lengths[-1] > hook.plan(fixed).lengths[-1]


def test_only_the_counts_based_plans_read_acceptance():
    """The proposer estimates per-request acceptance every step only for a hook that reads it."""
    reads = {name: budget_hook_from_config(config, k_max=8).reads_acceptance for name, config in {
        "das": {}, "das-lengths": {"plan": "lengths"}, "das-token": {"plan": "token"},
        "uniform": {"policy": "uniform"}, "classes": {"policy": "classes"}}.items()}
    assert reads == {"das": False, "das-lengths": True, "das-token": True, "uniform": False, "classes": False}
