"""An engine that dies loses nothing: real service processes on loopback, engine actors killed with SIGKILL.

The bookkeeping first (no Ray), then the stub engine (two engine actors on one node, five kills under load; the
restart cap), then the tiny real model on one server (its vLLM engine core killed mid-batch, then the actor at 70% of
the longest sample)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from das.service.cluster.engine_failure import GivenUpPrompts, RestartWindow, Share
from das.service.config import FailureConfig
from das.service.engine.vllm.models import prepare_model
from das.service.wire.api import EngineDeath, GroupRequest, SampleResult
from das.service.wire.sample_keys import derive
from tests.service.serve_process import TOKEN, Server, metric
from tests.tiny_models import build_tiny_model
from tests.service.cluster.stub_service import STUB_VOCAB, StubService, process_pids, wait_until

# ---- the bookkeeping, without Ray ----


def sample(index: int) -> SampleResult:
    return SampleResult(problem_id="p", sample_index=index, token_ids=[1], logprobs=[0.0], finish_reason="stop",
                        policy_version=0)


def test_a_redispatched_share_keeps_each_samples_trace_parent() -> None:
    parents = tuple(f"00-{'a' * 32}-{i + 1:016x}-01" for i in range(4))
    group = GroupRequest(problem_id="p", prompt_token_ids=[1], n=4, trace_parents=parents)
    first = Share(0, (0, 1, 2, 3))
    assert first.request(group).trace_parents == parents
    first.take(sample(1))
    rest = first.remainder("node/0", 100.0)
    assert rest is not None
    request = rest.request(group)  # the engine's samples 0..2 are the batch's 0, 2, 3: so are their parents
    assert request.trace_parents == (parents[0], parents[2], parents[3])
    assert [request.trace_headers(j) for j in range(3)] == [{"traceparent": parents[i]} for i in (0, 2, 3)]
    assert Share(0, (0, 1)).request(GroupRequest(problem_id="p", prompt_token_ids=[1], n=2)).trace_headers(0) is None


def test_a_share_maps_the_engines_indices_back_and_its_remainder_is_what_never_arrived() -> None:
    group = GroupRequest(problem_id="p", prompt_token_ids=[1], n=6)
    first = Share(3, tuple(range(6)))
    assert first.request(group) is group  # the whole group goes as it is
    assert [(s.sample_index, s.redispatches) for s in (first.take(sample(j)) for j in (4, 1))] == [(4, 0), (1, 0)]
    assert first.take(sample(4)) is None  # a repeat is never delivered twice
    assert first.missing() == (0, 2, 3, 5)

    rest = first.remainder("node-a/0", 100.0)
    assert rest is not None and rest.group_index == 3 and rest.indices == (0, 2, 3, 5)
    request = rest.request(group)
    # only n changes, and the samples draw with the keys of the indices they stand for (the same tokens again)
    assert request.n == 4 and request.key_indices == (0, 2, 3, 5)
    assert request.model_copy(update={"n": 6, "key_indices": None}) == group
    keyed = group.model_copy(update={"key_indices": (10, 11, 12, 13, 14, 15)})  # a group naming its own keys
    assert rest.request(keyed).key_indices == (10, 12, 13, 15)
    # the engine numbers the re-dispatched samples 0..3; they land on the missing indices, one death counted
    assert [(s.sample_index, s.redispatches) for s in (rest.take(sample(j)) for j in (2, 0))] == [(3, 1), (0, 1)]
    again = rest.remainder("node-b/0", 101.5)
    assert again is not None and again.indices == (2, 5) and again.request(group).key_indices == (2, 5)
    assert (first.deaths, rest.deaths, again.deaths) == (0, 1, 2)  # the engine deaths the group ran through
    assert again.take(sample(1)).sample_index == 5
    twice = again.take(sample(0))
    # each death, with its engine and time, travels with the samples it moved (their trace's events)
    assert twice.redispatches == 2 and twice.engine_deaths == [EngineDeath(engine="node-a/0", unix_s=100.0),
                                                               EngineDeath(engine="node-b/0", unix_s=101.5)]
    assert first.take(sample(0)).engine_deaths is None
    assert again.remainder("node-c/0", 102.0) is None and again.missing() == ()
    delivered = sorted([1, 4] + [3, 0] + [5, 2])
    assert delivered == list(range(6))  # every index exactly once over the three engines
    with pytest.raises(ValueError, match="asked for 2 samples"):
        again.take(sample(2))


def test_a_given_up_prompt_is_refused_for_the_hold_whatever_its_seed_problem_or_n() -> None:
    held = GivenUpPrompts(FailureConfig(given_up_hold_s=60))
    crashing = GroupRequest(problem_id="p", prompt_token_ids=[1, 2], n=4, sampling={"max_tokens": 8, "seed": 1})
    other = GroupRequest(problem_id="p", prompt_token_ids=[1, 3], n=4, sampling={"max_tokens": 8})
    assert held.refused([crashing], 0.0) is None
    held.add(crashing, 10.0)
    retry = crashing.model_copy(update={"problem_id": "q", "n": 1, "sampling": crashing.sampling.model_copy(
        update={"seed": 2})})
    index, message = held.refused([other, retry], 20.0)
    assert index == 1 and "given_up_hold_s" in message
    longer = crashing.model_copy(update={"sampling": crashing.sampling.model_copy(update={"max_tokens": 9})})
    assert held.refused([other, longer], 20.0) is None  # other sampling settings are another request
    assert held.refused([retry], 69.9) is not None and held.refused([retry], 70.0) is None  # the hold ends
    never = GivenUpPrompts(FailureConfig(given_up_hold_s=0))
    never.add(crashing, 0.0)
    assert never.refused([crashing], 0.0) is None


def test_the_restart_window_allows_max_restarts_then_refuses_until_old_ones_age_out() -> None:
    window = RestartWindow(FailureConfig(max_restarts=2, restart_window_s=10))
    assert window.allow(0.0) and window.allow(1.0)
    assert not window.allow(5.0)  # a third within 10 s
    assert window.allow(10.5)  # the first one has aged out
    assert not window.allow(10.8)
    assert not RestartWindow(FailureConfig(max_restarts=0)).allow(0.0)


# ---- a service in a child process ----


def run_batch(url: str, body: dict[str, Any], on_record: Callable[[int], None] = lambda count: None,
              headers: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The batch's records and its summary, read raw (no client de-duplication); a 503 (no engine serves at
    that moment) is retried. `on_record(count)` after every record."""
    while True:
        records: list[dict[str, Any]] = []
        with httpx.stream("POST", f"{url}/v1/rollouts", json=body, headers=headers, timeout=300) as response:
            if response.status_code == 503:
                time.sleep(0.2)
                continue
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if not line:
                    continue
                item = json.loads(line)
                if "summary" in item:
                    return records, item["summary"]
                records.append(item)
                on_record(len(records))
        raise AssertionError("the stream ended without a summary")


