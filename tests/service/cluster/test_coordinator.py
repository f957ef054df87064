"""The Ray service on a two-node Ray cluster on this machine (`ray.cluster_utils.Cluster`): one NodeEngine per
node. Stub engines for the coordinator's own logic (fast), then the tiny real model on both nodes."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray
from ray.cluster_utils import Cluster

from das.scheduler.difficulty import DifficultyBook
from das.scheduler.length import LengthCurve, LengthPredictor
from das.service.engine.stub_engine import StubEngineConfig
from das.service.cluster.coordinator import RayBackend
from das.service.cluster.dispatch import PlacedWork, stream_interval, with_length_predictions
from das.service.cluster.engine_supervisor import lost_errors
from das.service.config import ServiceConfig
from das.service.cluster.engine_failure import Share
from das.service.config import HistoryPushConfig
from das.service.cluster.node_engine import EngineNotStarted, NodeEngine
from das.service.cluster.rollout_backend import GroupInputError
from das.service.engine.contract import EngineInputError
from das.service.engine.vllm.models import prepare_model
from das.service.http.gateway import create_app
from das.service.config import GatewayConfig
from das.service.wire.api import GroupRequest, LengthCurveSpec, SampleResult
from das.service.wire.engine_control import AddHistory, ReloadWeights
from tests.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 100 << 20,
                                                          "include_dashboard": False})
    nodes.add_node(num_cpus=1, object_store_memory=100 << 20)
    nodes.wait_for_nodes()
    ray.init(address=nodes.address)
    yield nodes
    ray.shutdown()
    nodes.shutdown()


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    event_loop = asyncio.new_event_loop()
    yield event_loop
    event_loop.close()


def groups(count: int, n: int, max_tokens: int = 8, **sampling: object) -> list[GroupRequest]:
    return [GroupRequest(problem_id=f"p{i}", prompt_token_ids=[5, 6, 7 + i], n=n,
                         sampling={"max_tokens": max_tokens, **sampling}) for i in range(count)]


def run_batch(loop: asyncio.AbstractEventLoop, backend: RayBackend, batch: list[GroupRequest]) -> list:
    async def collect() -> list:
        return [item async for item in backend.generate(batch)]
    return loop.run_until_complete(collect())


def start(loop: asyncio.AbstractEventLoop, config: ServiceConfig) -> RayBackend:
    backend = loop.run_until_complete(RayBackend.start(config))
    loop.run_until_complete(backend.wait_ready())
    return backend


def test_groups_get_the_predicted_mean_and_the_curve_unless_they_bring_a_prediction() -> None:
    book = DifficultyBook()
    for x in (40, 60, 80, 300):
        book.history("p0").add_length(0, x, "stop")
    predictor = LengthPredictor(book)
    own_curve = LengthCurve((0,), (9.0,), 20, 0.5)
    batch = [*groups(2, n=2), GroupRequest(problem_id="p0", prompt="x", predicted_tokens=55.0),
             GroupRequest(problem_id="p0", prompt="x", length_curve=own_curve.to_dict())]
    tagged = with_length_predictions(predictor, batch)
    mean = predictor.predict(["p0", "p1"], [0, 0]).mean
    assert [g.predicted_tokens for g in tagged] == [mean[0], mean[1], 55.0, mean[0]]
    curve = predictor.curves(["p0"])[0]
    wire = lambda c: LengthCurveSpec.model_validate(c.to_dict())  # noqa: E731 - as the group carries it
    assert tagged[0].length_curve == wire(curve) and tagged[1].length_curve == wire(predictor.curves(["p1"])[0])
    assert tagged[2].length_curve is None  # the caller's own prediction is what the budget uses
    assert tagged[3].length_curve == wire(own_curve)
    assert curve.at(301) > 302  # past p0's longest sample, still predicted to run on
    assert [g.model_copy(update={"predicted_tokens": None, "length_curve": None}) for g in tagged[:2]] == \
        batch[:2]  # nothing else changes


def test_the_placed_work_ledger_holds_each_sample_once_and_names_a_problems_engine() -> None:
    ledger = PlacedWork()
    a = GroupRequest(problem_id="a", prompt_token_ids=[1], n=3, predicted_tokens=10.0)
    b = GroupRequest(problem_id="b", prompt_token_ids=[1], n=2, predicted_tokens=5.0)
    share_a, share_b = Share(0, (0, 1, 2)), Share(1, (0, 1))
    ledger.hold("e0", [(share_a, a)])
    ledger.hold("e1", [(share_b, b)])
    assert ledger.tokens == {"e0": 30.0, "e1": 10.0}
    assert ledger.engine_of("a", {"e0": 0, "e1": 1}) == 0 and ledger.engine_of("a", {"e1": 0, "e0": 1}) == 1
    assert ledger.engine_of("a", {"e1": 0}) is None  # its engine is not serving
    assert ledger.engine_of("c", {"e0": 0, "e1": 1}) is None
    # a second group of "a" on e1 with more samples: e1 runs most of it
    ledger.hold("e1", [(Share(2, (0, 1, 2, 3)), a)])
    assert ledger.engine_of("a", {"e0": 0, "e1": 1}) == 1
    # one sample of the first arrives, then its job ends without the rest (cancelled): all of it is gone
    share_a.take(SampleResult(problem_id="a", sample_index=0, token_ids=[], logprobs=[], finish_reason="stop",
                              policy_version=0))
    ledger.arrived("e0", a)
    ledger.release("e0", [(share_a, a)])
    assert ledger.tokens["e0"] == 0.0 and ledger.engine_of("a", {"e0": 0, "e1": 1}) == 1
    ledger.release("e1", [(Share(2, (0, 1, 2, 3)), a), (share_b, b)])
    assert ledger.tokens["e1"] == 0.0
    assert ledger.engine_of("a", {"e0": 0, "e1": 1}) is None and ledger.engine_of("b", {"e0": 0, "e1": 1}) is None


@pytest.mark.parametrize("actors, interval", [(1, 0.05), (3, 0.05), (16, 16 / 60), (64, 64 / 60), (300, 5.0),
                                              (1024, 5.0)])
def test_the_stream_interval_keeps_the_objects_per_second_bounded(actors: int, interval: float) -> None:
    # 60 objects a second over all engine actors by default: 50 ms for a few actors, longer with many, 5 s at most
    assert stream_interval(actors, ServiceConfig(engine={"kind": "stub"}).stream_items_per_s) == \
        pytest.approx(interval)


def test_stub_engines_on_two_nodes(cluster: Cluster, loop: asyncio.AbstractEventLoop, tmp_path: Path,
                                   capfd: pytest.CaptureFixture[str]) -> None:
    backend = start(loop, ServiceConfig(engine={"kind": "stub", "tokens": 6, "token_s": 0.005}, state_dir=tmp_path,
                                        stats_interval_s=0.2))
    # engine actors find the shards by name: no constructor argument Ray must keep for their restarts (its core
    # worker logs an error line for those, in this driver process)
    assert "constructor arguments in the object store" not in capfd.readouterr().err
    try:
        assert len(backend.engine_names) == 2 and loop.run_until_complete(backend.ready())
        batch = groups(6, 3)
        results = run_batch(loop, backend, batch)
        assert Counter((i, s.sample_index) for i, s in results) == Counter((i, j) for i in range(6) for j in range(3))
        engines_by_group = {i: {s.engine for j, s in results if j == i} for i in range(6)}
        assert all(len(e) == 1 for e in engines_by_group.values())  # siblings stay on one engine
        assert {e for (e,) in engines_by_group.values()} == set(backend.engine_names)  # both nodes worked

        # every finished rollout reached the store, and length prediction learned the problem's length
        summary = loop.run_until_complete(backend.history("p0"))
        assert summary is not None and summary.rollouts == 3 and summary.length_p50 == 6
        assert float(backend.dispatcher.predictor.predict(["p0"], [0]).p50[0]) == 6  # the book it reads

        # a group the engines refuse: named by index, nothing ran
        bad = [*groups(1, 1), GroupRequest(problem_id="x", prompt_token_ids=[40000], n=1)]
        with pytest.raises(GroupInputError, match="outside the vocabulary") as refused:
            loop.run_until_complete(backend.check(bad))
        assert refused.value.group_index == 1

        # reload reaches every node; an older version is refused by the engines
        assert loop.run_until_complete(backend.control(ReloadWeights(checkpoint=str(tmp_path), version=3))) == 3
        with pytest.raises(EngineInputError):
            loop.run_until_complete(backend.control(ReloadWeights(checkpoint=str(tmp_path), version=2)))
        assert {s.policy_version for _, s in run_batch(loop, backend, groups(2, 1))} == {3}

        # imported history goes to the store
        record = {"problem_id": "imported", "policy_version": 0, "sample_index": 0, "prompt_token_ids": [1],
                  "output_token_ids": [2, 3]}
        assert loop.run_until_complete(backend.control(AddHistory(rollouts=[record, record]))) == 2
        assert loop.run_until_complete(backend.history("imported")).rollouts == 2

        # closing the stream early cancels what still runs; the service goes on
        async def first_then_close() -> int:
            stream = backend.generate(groups(2, 4, max_tokens=6))
            await anext(stream)
            await stream.aclose()
            return len([x async for x in backend.generate(groups(1, 2))])
        assert loop.run_until_complete(first_then_close()) == 2

        loop.run_until_complete(asyncio.sleep(0.5))
        stats = backend.stats()
        assert stats.engines_ready == 2 and {e.engine for e in stats.engines} == set(backend.engine_names)
        assert stats.history_problems >= 7 and stats.resident_bytes["history_store"] > 0

        # an engine actor killed for good (Ray does not restart it): its samples run on the other engine, each
        # once, and the service stays ready and live on that one
        ray.kill(backend.supervisor.engines[0][0].handle)  # the first engine's node actor
        results = run_batch(loop, backend, groups(4, 2))
        assert Counter((i, s.sample_index) for i, s in results) == Counter((i, j) for i in range(4) for j in range(2))
        assert {s.engine for _, s in results} == {backend.engine_names[1]}
        assert loop.run_until_complete(backend.ready()) and loop.run_until_complete(backend.live())
        assert backend.serving_engines == [backend.engine_names[1]]
    finally:
        loop.run_until_complete(backend.close())
    assert sorted(p.name for p in tmp_path.glob("history-shard-*")) == ["history-shard-0.msgpack",
                                                                         "history-shard-1.msgpack"]


def test_engines_sharing_an_actor_are_placed_apart_and_run_in_one_stream(cluster: Cluster,
                                                                         loop: asyncio.AbstractEventLoop) -> None:
    """Two stub engines an actor, an actor a node: each engine is placed as one (every engine gets groups, each
    sample names its engine), one call and one stream go per actor (`NodeEngine.run` with a part per engine), and
    when an actor dies mid-batch what each of its engines owed runs on the other actor's engines, every sample once,
    the ledger back to zero on every engine."""
    backend = start(loop, ServiceConfig(engine={"kind": "stub", "tokens": 6, "token_s": 0.1, "engines_per_actor": 2},
                                        engines_per_node=2))
    try:
        actors = backend.supervisor.serving_actors()
        assert len(actors) == 2 and [len(actor.names) for actor in actors] == [2, 2]
        assert backend.supervisor.actors_served == 2
        results = run_batch(loop, backend, groups(8, 2))
        assert Counter((i, s.sample_index) for i, s in results) == Counter((i, j) for i in range(8) for j in range(2))
        assert {s.engine for _, s in results} == set(backend.engine_names)  # 4 engines, 2 groups each

        killed: list[float] = []

        async def kill_mid_batch() -> list[tuple[int, SampleResult]]:
            stream = backend.generate(groups(8, 2, max_tokens=6))
            first = [await anext(stream)]
            killed.append(time.time())
            ray.kill(actors[0].handle)  # for good: both of its engines go
            return first + [item async for item in stream]

        results = loop.run_until_complete(kill_mid_batch())
        assert Counter((i, s.sample_index) for i, s in results) == Counter((i, j) for i in range(8) for j in range(2))
        rerun = [s for _, s in results if s.redispatches]
        assert rerun and {s.engine for s in rerun} <= set(actors[1].names)
        # each names the engine it was running on when that died, and when the death was seen (its trace's event)
        for sample in rerun:
            (death,) = sample.engine_deaths
            assert death.engine in actors[0].names and killed[0] <= death.unix_s <= time.time()
        assert all(s.engine_deaths is None for _, s in results if not s.redispatches)
        assert all(abs(tokens) < 1e-6 for tokens in backend.stats().engine_placed_tokens.values())
    finally:
        loop.run_until_complete(backend.close())


def test_batches_running_at_once_are_placed_by_the_load_already_placed(cluster: Cluster,
                                                                        loop: asyncio.AbstractEventLoop) -> None:
    """One group per batch, as an OpenAI-style trainer sends them (a request per prompt): each batch is placed
    onto the engine with the least predicted work outstanding, not onto the first engine every time; a problem's
    groups running at once share an engine."""
    backend = start(loop, ServiceConfig(engine={"kind": "stub", "tokens": 6, "token_s": 0.02}))
    try:
        async def one_group_each(count: int) -> list[list]:
            async def collect(i: int) -> list:
                batch = [GroupRequest(problem_id=f"q{i}", prompt_token_ids=[5, 6, 7 + i], n=2,
                                      sampling={"max_tokens": 6})]
                return [sample async for _, sample in backend.generate(batch)]
            return await asyncio.gather(*(collect(i) for i in range(count)))
        results = loop.run_until_complete(one_group_each(4))
        per_engine = Counter(sample.engine for samples in results for sample in samples)
        assert per_engine == Counter({name: 4 for name in backend.engine_names})  # 2 groups of 2 on each
        assert all(len({sample.engine for sample in samples}) == 1 for samples in results)  # siblings together
        # every sample arrived, so no engine holds placed work any more
        assert all(abs(tokens) < 1e-6 for tokens in backend.stats().engine_placed_tokens.values())

        def engine_of(placed: list[list], index: int) -> int:
            (engine,) = [e for e, items in enumerate(placed) if any(i == index for i, _ in items)]
            return engine

        # a problem's groups of one batch stay together; a problem already running keeps its engine for a group
        # that arrives later, though the other engine is idle
        same = [GroupRequest(problem_id="r", prompt_token_ids=[5, 6, 7], n=2, sampling={"max_tokens": 6}),
                *groups(3, 2), GroupRequest(problem_id="r", prompt_token_ids=[5, 6, 7], n=3,
                                            sampling={"max_tokens": 6, "temperature": 0.5})]
        placed = backend.place(same)
        assert engine_of(placed, 0) == engine_of(placed, 4)

        async def while_running() -> tuple[int, int, list]:
            stream = backend.generate([GroupRequest(problem_id="r", prompt_token_ids=[5, 6, 7], n=2,
                                                    sampling={"max_tokens": 6})])
            first = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0)  # the batch is placed and its work held
            later = backend.place([GroupRequest(problem_id="r", prompt_token_ids=[5, 6, 7], n=1,
                                                sampling={"max_tokens": 6}), *groups(1, 1)])
            sample = await first
            rest = [s async for s in stream]
            return backend.engine_names.index(sample[1].engine), engine_of(later, 0), [sample, *rest]
        running_on, placed_on, samples = loop.run_until_complete(while_running())
        assert placed_on == running_on and len(samples) == 2
        assert backend.dispatcher.placed.engine_of("r", backend.engine_names) is None  # nothing runs: free
        assert all(abs(tokens) < 1e-6 for tokens in backend.stats().engine_placed_tokens.values())
    finally:
        loop.run_until_complete(backend.close())


def test_an_engine_actor_whose_shard_is_gone_for_good_still_starts_and_serves(cluster: Cluster,
                                                                            loop: asyncio.AbstractEventLoop) -> None:
    """A shard name Ray does not know (a shard past a finite restart cap): the engine runs without its history, as
    while a shard is down, instead of failing its constructor (which would cost the engine too)."""
    node = NodeEngine("n0", StubEngineConfig(tokens=3), ["das-history-no-such-shard-0"],
                      history_push=HistoryPushConfig(retry_s=0))

    async def scenario() -> int:
        await node.start()
        group = GroupRequest(problem_id="p", n=2, prompt_token_ids=[1, 2], sampling={"max_tokens": 3})
        samples = sum([sum(isinstance(sample, SampleResult) for _, sample in items)
                       async for items in node.run([(0, [(0, group)])])])
        await node.close()
        return samples

    assert loop.run_until_complete(scenario()) == 2
    assert loop.run_until_complete(node.stats()).history_outbox_records == 2  # kept for a shard that may return


def test_an_engine_actor_not_started_answers_as_a_lost_engine(cluster: Cluster) -> None:
    """A call that reaches a restarted actor before the coordinator noticed the death (its engines not loaded yet)
    raises EngineNotStarted through Ray, which the coordinator counts as the death of the incarnation it knew,
    instead of an IndexError that failed the batch (or answered 500 to a check)."""
    actor = ray.remote(NodeEngine).options(num_cpus=0).remote("n0", StubEngineConfig(tokens=3), [])
    group = GroupRequest(problem_id="p", n=1, prompt_token_ids=[1, 2], sampling={"max_tokens": 3})
    with pytest.raises(EngineNotStarted, match="has not loaded its engines"):
        ray.get(actor.check.remote([group]))
    with pytest.raises(EngineNotStarted):
        for ref in actor.run.remote([(0, [(0, group)])]):
            ray.get(ref)
    assert issubclass(EngineNotStarted, lost_errors())
    ray.kill(actor)


# vLLM's own words when `--speculation suffix` starts on a node without ArcticInference
ARCTIC_MISSING = ("Arctic Inference is required for suffix decoding. Install via `pip install "
                  "arctic-inference==0.1.1`.")


def second_node(cluster: Cluster) -> str:
    (node,) = [n for n in cluster.list_all_nodes() if n is not cluster.head_node]
    return node.node_id


async def gateway_view(backend: RayBackend, batch: list[dict] | None = None
                       ) -> tuple[httpx.Response, httpx.Response, str, list[dict]]:
    """/readyz, /healthz and /metrics of the gateway over `backend`, and the records of `batch` run through it."""
    app = create_app(backend, GatewayConfig())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway",
                                 timeout=60) as http:
        records = []
        if batch is not None:
            response = await http.post("/v1/rollouts", json={"groups": batch})
            assert response.status_code == 200, response.text
            records = [json.loads(line) for line in response.text.splitlines()]
        return await http.get("/readyz"), await http.get("/healthz"), (await http.get("/metrics")).text, records


def test_an_engine_whose_node_cannot_load_is_named_in_readyz_while_the_other_serves(
        cluster: Cluster, loop: asyncio.AbstractEventLoop) -> None:
    """Issue 59, a cluster joined: the second node's engine fails its load with vLLM's ImportError (a package that
    node lacks). It stays down at once, not restarted; /readyz names it with its cause and what to install, and
    das_engine_load_failures_total counts it by reason; the first node's engine serves a batch; the service is ready
    and live (no reason to stop: an engine serves)."""
    failing = second_node(cluster)
    backend = loop.run_until_complete(RayBackend.start(ServiceConfig(engine={"kind": "stub",
        "tokens": 4, "load_error": {"kind": "ImportError", "message": ARCTIC_MISSING, "nodes": [failing]}})))
    try:
        with pytest.raises(RuntimeError, match="cannot load: ImportError: Arctic Inference is required"):
            loop.run_until_complete(asyncio.wait_for(backend.wait_ready(), 60))
        (failed,) = backend.stats().engines_failed
        assert failing[:6] in failed and backend.serving_engines and failed not in backend.serving_engines
        batch = [{"problem_id": f"p{i}", "prompt_token_ids": [5, 6, 7 + i], "n": 2, "sampling": {"max_tokens": 4}}
                 for i in range(3)]
        ready, health, metrics, records = loop.run_until_complete(gateway_view(backend, batch))
        *samples, end = records
        assert end["summary"]["status"] == "done" and len(samples) == 6
        assert {r["engine"] for r in samples} == set(backend.serving_engines)
        assert ready.status_code == 200 and health.status_code == 200
        cause = ready.json()["engines_failed"][failed]
        assert cause.startswith(f"engine {failed} cannot load: ImportError: Arctic Inference is required")
        assert "install arctic-inference on every engine node" in cause
        assert f'das_engine_load_failures_total{{engine="{failed}",reason="missing_package"}} 1.0' in metrics
        assert backend.stats().engine_restarts == {}  # a permanent failure is not retried
        assert backend.fatal_error is None and loop.run_until_complete(backend.live())
    finally:
        loop.run_until_complete(backend.close())


def test_when_no_engine_can_ever_load_healthz_fails_with_the_cause_and_the_service_says_so(
        cluster: Cluster, loop: asyncio.AbstractEventLoop) -> None:
    """Issue 59: every engine of the joined cluster cannot load (a model directory missing on both nodes):
    `unrecoverable()` (what `das serve` waits on to stop) returns the causes, /healthz answers 503 naming them and
    /readyz names both engines."""
    backend = loop.run_until_complete(RayBackend.start(ServiceConfig(engine={"kind": "stub",
        "tokens": 4, "load_error": {"kind": "FileNotFoundError", "message": "/models/policy/config.json"}})))
    try:
        cause = loop.run_until_complete(asyncio.wait_for(backend.unrecoverable(), 60))
        assert cause.count("cannot load: FileNotFoundError: /models/policy/config.json; --model must name") == 2
        ready, health, metrics, _ = loop.run_until_complete(gateway_view(backend))
        assert health.status_code == 503 and health.json()["reason"].startswith("no engine can serve again: engine ")
        assert ready.status_code == 503 and len(ready.json()["engines_failed"]) == 2
        assert metrics.count('reason="missing_model"} 1.0') == 2
        assert not loop.run_until_complete(backend.live())
    finally:
        loop.run_until_complete(backend.close())


def test_a_load_failure_of_no_known_kind_restarts_the_engine_under_the_cap(
        cluster: Cluster, loop: asyncio.AbstractEventLoop) -> None:
    """Transient load failures keep the restart behaviour: an error of no permanent kind (vLLM's "Engine core
    initialization failed", whose cause may be an engine core killed while loading) restarts the actor in a fresh
    process, counted against max_restarts; past the cap it stays down, and with every engine down so the service
    says no engine can load."""
    backend = loop.run_until_complete(RayBackend.start(ServiceConfig(
        engine={"kind": "stub", "tokens": 4, "load_error": {"kind": "RuntimeError", "message": "Engine core initialization "
                                                 "failed. See root cause above. Failed core proc(s): {}"}},
        failure={"max_restarts": 1})))
    try:
        cause = loop.run_until_complete(asyncio.wait_for(backend.unrecoverable(), 90))
        assert cause.count("failed to load again after 1 restart(s)") == 2, cause
        stats = backend.stats()
        assert len(stats.engine_restarts) == 2 and set(stats.engine_restarts.values()) == {1}
        assert sorted(stats.engine_load_failures.values()) == [2, 2]  # the first load and the one restart
        assert {reason for _, reason in stats.engine_load_failures} == {"error"}
    finally:
        loop.run_until_complete(backend.close())


def test_tiny_model_on_two_nodes_splits_one_batch(cluster: Cluster, loop: asyncio.AbstractEventLoop,
                                                  tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny", prepare_model("smollm2", progress=False), vocab_size=64, seed=0,
                             sharpness=12.0)
    backend = start(loop, ServiceConfig(engine={"model": str(model), "dtype": "float32", "max_model_len": 128,
                                                "enforce_eager": True, "kv_cache_gib": 1}))
    try:
        batch = groups(4, 3, max_tokens=16, temperature=0.0, ignore_eos=True)
        placed = backend.place(batch)
        expected_engine = {i: backend.engine_names[e] for e, items in enumerate(placed) for i, _ in items}
        assert set(expected_engine.values()) == set(backend.engine_names)  # the policy split the batch
        results = run_batch(loop, backend, batch)
        assert Counter((i, s.sample_index) for i, s in results) == Counter((i, j) for i in range(4) for j in range(3))
        assert all(s.engine == expected_engine[i] for i, s in results)
        assert all(len(s.token_ids) == 16 and s.finish_reason == "length" for _, s in results)
        # greedy: siblings agree, whichever node ran them
        for i in range(4):
            assert len({tuple(s.token_ids) for j, s in results if j == i}) == 1
    finally:
        loop.run_until_complete(backend.close())
