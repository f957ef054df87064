"""Cost models: the named H100 estimate, fitting, and the calibrated-model files."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from das.scheduler.cost_model import (
    GENERIC_PRIOR,
    SHIPPED,
    CostModel,
    OnlineCostModel,
    fit_cost_model,
    load_cost_model,
    prior_cost_model,
    prior_name,
    save_cost_model,
)


def test_h100_7b_is_memory_bound_at_small_batch():
    m = load_cost_model("h100-7b")
    assert 4e-3 < m.c_base_s < 8e-3 and 20e-6 < m.c_tok_s < 40e-6
    assert 150 < m.crossover_tokens < 300  # drafts are cheap until a step carries ~200 tokens
    assert "datasheet" in m.source and "estimate" in m.source


def test_fit_recovers_known_constants_and_reports_error():
    n = [1, 4, 16, 64, 128, 256]
    t = [0.01 + 0.0005 * x for x in n]
    m = fit_cost_model("cpu-test", n, t, source="synthetic")
    assert m.c_base_s == pytest.approx(0.01) and m.c_tok_s == pytest.approx(0.0005)
    assert m.fit_error == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="distinct"):
        fit_cost_model("x", [4, 4], [1.0, 1.1], source="s")
    with pytest.raises(ValueError, match="> 0"):  # a zero step time made the fit error infinite
        fit_cost_model("x", [1, 4], [0.0, 1.1], source="s")


def test_saved_models_load_by_name_and_bad_files_are_clear_errors(tmp_path):
    assert load_cost_model("cpu-smollm2", tmp_path) == SHIPPED["smollm2"]  # nothing stored: the shipped one
    m = CostModel(name="cpu-smollm2", c_base_s=0.02, c_tok_s=0.001, source="measured", fit_error=0.05)
    path = save_cost_model(m, tmp_path)
    assert load_cost_model("cpu-smollm2", tmp_path) == m
    assert load_cost_model(str(path)) == m
    with pytest.raises(ValueError, match="unknown cost model"):
        load_cost_model("nope", tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a cost model"):
        load_cost_model(str(bad))
    with pytest.raises(ValueError):
        CostModel(name="z", c_base_s=-1.0, c_tok_s=0.0, source="s")


# --- the online fit -------------------------------------------------------------------------------------------

TRUE = CostModel("true", 44e-3, 0.49e-3, "synthetic", c_spec_s=12e-3, c_spec_req_s=0.15e-3)


def feed(fit: OnlineCostModel, truth: CostModel, steps: int, rng: np.random.Generator, *, drafted_share: float = 0.3,
         outliers: float = 0.0) -> None:
    for _ in range(steps):
        requests, drafted = int(rng.integers(4, 128)), bool(rng.random() < drafted_share)
        n = requests + (int(rng.integers(1, 32)) if drafted else 0)
        t = truth.step_time(n, drafted, requests=requests) * rng.lognormal(0.0, 0.05)
        if rng.random() < outliers:
            t *= 8.0  # a step that shared the CPU with something else
        fit.observe(n, drafted, t, requests)


def test_online_fit_recovers_the_four_costs_through_noise_and_outliers():
    fit = OnlineCostModel(GENERIC_PRIOR)
    feed(fit, TRUE, 1500, np.random.default_rng(1), outliers=0.03)
    got = fit.current()
    assert got.c_base_s == pytest.approx(TRUE.c_base_s, rel=0.1)
    assert got.c_tok_s == pytest.approx(TRUE.c_tok_s, rel=0.1)
    # the drafted-step price at a small and a full batch, and so its slope with the batch
    for requests in (4, 128):
        assert got.spec_price(requests) == pytest.approx(TRUE.spec_price(requests), rel=0.35)
    assert got.c_spec_req_s == pytest.approx(TRUE.c_spec_req_s, rel=0.5)
    assert fit.stats().steps == 1500 and fit.stats().fit_error < 0.5


def test_a_drafted_step_is_priced_by_its_requests_not_its_draft_tokens():
    cost = CostModel("m", 0.05, 0.004, "test", c_spec_s=0.003, c_spec_req_s=0.001)
    assert cost.spec_price(10) == pytest.approx(0.013)
    assert cost.step_time(40, drafted=True, requests=10) == pytest.approx(0.05 + 0.16 + 0.013)
    assert cost.step_time(40, requests=10) == pytest.approx(0.05 + 0.16)  # a plain step pays no price
    with pytest.raises(ValueError, match="c_spec_req_s"):
        CostModel("bad", 0.05, 0.004, "test", c_spec_req_s=-1e-3)


def test_online_fit_follows_the_machine_load_as_it_moves():
    fit = OnlineCostModel(TRUE)
    rng = np.random.default_rng(2)
    feed(fit, TRUE, 600, rng)
    slower = CostModel("slower", 2 * TRUE.c_base_s, 2 * TRUE.c_tok_s, "synthetic", c_spec_s=TRUE.c_spec_s,
                       c_spec_req_s=TRUE.c_spec_req_s)
    feed(fit, slower, 3000, rng)
    assert fit.current().c_base_s == pytest.approx(slower.c_base_s, rel=0.15)
    assert fit.current().c_tok_s == pytest.approx(slower.c_tok_s, rel=0.15)


def test_a_cost_the_steps_do_not_show_keeps_its_prior_proportion():
    """No drafted step seen, on a machine 3x faster than the prior: c_spec keeps the prior's proportion to c_base
    (not its absolute value, which would make drafted steps look dear for good); one batch size only: c_tok too."""
    fit = OnlineCostModel(TRUE)
    for _ in range(800):
        fit.observe(64, False, TRUE.step_time(64) / 3)
    got = fit.current()
    assert got.step_time(64) == pytest.approx(TRUE.step_time(64) / 3, rel=0.01)
    assert got.c_spec_s / got.c_base_s == pytest.approx(TRUE.c_spec_s / TRUE.c_base_s, rel=1e-6)
    assert got.c_spec_req_s / got.c_base_s == pytest.approx(TRUE.c_spec_req_s / TRUE.c_base_s, rel=1e-6)
    assert got.c_tok_s / got.c_base_s == pytest.approx(TRUE.c_tok_s / TRUE.c_base_s, rel=0.05)


def test_prompt_tokens_are_priced_by_c_prefill_or_else_as_c_tok():
    measured = CostModel("m", 0.05, 0.004, "test", c_spec_s=0.003, c_prefill_s=0.002)
    assert measured.step_time(10, drafted=True, prompt_tokens=100) == pytest.approx(0.05 + 0.04 + 0.003 + 0.2)
    unmeasured = CostModel("u", 0.05, 0.004, "test")
    assert unmeasured.prefill_token_s == 0.004
    assert unmeasured.step_time(10, prompt_tokens=100) == pytest.approx(0.05 + 0.04 + 0.4)
    assert load_cost_model("h100-7b").prefill_token_s == load_cost_model("h100-7b").c_tok_s  # the same FLOPs
    for bad in (-1e-3, float("nan")):
        with pytest.raises(ValueError, match="c_prefill_s"):
            CostModel("bad", 0.05, 0.004, "test", c_prefill_s=bad)


def test_the_online_fit_keeps_the_prior_prefill_price_in_proportion_to_c_tok():
    """The fit sees decode steps only: on a machine twice as slow per token, a prompt token costs twice the
    prior's too; a prior without a measured prefill price gives a fit without one (priced as c_tok)."""
    prior = CostModel("p", 0.05, 0.004, "test", c_prefill_s=0.003)
    fit = OnlineCostModel(prior)
    rng = np.random.default_rng(0)
    for n in rng.integers(1, 200, 800):
        fit.observe(float(n), False, 0.05 + 0.008 * n)
    got = fit.current()
    assert got.c_tok_s == pytest.approx(0.008, rel=0.05)
    assert got.c_prefill_s == pytest.approx(got.c_tok_s * 0.75, rel=1e-9)
    plain = OnlineCostModel(CostModel("q", 0.05, 0.004, "test"))
    plain.observe(8.0, False, 0.09)
    assert plain.current().c_prefill_s is None