def stub_groups(count: int, n: int) -> list[dict[str, Any]]:
    return [{"problem_id": f"p{i}", "prompt_token_ids": [5, 6, 7 + i], "n": n, "sampling": {"max_tokens": 8}}
            for i in range(count)]


KILLS = 5  # each waits for the restart (~8 s here): enough deaths to land mid-batch on both engines, again and again


def test_five_kills_of_stub_engine_actors_under_load_lose_and_repeat_nothing(tmp_path: Path) -> None:
    service = StubService(tmp_path, {"engine": {"kind": "stub", "tokens": 8, "token_s": 0.05}, "engines_per_node": 2,
                                     # healthy engines killed at random: no group is given up
                                     "failure": {"max_restarts": 100, "max_group_deaths": 100}})
    groups = stub_groups(6, 4)
    expected = Counter((g, j) for g in range(6) for j in range(4))
    results: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {}
    errors: list[Exception] = []
    stop = threading.Event()

    def load(worker: int) -> None:
        count = 0
        while not stop.is_set():
            batch_id = f"w{worker}-{count}"
            try:
                results[batch_id] = run_batch(service.url, {"batch_id": batch_id, "groups": groups})
            except Exception as exc:  # noqa: BLE001 -- raised in the test below
                errors.append(exc)
                return
            count += 1

    try:
        service.wait_ready(engines=2)
        assert len(service.node_engines()) == 2
        workers = [threading.Thread(target=load, args=(w,), daemon=True) for w in range(3)]
        for worker in workers:
            worker.start()
        kills = 0
        while kills < KILLS:
            time.sleep(0.3)  # batches are running on both engines now
            os.kill(random.choice(service.node_engines()), signal.SIGKILL)
            kills += 1
            # spaced so each restart completes: the death counted and both engines serving again
            wait_until(lambda done=kills: service.metric("das_engine_restarts") == done
                       and service.metric("das_engines_ready") == 2, 60, f"no recovery after kill {kills}")
        stop.set()
        for worker in workers:
            worker.join(timeout=120)
        assert not any(w.is_alive() for w in workers) and not errors, errors

        assert len(results) >= KILLS
        for batch_id, (records, summary) in results.items():
            assert summary["status"] == "done" and summary["samples"] == 24, (batch_id, summary)
            assert Counter((r["group_index"], r["sample_index"]) for r in records) == expected, batch_id
            for r in records:  # a re-drawn sample repeats its draw: a stub's tokens follow from the sample's key
                key = derive(derive(summary["seed"], r["group_index"]), r["sample_index"])
                assert r["output_token_ids"] == [(7 * p + key) % STUB_VOCAB for p in range(8)], (batch_id, r)
        assert service.get("/readyz").status_code == 200 and service.get("/healthz").status_code == 200
        records, summary = run_batch(service.url, {"groups": stub_groups(2, 3)})
        assert summary["status"] == "done" and len(records) == 6
        assert service.metric("das_engine_restarts") == KILLS
        assert service.get("/metrics").text.count("das_engine_last_recovery_seconds{engine=") == 2
        redispatched = service.metric("das_samples_redispatched")
        assert redispatched > 0
        # what the dead engines owed was taken off their load when it moved: nothing is left placed anywhere
        assert service.get("/metrics").text.count("das_engine_placed_tokens{engine=") == 2
        assert abs(service.metric("das_engine_placed_tokens")) < 1e-6
        print(f"{len(results)} batches, {KILLS} kills, {redispatched:.0f} samples re-dispatched")
    finally:
        stop.set()
        service.stop()


