"""Cost models: the named H100 estimate, fitting, and the calibrated-model files."""

from __future__ import annotations

import pytest

from das.scheduler.cost_model import CostModel, fit_cost_model, load_cost_model, save_cost_model


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


def test_saved_models_load_by_name_and_bad_files_are_clear_errors(tmp_path):
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
