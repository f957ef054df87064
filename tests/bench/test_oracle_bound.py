"""The bound on a batch's decode time at K + 1 tokens a step, priced by a measured step cost."""

from __future__ import annotations

import pytest

from das.bench.oracle_bound import Bound, StepPrice, batch_bound, engine_bound
from das.service.engine.vllm.step_profile import StepProfile

PRICE = StepPrice(base_s=0.010, per_token_s=0.001, source="test", spec_s=0.002, spec_req_s=0.0005)


def test_one_sample_needs_ceil_length_over_k_plus_one_steps_each_priced_by_its_shape() -> None:
    bound = engine_bound([10], 4, PRICE)  # steps of 5, 5 tokens
    assert bound.steps == 2
    assert bound.seconds == pytest.approx(2 * (0.010 + 0.005 + 0.002 + 0.0005))


def test_the_batch_shrinks_as_samples_end_and_a_last_single_token_step_drafts_nothing() -> None:
    # K = 3: sample 9 -> 4, 4, 1 tokens; sample 4 -> 4; sample 0 runs no step
    bound = engine_bound([9, 4, 0], 3, PRICE)
    step1 = 0.010 + 0.001 * 8 + 0.002 + 0.0005 * 2
    step2 = 0.010 + 0.001 * 4 + 0.002 + 0.0005 * 1
    step3 = 0.010 + 0.001 * 1  # one token a request: no draft to verify
    assert bound.steps == 3 and bound.seconds == pytest.approx(step1 + step2 + step3)


def test_k_zero_is_plain_decoding_and_the_slowest_engine_bounds_the_batch() -> None:
    plain = engine_bound([3, 2], 0, PRICE)
    assert plain.steps == 3
    assert plain.seconds == pytest.approx(2 * (0.010 + 0.002) + (0.010 + 0.001))
    assert batch_bound([[3, 2], [12]], 0, PRICE) == engine_bound([12], 0, PRICE)
    assert batch_bound([], 4, PRICE) == Bound(0, 0.0) and engine_bound([], 4, PRICE) == Bound(0, 0.0)


def test_prices_come_from_a_cost_fit_or_a_step_profile() -> None:
    fit = StepPrice.from_fit({"c_base_s": 0.03, "c_tok_s": 0.002, "c_spec_s": 0.001, "c_spec_req_s": None})
    assert (fit.base_s, fit.per_token_s, fit.spec_s, fit.spec_req_s) == (0.03, 0.002, 0.001, 0.0)
    profile = StepProfile(10, 4.0, 8.0, 4.0, 1, 1, 1, 1, 1, 40.0, 5, None, None, None, None,
                          cost_base_ms=30.0, cost_ms_per_token=2.0, cost_spec_ms=None)
    measured = StepPrice.from_profile(profile)
    assert measured is not None and measured.source == "step profile"
    assert (measured.base_s, measured.per_token_s, measured.spec_s) == pytest.approx((0.03, 0.002, 0.0))
    unfitted = StepProfile(10, 4.0, 8.0, 4.0, 1, 1, 1, 1, 1, 40.0, 5, None, None, None, None)
    assert StepPrice.from_profile(unfitted) is None
    noisy = StepProfile(10, 4.0, 8.0, 4.0, 1, 1, 1, 1, 1, 40.0, 5, None, None, None, None,
                        cost_base_ms=2.4, cost_ms_per_token=1.5, cost_spec_ms=-2.7)  # as a greedy oracle epoch gave
    assert StepPrice.from_profile(noisy).spec_s == 0.0


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="k must be >= 0"):
        engine_bound([3], -1, PRICE)
    with pytest.raises(ValueError, match="finite and >= 0"):
        StepPrice(-0.01, 0.001, "bad")
    with pytest.raises(ValueError, match="not both 0"):
        StepPrice(0.0, 0.0, "bad")