def progress_batch(url: str, body: dict[str, Any], on_item: Callable[[dict[str, Any]], None]
                   ) -> tuple[list[dict[str, Any]], list[tuple[float, dict[str, Any]]], dict[str, Any]]:
    """A batch with its progress stream: (records, (arrival time, progress) pairs, summary)."""
    records: list[dict[str, Any]] = []
    progress: list[tuple[float, dict[str, Any]]] = []
    with httpx.stream("POST", f"{url}/v1/rollouts", json={**body, "progress": True}, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line:
                continue
            item = json.loads(line)
            if "summary" in item:
                return records, progress, item["summary"]
            if "progress" in item:
                progress.append((time.monotonic(), item["progress"]))
            else:
                records.append(item)
            on_item(item)
    raise AssertionError("the stream ended without a summary")


def test_a_sample_whose_engine_dies_resumes_from_its_delivered_tokens_and_streams_on(tmp_path: Path) -> None:
    """Stub engine through Ray: the engine actor SIGKILLed while the samples are ~40% done; each resumes from what it
    had delivered (the restarted engine makes only the rest, plus the last report interval's tokens), the batch is
    token-identical to an undisturbed one with the same seed, and the OpenAI client's stream gets a chunk about every
    50 ms of generation (the engines' report interval)."""
    service = StubService(tmp_path, {"engine": {"kind": "stub", "tokens": 100, "token_s": 0.03}})
    groups = [{"problem_id": f"p{i}", "prompt_token_ids": [5, 6, 7 + i], "n": 1, "sampling": {"max_tokens": 100}}
              for i in range(2)]
    body = {"groups": groups, "seed": 11}
    try:
        service.wait_ready(engines=1)
        undisturbed, _, summary = progress_batch(service.url, body, lambda item: None)
        assert summary["status"] == "done"
        reference = {(r["group_index"], r["sample_index"]): r["output_token_ids"] for r in undisturbed}

        delivered: dict[tuple[int, int], int] = {}
        killed: list[float] = []

        def kill_at_40(item: dict[str, Any]) -> None:
            p = item.get("progress")
            if p is None:
                return
            delivered[(p["group_index"], p["sample_index"])] = p["offset"] + len(p["token_ids"])
            if not killed and p["offset"] + len(p["token_ids"]) >= 40:
                (actor,) = service.node_engines()
                os.kill(actor, signal.SIGKILL)
                killed.append(time.monotonic())
                at_kill.update(delivered)

        at_kill: dict[tuple[int, int], int] = {}
        records, progress, summary = progress_batch(service.url, body, kill_at_40)
        assert summary["status"] == "done" and killed, summary
        assert Counter((r["group_index"], r["sample_index"]) for r in records) == Counter(list(reference))  # each once
        for record in records:  # the same draw as the undisturbed run
            assert record["output_token_ids"] == reference[(record["group_index"], record["sample_index"])]
        for key, had in at_kill.items():
            after = [p for t, p in progress if t > killed[0] + 0.5 and (p["group_index"], p["sample_index"]) == key]
            resumed_from = min((p["offset"] for p in after), default=100)
            # the resumed engine started near where the stream was at the death, not at 0: it made at most the
            # remaining tokens plus what the last report interval (and the kill's own latency) held
            assert resumed_from >= had - 10, (key, had, resumed_from)
        assert service.metric("das_samples_redispatched") == 2

        client = openai.OpenAI(base_url=f"{service.url}/v1", api_key="none", max_retries=0, timeout=60)
        times: list[float] = []
        text_tokens = 0
        for chunk in client.completions.create(model="das", prompt=[5, 6, 9], max_tokens=100, stream=True,
                                               extra_body={"return_token_ids": True}):
            if chunk.choices:
                times.append(time.perf_counter())
                text_tokens += len(chunk.choices[0].token_ids)
        span = times[-1] - times[0]
        assert text_tokens == 100 and span > 2.0
        assert len(times) >= 0.8 * span / 0.05, (len(times), span)  # ~one chunk per 50 ms report interval
    finally:
        service.stop()


def test_an_engine_past_its_restart_cap_fails_its_batch_and_liveness(tmp_path: Path) -> None:
    service = StubService(tmp_path, {"engine": {"kind": "stub", "tokens": 8, "token_s": 0.25},
                                     "failure": {"max_restarts": 1, "restart_window_s": 3600}})

    def kill_after_first(count: int) -> None:
        if count == 1:
            os.kill(service.node_engines()[0], signal.SIGKILL)

    try:
        service.wait_ready(engines=1)
        body = {"groups": stub_groups(2, 4)}
        records, summary = run_batch(service.url, body, kill_after_first)
        assert summary["status"] == "done" and len(records) == 8  # the one restart the cap allows
        assert Counter((r["group_index"], r["sample_index"]) for r in records) == \
            Counter((g, j) for g in range(2) for j in range(4))
        service.wait_ready(engines=1)

        records, summary = run_batch(service.url, body, kill_after_first)
        assert summary["status"] == "failed" and len(records) < 8
        assert "/0" in summary["error"] and "max_restarts" in summary["error"], summary["error"]
        assert service.get("/healthz").status_code == 503
        assert service.get("/readyz").status_code == 503
        assert service.metric("das_engine_restarts") == 1
    finally:
        service.stop()


def test_an_engine_actor_killed_while_it_loads_is_restarted_and_serves(tmp_path: Path) -> None:
    """Issue 59: a transient load failure keeps the restart behaviour. The engine actor's process SIGKILLed while its
    engine loads (as the OOM killer would) is restarted by Ray, loads again and serves; it counts as a restart and
    as a failed load with reason "died", and nothing stops the service."""
    service = StubService(tmp_path, {"engine": {"kind": "stub", "tokens": 8, "load_s": 10.0}})

    def loading() -> bool:
        assert service.proc.poll() is None, service.log.read_text()
        try:
            return service.get("/readyz").status_code == 503 and len(service.node_engines()) == 1
        except httpx.TransportError:
            return False

    try:
        wait_until(loading, 60, "the gateway did not answer while the engine loads")
        # the actor's process is up before its load starts, and a kill in that gap is Ray's plain actor restart,
        # never seen as a failed load (on a loaded machine the kill once landed there): kill inside the 10 s load
        time.sleep(3.0)
        (actor,) = service.node_engines()
        os.kill(actor, signal.SIGKILL)
        service.wait_ready(engines=1)
        assert service.node_engines() != [actor]
        assert service.metric("das_engine_restarts") == 1
        failures = re.findall(r'^das_engine_load_failures_total\{engine="[^"]+",reason="(\w+)"\} (\S+)$',
                              service.get("/metrics").text, re.MULTILINE)
        assert failures == [("died", "1.0")]
        assert service.get("/readyz").json()["engines_failed"] == {}
        records, summary = run_batch(service.url, {"groups": stub_groups(2, 4)})
        assert summary["status"] == "done" and len(records) == 8
    finally:
        service.stop()


@pytest.mark.parametrize("behaviour", ["queue", "reject"])
def test_an_engine_restarted_while_paused_joins_the_pause(tmp_path: Path, behaviour: str) -> None:
    """Under either vLLM pause behaviour (service/engine/pause_gate.py): a batch sent to the re-paused engine is held
    by the service, not failed by a rejecting engine (an abort pause: a rejecting engine queues nothing then)."""
    service = StubService(tmp_path, {"engine": {"kind": "stub", "tokens": 8, "token_s": 0.02, "pause_behavior": behaviour}})
    try:
        service.wait_ready(engines=1)
        assert httpx.post(f"{service.url}/pause", params={"mode": "abort"}, timeout=30).status_code == 200
        os.kill(service.node_engines()[0], signal.SIGKILL)
        wait_until(lambda: service.metric("das_engine_restarts") == 1, 60, "the engine was not restarted")
        service.wait_ready(engines=1)
        assert service.get("/is_paused").json() == {"is_paused": True}  # the restarted engine joined the pause
        done: list[tuple[list[dict[str, Any]], dict[str, Any]]] = []
        held = threading.Thread(target=lambda: done.append(run_batch(service.url, {"groups": stub_groups(1, 2)})))
        held.start()
        time.sleep(1.5)  # 8 tokens at 0.02 s: long done, were it not held
        assert not done
        assert httpx.post(f"{service.url}/resume", timeout=30).status_code == 200
        held.join(30)
        records, summary = done[0]
        assert summary["status"] == "done" and sorted(r["sample_index"] for r in records) == [0, 1]
        assert {r["finish_reason"] for r in records} <= {"stop", "length"}  # none "error"
    finally:
        service.stop()


def test_a_group_that_kills_every_engine_it_reaches_is_given_up_and_nothing_else(tmp_path: Path) -> None:
    """A prompt that crashes the engine (a "query of death"): after max_group_deaths deaths under it, its
    samples end with an error instead of running again; the groups that ran beside it (the first time on its
    engine, the second time on the other one) all arrive, and both engines serve again. Without the limit the
    restart caps run out and the batch fails; without the last try alone, the groups beside it are given up too."""
    service = StubService(tmp_path, {"engine": {"kind": "stub", "tokens": 8, "token_s": 0.05, "exit_on_problem": "p0"},
                                     "engines_per_node": 2,
                                     "failure": {"max_restarts": 2, "max_group_deaths": 2}})
    try:
        service.wait_ready(engines=2)
        records, summary = run_batch(service.url, {"groups": stub_groups(6, 4)})
        assert summary["status"] == "done", summary
        assert Counter((r["group_index"], r["sample_index"]) for r in records) == \
            Counter((g, j) for g in range(6) for j in range(4))
        given_up = [r for r in records if r["finish_reason"] == "error"]
        assert sorted((r["group_index"], r["sample_index"]) for r in given_up) == [(0, j) for j in range(4)]
        assert all("max_group_deaths" in r["error"] and r["output_token_ids"] == [] for r in given_up)
        for r in records:
            if r["group_index"] != 0:  # every other sample as the stub draws it
                key = derive(derive(summary["seed"], r["group_index"]), r["sample_index"])
                assert r["output_token_ids"] == [(7 * p + key) % STUB_VOCAB for p in range(8)], r
        assert service.metric("das_samples_given_up") == 4
        assert service.metric("das_engine_restarts") == 2  # one engine per death, never more
        service.wait_ready(engines=2)
        assert service.get("/healthz").status_code == 200
        # the same prompt again (under another problem id and seed) is refused before it reaches an engine
        again = {**stub_groups(1, 4)[0], "problem_id": "retry", "sampling": {"max_tokens": 8, "seed": 7}}
        refused = httpx.post(f"{service.url}/v1/rollouts", json={"groups": [again]}, timeout=30)
        assert refused.status_code == 422 and "given_up_hold_s" in refused.text, refused.text
        assert service.metric("das_engine_restarts") == 2
        records, summary = run_batch(service.url, {"groups": stub_groups(6, 2)[1:]})
        assert summary["status"] == "done" and len(records) == 10
        assert all(r["finish_reason"] != "error" for r in records)
    finally:
        service.stop()


def test_the_official_openai_client_retrying_a_given_up_prompt_crashes_no_more_engines(tmp_path: Path) -> None:
    """The OpenAI route answers a given-up sample with a 500, which the official client retries (twice by default):
    the retry is refused at admission (400, which it does not retry) instead of crashing two more engines."""
    service = StubService(tmp_path, {"engine": {"kind": "stub", "tokens": 8, "token_s": 0.02, "exit_on_problem": "poison"},
                                     "engines_per_node": 2, "failure": {"max_group_deaths": 2}})
    try:
        service.wait_ready(engines=2)
        client = openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=2, timeout=120)
        with pytest.raises(openai.BadRequestError, match="given_up_hold_s"):
            client.completions.create(model="das", prompt=[5, 6, 7], n=2, max_tokens=8,
                                      extra_body={"problem_id": "poison"})
        assert service.metric("das_engine_restarts") == 2 and service.metric("das_samples_given_up") == 2
        fine = client.completions.create(model="das", prompt=[5, 6, 8], n=2, max_tokens=8)
        assert [c.finish_reason for c in fine.choices] == ["length", "length"]
    finally:
        service.stop()


