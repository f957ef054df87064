"""`das bench serve --arms none,das,oracle`: arm order, the oracle table and the bound from a server's metrics."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from das.bench.oracle_bound import StepPrice, engine_bound
from das.bench.user_run import UserRunConfig, UserRunResult, epoch_bounds, step_price_from_metrics
from das.service.client.rollout_run import EpochFigures


def metrics_text(engines: int) -> str:
    registry = CollectorRegistry()
    for name, value in (("das_engine_step_base_seconds", 0.03), ("das_engine_step_token_seconds", 0.002),
                        ("das_engine_step_spec_seconds", 0.001), ("das_engine_step_spec_request_seconds", 0.0)):
        gauge = Gauge(name, "doc", ["engine"], registry=registry)
        for e in range(engines):
            gauge.labels(engine=f"e{e}").set(value)
    return generate_latest(registry).decode()


def test_none_runs_first_and_the_oracle_arms_last_while_the_others_alternate() -> None:
    config = UserRunConfig(arms=("das", "none", "oracle", "oracle-k"))
    assert config.order(0) == ("none", "das", "oracle", "oracle-k")
    assert UserRunConfig(arms=("none", "das", "ngram", "oracle")).order(1) == ("none", "ngram", "das", "oracle")
    assert UserRunConfig(arms=("none", "das")).order(1) == ("das", "none")  # without oracles: as before
    with pytest.raises(ValueError, match="add none to the arms"):
        UserRunConfig(arms=("das", "oracle"))


def test_the_bound_is_priced_by_the_servers_fit_on_one_engine_only() -> None:
    price, engines = step_price_from_metrics(metrics_text(1))
    assert engines == 1 and price == StepPrice(0.03, 0.002, "server cost fit", 0.001, 0.0)
    recorded = [{1: [5] * 10, 2: [6] * 3}, {3: [7] * 20}]
    bounds = epoch_bounds(recorded, 4, metrics_text(1))
    assert [b["steps"] for b in bounds] == [2, 4]
    assert bounds[0]["bound_s"] == pytest.approx(engine_bound([10, 3], 4, price).seconds, abs=1e-3)
    assert [b["bound_s"] for b in epoch_bounds(recorded, 4, metrics_text(2))] == [None, None]
    assert [b["bound_s"] for b in epoch_bounds(recorded, 4, "")] == [None, None]


def test_the_oracle_table_has_nones_das_and_the_oracles_makespans_with_the_bound() -> None:
    config = UserRunConfig(arms=("none", "das", "oracle"), repeats=1, epochs=1)

    def figures(makespan: float) -> list[EpochFigures]:
        return [EpochFigures(1, makespan, 8, 800, 0, 0, 0, [0], 100, 100)]

    result = UserRunResult(config, "code:2", {"none": [figures(10.0)], "das": [figures(8.0)],
                                              "oracle": [figures(6.0)]},
                           bounds=[[{"bound_s": 5.0, "steps": 12, "price": None}]], oracle_identical={"oracle": True})
    (row,) = result.oracle_table()
    assert row == {"epoch": 1, "none": 10.0, "das": 8.0, "oracle": 6.0, "bound_s": 5.0,
                   "das_share_of_oracle_saving": 0.5, "oracle_over_bound": 1.2}
    assert result.to_dict()["oracle"] == [row]
    assert "| 1 | 10.000 | 8.000 | 6.000 | - | 5.000 | 0.500 | 1.200 |" in result.markdown()
