"""The engine families of /metrics: each engine's live step-cost fit and guard, and its prompt tokens and prefix
cache hits, as the text exposition shows them."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from das.service.cluster.history_store import ShardStats
from das.service.cluster.rollout_backend import BackendStats, EngineLoad
from das.service.engine.contract import EngineTally
from das.service.http.metrics import GatewayMetrics


def samples(metrics: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}


def test_each_engines_cost_fit_guard_and_prefix_cache_are_exported():
    fitted = {"c_base_s": 0.044, "c_tok_s": 0.00049, "c_spec_s": 0.012, "c_spec_req_s": 3e-4, "fit_error": 0.07,
              "guard_price": 0.5,
              "rejected_steps": 3, "rejected_fits": 1, "prior": "cpu-smollm2", "guard_gain": None}
    busy = EngineTally(running=4, waiting=0, prompt_tokens=640, cached_prompt_tokens=448, steps=90, busy_s=2.5,
                       draft_tokens=300, accepted_tokens=120)
    stats = BackendStats(engines=(EngineLoad("n0/0", busy, step_cost=fitted),
                                  EngineLoad("n0/1", EngineTally(running=2, waiting=1))), engines_ready=2)
    got = samples(GatewayMetrics(lambda: stats))
    engine = (("engine", "n0/0"),)
    assert got[("das_engine_step_base_seconds", engine)] == 0.044
    assert got[("das_engine_step_token_seconds", engine)] == 0.00049
    assert got[("das_engine_step_spec_seconds", engine)] == 0.012
    assert got[("das_engine_step_spec_request_seconds", engine)] == 3e-4
    assert got[("das_engine_step_fit_error_ratio", engine)] == 0.07
    assert got[("das_engine_guard_price_ratio", engine)] == 0.5
    assert got[("das_engine_step_fit_rejected_total", (("engine", "n0/0"), ("what", "step")))] == 3
    assert got[("das_engine_step_fit_rejected_total", (("engine", "n0/0"), ("what", "fit")))] == 1
    assert got[("das_engine_prompt_tokens_total", engine)] == 640
    assert got[("das_engine_prompt_tokens_cached_total", engine)] == 448
    assert got[("das_engine_steps_total", engine)] == 90 and got[("das_engine_busy_seconds_total", engine)] == 2.5
    assert got[("das_engine_draft_tokens_total", engine)] == 300
    assert got[("das_engine_draft_tokens_accepted_total", engine)] == 120
    # an engine without a fit (speculation none) has no cost samples, but its queues are there
    assert ("das_engine_step_base_seconds", (("engine", "n0/1"),)) not in got
    assert got[("das_engine_requests_waiting", (("engine", "n0/1"),))] == 1


def test_the_engines_history_outboxes_are_exported():
    got = samples(GatewayMetrics(lambda: BackendStats(history_outbox_records=5, history_records_given_up=2)))
    assert got[("das_history_outbox_records", ())] == 5
    assert got[("das_history_records_given_up_total", ())] == 2


def test_history_snapshot_health_is_exported():
    shards = (ShardStats(1, 2, 3, 4, snapshot_fallbacks=1, snapshot_quarantined=2, last_snapshot_unix_s=1.7e9),
              ShardStats(1, 2, 3, 4, snapshot_failures=3))
    got = samples(GatewayMetrics(lambda: BackendStats(history_shards=shards)))
    assert got[("das_history_snapshot_fallbacks_total", ())] == 1
    assert got[("das_history_snapshot_quarantined_total", ())] == 2
    assert got[("das_history_snapshot_failures_total", ())] == 3
    assert got[("das_history_last_snapshot_timestamp_seconds", (("shard", "0"),))] == 1.7e9
    assert ("das_history_last_snapshot_timestamp_seconds", (("shard", "1"),)) not in got  # none on disk yet


def test_each_engines_runner_and_profiled_step_parts_are_exported_and_read_back_by_the_benchmarks():
    from das.bench.server_profile import engine_steps
    from das.service.engine.contract import StepPartTotals
    from das.service.engine.runner_choice import RunnerChoice

    parts = StepPartTotals().add({"forward_s": [0.03, 0.03], "model_s": [0.025, 0.025], "sample_s": [0.004, 0.004],
                                  "propose_s": [0.002, 0.002], "budget_s": [0.0005, 0.0005], "rest_s": [0.0, 0.0],
                                  "gap_s": [0.001, 0.001], "tokens": [9, 9]})
    stats = BackendStats(engines=(EngineLoad("n0/0", EngineTally(), runner=RunnerChoice("cuda", "V1", False, True),
                                             step_parts=parts),
                                  EngineLoad("n0/1", EngineTally(), runner=RunnerChoice("cuda", "V2", True, False))),
                         engines_ready=2)
    metrics = GatewayMetrics(lambda: stats)
    got = samples(metrics)
    assert got[("das_engine_runner_info", (("async_scheduling", "false"), ("engine", "n0/0"), ("keyed", "true"),
                                           ("model_runner", "V1"), ("platform", "cuda")))] == 1
    assert got[("das_engine_profiled_steps_total", (("engine", "n0/0"),))] == 2
    assert got[("das_engine_step_part_seconds_total", (("engine", "n0/0"), ("part", "model_s")))] == 0.05
    assert ("das_engine_profiled_steps_total", (("engine", "n0/1"),)) not in got  # not profiled: no sample
    first, second = engine_steps(metrics.render().decode())
    # two steps of 30 + 4 + 2 + 0 + 1 ms, 25 ms of each the forward pass: 12 ms of host work a step
    assert abs(first.host_ms_per_step - 12.0) < 1e-9
    assert second.runner["model_runner"] == "V2" and second.host_ms_per_step is None