@pytest.mark.parametrize("step_s", [float("nan"), float("inf"), 0.0, -0.01, 60.0])
def test_impossible_steps_are_rejected_and_counted(step_s):
    fit = OnlineCostModel(TRUE)
    before = fit.current()
    assert fit.observe(64, False, step_s) is False
    assert fit.current() == before and fit.stats().rejected_steps == 1 and fit.stats().steps == 0


def test_a_fit_that_goes_negative_is_rejected_and_the_last_good_one_kept():
    """Step times that fall as tokens grow would fit a negative c_tok: that fit is refused."""
    fit = OnlineCostModel(CostModel("p", 10e-3, 1e-6, "s"), prior_steps=0.5)
    for i in range(200):
        n = 4 + (i % 50) * 4
        fit.observe(n, False, max(1e-3, 0.2 - 0.9e-3 * n))
    got = fit.current()
    assert got.c_tok_s >= 0 and got.c_base_s >= 0 and fit.stats().rejected_fits > 0


def test_the_prior_is_the_stored_calibration_then_the_shipped_one_then_generic(tmp_path, caplog):
    assert prior_cost_model("/models/some-unknown-model", tmp_path) == GENERIC_PRIOR
    # a calibration describes the dtype it was measured in (float32 for both shipped ones): SmolLM2 is stored in
    # float32, Qwen2.5-Coder in bfloat16 and served in float32 as a cast copy
    assert prior_cost_model("/data/models/smollm2-bfloat16", tmp_path) == GENERIC_PRIOR
    assert prior_cost_model("/data/models/qwen2.5-coder-0.5b-float32", tmp_path).name == "cpu-qwen2.5-coder-0.5b"
    assert prior_cost_model("/data/models/qwen2.5-coder-0.5b", tmp_path) == GENERIC_PRIOR
    # what `das calibrate` stores for the directory an engine serves is that engine's prior, dtype and all
    bf16 = CostModel(prior_name("/data/models/smollm2-bfloat16"), 27e-3, 0.7e-3, "das calibrate here")
    save_cost_model(bf16, tmp_path)
    assert prior_cost_model("/data/models/smollm2-bfloat16", tmp_path) == bf16
    assert prior_cost_model("/data/models/smollm2", tmp_path) == SHIPPED["smollm2"]
    (tmp_path / "cost-models" / f"{bf16.name}.json").unlink()
    assert prior_cost_model("/data/models/smollm2", tmp_path) == SHIPPED["smollm2"]
    stored = CostModel("cpu-smollm2", 30e-3, 0.3e-3, "das calibrate here")
    path = save_cost_model(stored, tmp_path)
    assert prior_cost_model("/data/models/smollm2", tmp_path) == stored
    for corrupt in ("{not json", '{"name": "cpu-smollm2", "c_base_s": -5, "c_tok_s": 1, "source": "x"}', "[]"):
        path.write_text(corrupt)
        with caplog.at_level(logging.WARNING, logger="das.scheduler.cost_model"):
            assert prior_cost_model("/data/models/smollm2", tmp_path) == SHIPPED["smollm2"]
        assert "ignoring the stored cost model" in caplog.text
        caplog.clear()
    # a calibration of another model copied into place: its own name says so
    path.write_text(CostModel("cpu-qwen2.5-coder-0.5b", 106e-3, 8.32e-3, "das calibrate there").to_json())
    with caplog.at_level(logging.WARNING, logger="das.scheduler.cost_model"):
        assert prior_cost_model("/data/models/smollm2", tmp_path) == SHIPPED["smollm2"]
    assert "measured for 'cpu-qwen2.5-coder-0.5b', not 'cpu-smollm2'" in caplog.text


def test_every_prior_prices_a_prompt_token_below_a_decoded_one_and_the_live_fit_keeps_the_ratio():
    """Without a prefill price the live fit would charge every prompt token c_tok (the simulator replaying a run
    under it was ~30% slow: docs/design.md#the-online-cost-model)."""
    for prior in (GENERIC_PRIOR, *SHIPPED.values()):
        assert prior.c_prefill_s is not None and 0 < prior.c_prefill_s < prior.c_tok_s
        fit = OnlineCostModel(prior)
        for i in range(100):
            n = 1 + i % 16
            fit.observe(n, False, prior.c_base_s * 0.8 + prior.c_tok_s * 1.5 * n)
        live = fit.current()
        assert live.c_prefill_s == pytest.approx(live.c_tok_s * prior.c_prefill_s / prior.c_tok_s)