# ---- the tiny real model ----


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One `das serve` on the tiny model for the module's kills (each test leaves it serving, restarted)."""
    root = tmp_path_factory.mktemp("tiny-kills")
    model = build_tiny_model(root / "tiny", prepare_model("smollm2", progress=False), vocab_size=64, seed=0,
                             sharpness=12.0)
    server = Server(model, root / "state", "--max-model-len", "1024")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def tiny_metrics(server: Server) -> str:
    return httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).text


def test_tiny_model_engine_core_killed_mid_batch_loses_nothing(tiny_server: Server) -> None:
    """The vLLM engine core SIGKILLed inside a live actor as the batch's first sample arrives, most samples still
    running: the actor ends itself and Ray restarts it (no hand restart), and each sample arrives once, in full. The
    actor itself killed is the next test's death (its sample resumed token-identical, its engine core no orphan):
    each real-engine restart costs CI about half a minute, so each kind of death gets one."""
    server = tiny_server
    auth = {"Authorization": f"Bearer {TOKEN}"}
    # One short group finishes first; the long ones are mid-batch when the kill comes.
    groups = [{"problem_id": f"p{i}", "prompt_token_ids": [5, 6, 7 + i], "n": 4,
               "sampling": {"max_tokens": 8 if i == 0 else 200, "temperature": 0.8, "ignore_eos": True}}
              for i in range(4)]
    text = tiny_metrics(server)
    restarts, redispatched = metric(text, "das_engine_restarts"), metric(text, "das_samples_redispatched")
    (actor,) = process_pids(server.proc.pid, "ray::NodeEngine")
    (core,) = process_pids(actor, "EngineCore")

    records, summary = run_batch(server.url, {"groups": groups},
                                 lambda count: os.kill(core, signal.SIGKILL) if count == 1 else None, auth)
    assert summary["status"] == "done", summary
    assert Counter((r["group_index"], r["sample_index"]) for r in records) == \
        Counter((g, j) for g in range(4) for j in range(4))
    assert all(len(r["output_token_ids"]) == (8 if r["group_index"] == 0 else 200) for r in records)
    server.wait_ready()  # no hand restart
    text = tiny_metrics(server)
    assert metric(text, "das_engine_restarts") == restarts + 1
    assert 1 <= metric(text, "das_samples_redispatched") - redispatched <= 15
    print(f"re-dispatched {metric(text, 'das_samples_redispatched') - redispatched:.0f} samples; latest recovery "
          f"{metric(text, 'das_engine_last_recovery_seconds'):.1f} s")

    records, summary = run_batch(server.url, {"groups": groups[:2]}, headers=auth)
    assert summary["status"] == "done" and len(records) == 8


