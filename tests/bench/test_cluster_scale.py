"""`das bench scale` at a small size: 8 engines hosted 4 to an actor on a 2-node Ray test cluster, 256 samples
through the gateway and coordinator; every figure is measured, each engine placed as one and each actor streaming its
engines' samples together."""

import pytest

from das.bench.cluster_scale import ScaleConfig, ScaleResult, ScaleRun, run_scale_bench


def test_small_cluster_measures_every_figure() -> None:
    messages: list[str] = []
    result = run_scale_bench(ScaleConfig(engines=(8,), samples=(256,), nodes=2, engines_per_actor=4, repeats=3),
                             progress=messages.append)
    (run,) = result.runs
    assert (run.engines, run.samples, run.actors, run.repeats) == (8, 256, 2, 3)
    each = run.coordinator_cpu_s_per_sample_each
    assert len(each) == 3 and run.coordinator_cpu_s_per_sample == sorted(each)[1]  # the median of three batches
    assert run.samples_per_s > 0 and run.wall_s > 0
    assert run.coordinator_cpu_s > 0 and run.coordinator_cpu_s_per_sample > 0
    # 16 groups over 8 engines in 2 actors, one stream an actor: 128 samples each, in at most 64 a Ray object
    assert run.engine_events >= 4
    assert run.placement_s_per_batch > 0
    assert run.coordinator_rss_mib > 50
    # every sample carries when it left its engine; the client saw each after that
    assert 0 <= run.engine_to_client_p50_ms <= run.engine_to_client_p99_ms <= run.engine_to_client_max_ms < 60_000
    assert any("8 engines in 2 actors ready" in m for m in messages)
    assert result.to_dict()["runs"][0]["coordinator_cpu_s_per_sample"] == run.coordinator_cpu_s_per_sample


@pytest.mark.parametrize("engines, samples", [((6,), (256,)), ((8,), (250,)), ((), (256,))])
def test_refuses_sizes_that_do_not_split(engines: tuple[int, ...], samples: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        ScaleConfig(engines=engines, samples=samples, nodes=4).check()


def test_the_ratio_is_the_most_engines_cpu_per_sample_over_the_fewest() -> None:
    config = ScaleConfig(engines=(8, 64), samples=(256,), nodes=2)
    figures = dict(actors=1, wall_s=1.0, samples_per_s=256.0, coordinator_cpu_s=0.1, event_loop_cpu_s_per_sample=0.0,
                   engine_events=1, coordinator_cpu_s_per_engine_event=0.1, placement_s_per_batch=0.0,
                   coordinator_rss_mib=100.0, engine_to_client_p50_ms=1.0, engine_to_client_p99_ms=1.0,
                   engine_to_client_max_ms=1.0, samples=256)
    runs = [ScaleRun(engines=64, coordinator_cpu_s_per_sample=3e-4, **figures),
            ScaleRun(engines=8, coordinator_cpu_s_per_sample=2e-4, **figures)]
    assert ScaleResult(config, {}, runs).to_dict()["cpu_per_sample_ratio"] == {"256": pytest.approx(1.5)}
    assert ScaleResult(ScaleConfig(engines=(8,), samples=(256,)), {}, runs[1:]).cpu_per_sample_ratio() == {}