def test_tiny_model_engine_killed_at_70_percent_of_the_longest_sample_resumes_it_token_identical(
        tiny_server: Server) -> None:
    """The real engine (tiny model, fp32, T = 0.8, keyed sampling, DAS speculation): the engine actor SIGKILLed
    while the longest sample is ~70% done. The batch ends done with every sample once and token-identical to an
    undisturbed run with the same seed; the restarted engine makes that sample's remaining tokens plus at most a
    second's worth, Ray restarts the actor (no hand restart) and its vLLM engine core is left no orphan; the makespan
    cost of the death is printed. Before that, on the warm engine, the official openai client streams a completion
    in chunks about 50 ms apart."""
    server = tiny_server
    auth = {"Authorization": f"Bearer {TOKEN}"}
    # long enough that progress reports (one per ~50 ms per engine) land between 70% and the end: this tiny model
    # decodes 200 tokens in a few reports
    longest = 800
    groups = [{"problem_id": f"p{i}", "prompt_token_ids": [5, 6, 7 + i], "n": 2,
               "sampling": {"max_tokens": longest if i == 0 else 60, "temperature": 0.8, "ignore_eos": True}}
              for i in range(3)]
    body = {"groups": groups, "seed": 1234, "logprobs": True, "progress": True}

    def batch(on_item: Callable[[dict[str, Any]], None]
              ) -> tuple[list[dict[str, Any]], list[tuple[float, dict[str, Any]]], dict[str, Any], float]:
        start = time.monotonic()
        records: list[dict[str, Any]] = []
        progress: list[tuple[float, dict[str, Any]]] = []
        with httpx.stream("POST", f"{server.url}/v1/rollouts", json=body, headers=auth, timeout=600) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                item = json.loads(line) if line else {}
                if "summary" in item:
                    return records, progress, item["summary"], time.monotonic() - start
                if "progress" in item:
                    progress.append((time.monotonic(), item["progress"]))
                elif item:
                    records.append(item)
                on_item(item)
        raise AssertionError("the stream ended without a summary")

    server.wait_ready()  # an earlier test's kills leave it restarted
    batch(lambda item: None)  # warm-up: the first batch after a start compiles and fills caches
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=TOKEN, max_retries=0, timeout=120)
    times: list[float] = []
    tokens = 0
    model = client.models.list().data[0].id
    asked = time.perf_counter()
    for chunk in client.completions.create(model=model, prompt=[5, 6, 7],
                                           max_tokens=200, temperature=0.8, stream=True,
                                           extra_body={"return_token_ids": True, "ignore_eos": True}):
        if chunk.choices:
            times.append(time.perf_counter())
            tokens += len(chunk.choices[0].token_ids)
    span = times[-1] - times[0]
    print(f"openai stream: {len(times)} chunks over {span:.2f} s for {tokens} tokens")
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    print(f"openai stream: chunk gaps median {gaps[len(gaps) // 2] * 1e3:.0f} ms, max {gaps[-1] * 1e3:.0f} ms")
    # chunks spread over the generation (a stream sent in one piece at the end has span 0), one a report
    # interval (50 ms) or so
    assert tokens == 200 and span >= 0.5 * (times[-1] - asked) and len(times) >= 0.8 * span / 0.05
    undisturbed, _, summary, plain_s = batch(lambda item: None)
    assert summary["status"] == "done"
    reference = {(r["group_index"], r["sample_index"]): r for r in undisturbed}
    per_token_s = plain_s / longest

    text = tiny_metrics(server)
    restarts, redispatched = metric(text, "das_engine_restarts"), metric(text, "das_samples_redispatched")
    (actor,) = process_pids(server.proc.pid, "ray::NodeEngine")  # the one the kill finds, with its engine core
    (core,) = process_pids(actor, "EngineCore")
    killed: list[float] = []
    at_kill: dict[tuple[int, int], int] = {}
    delivered: dict[tuple[int, int], int] = {}
    trigger: list[tuple[int, int]] = []  # the sample whose 70% set off the kill

    def kill_at_70(item: dict[str, Any]) -> None:
        p = item.get("progress")
        if p is None:
            return
        key = (p["group_index"], p["sample_index"])
        delivered[key] = p["offset"] + len(p["token_ids"])
        if not killed and p["group_index"] == 0 and delivered[key] >= 0.7 * longest:
            os.kill(actor, signal.SIGKILL)
            killed.append(time.monotonic())
            at_kill.update(delivered)
            trigger.append(key)

    records, progress, summary, disturbed_s = batch(kill_at_70)
    assert killed, f"no progress report of the longest sample between 70% and its end: {delivered}"
    assert summary["status"] == "done", summary
    assert Counter((r["group_index"], r["sample_index"]) for r in records) == Counter(list(reference))
    for record in records:
        ref = reference[(record["group_index"], record["sample_index"])]
        assert record["output_token_ids"] == ref["output_token_ids"], (record["group_index"],
                                                                       record["sample_index"])
        assert len(record["logprobs"]) == len(ref["logprobs"])
        assert max(abs(a - b) for a, b in zip(record["logprobs"], ref["logprobs"])) < 1e-3
    server.wait_ready()  # no hand restart
    text = tiny_metrics(server)
    assert metric(text, "das_engine_restarts") == restarts + 1
    assert 1 <= metric(text, "das_samples_redispatched") - redispatched <= 5  # not the groups already done
    assert not psutil.pid_exists(core) or psutil.Process(core).status() == psutil.STATUS_ZOMBIE  # no orphan
    # the sample killed at 70% had 30% of its tokens left, so it ran on after the restart: it resumed near
    # where it was, not at 0; others resumed likewise where they were still running
    (killed_at_70,) = trigger
    resumed = {key: [p["offset"] for t, p in progress if t > killed[0] + 1.0
                     and (p["group_index"], p["sample_index"]) == key] for key in at_kill}
    assert resumed[killed_at_70], f"no progress of {killed_at_70} after the restart"
    for key, offsets in resumed.items():
        if offsets or key == killed_at_70:
            assert min(offsets) >= at_kill[key] - max(1.0 / per_token_s, 2), (key, at_kill[key])
    print(f"undisturbed makespan {plain_s:.1f} s; with the death at 70% of the longest sample "
          f"{disturbed_s:.1f} s (cost {disturbed_s - plain_s:.1f} s, the engine's restart included); "
          f"delivered at the death: {at_kill}")
