"""The OpenAI-compatible routes with the official `openai` client, unchanged, over real HTTP against the gateway on
a stub engine (completions, chat, streaming, errors in OpenAI's shape, coalescing of one problem's requests, abort
on a dropped stream). The same client against `das serve` with a tiny real model: tests/service/test_serve.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest

from das.service.engine.stub_engine import STUB_LOGPROB
from tests.service.live_gateway import TOKEN, LiveServer
from tests.service.stub_backend import sample_tokens, stub_backend


def test_completions_n4_with_logprobs_token_ids_usage_and_das(openai_serve):
    backend = stub_backend(tokens=5, draft_figures=True)
    server, client = openai_serve(backend)
    assert [m.id for m in client.models.list()] == ["das"]
    out = client.completions.create(model="das", prompt=[1, 2, 3], n=4, logprobs=1, max_tokens=8,
                                    extra_body={"return_token_ids": True, "problem_id": "p0"})
    assert out.object == "text_completion" and out.model == "das" and out.id.startswith("cmpl-")
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    (group,) = backend.received[-1]
    for choice in out.choices:
        drawn = sample_tokens(group, choice.index, 5)
        assert choice.token_ids == drawn and choice.prompt_token_ids == [1, 2, 3]
        assert choice.logprobs.token_logprobs == [STUB_LOGPROB] * 5
        assert choice.logprobs.tokens == [f"token_id:{t}" for t in drawn]
        assert choice.logprobs.top_logprobs == [{f"token_id:{t}": STUB_LOGPROB} for t in drawn]
        assert choice.finish_reason == "stop" and choice.text == ""
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (3, 20, 23)
    assert out.das == {"problem_id": "p0", "policy_version": 0, "draft_tokens": 4 * 2, "accepted_tokens": 4 * 1}
    # the batch machinery ran it: one batch, its samples in the gateway's metrics
    assert backend.runs == 1
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert 'das_batches_total{status="done"} 1.0' in text and "das_output_tokens_total 20.0" in text

    plain = client.completions.create(model="das", prompt=["just one prompt"], max_tokens=2)
    assert len(plain.choices) == 1 and plain.choices[0].token_ids is None and plain.choices[0].logprobs is None
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 2
    assert plain.das["problem_id"].startswith("sha256:")  # no problem_id: the prompt's hash names it


def test_chat_completions(openai_serve):
    backend = stub_backend(tokens=5)
    _, client = openai_serve(backend)
    messages = [{"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "two plus two?"}]}]
    out = client.chat.completions.create(model="das", messages=messages, n=2, logprobs=True, top_logprobs=3,
                                         max_completion_tokens=3, seed=7, extra_body={"return_token_ids": True})
    assert out.object == "chat.completion" and [c.index for c in out.choices] == [0, 1]
    (group,) = backend.received[-1]
    for choice in out.choices:
        assert choice.message.role == "assistant" and choice.finish_reason == "length"
        drawn = sample_tokens(group, choice.index, 3)
        assert choice.token_ids == drawn
        content = choice.logprobs.content
        assert [(t.token, t.logprob) for t in content] == [(f"token_id:{t}", STUB_LOGPROB) for t in drawn]
        # no alternatives from the engines: the sampled token only
        assert [[(a.token, a.logprob) for a in t.top_logprobs] for t in content] == [[(t.token, STUB_LOGPROB)]
                                                                                    for t in content]
    assert out.usage.completion_tokens == 6 and out.usage.total_tokens == out.usage.prompt_tokens + 6
    again = client.chat.completions.create(model="das", messages=messages, max_tokens=1)
    other = client.chat.completions.create(model="das", messages=messages[1:], max_tokens=1)
    assert again.das["problem_id"] == out.das["problem_id"] != other.das["problem_id"]
    assert again.choices[0].logprobs is None and again.choices[0].token_ids is None


def test_streaming_completions_send_each_choices_tokens_as_made_then_usage(openai_serve):
    backend = stub_backend(tokens=5, first_sample_s=0.05, sample_s=0.3, draft_figures=True)
    server, client = openai_serve(backend)
    stream = client.completions.create(model="das", prompt=[4, 5], n=3, max_tokens=8, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"return_token_ids": True, "problem_id": "s"})
    batch_id = stream.response.headers["x-batch-id"]
    chunks = iter(stream)
    first = next(chunks)
    status = httpx.get(f"{server.url}/v1/rollouts/{batch_id}", headers={"Authorization": f"Bearer {TOKEN}"})
    assert status.json()["status"] == "running"  # the first tokens came before the batch ended
    *choices, last = [first, *chunks]
    tokens: dict[int, list[int]] = {}
    finished: set[int] = set()
    for chunk in choices:
        (choice,) = chunk.choices
        assert choice.index not in finished  # nothing after a choice's last chunk
        tokens.setdefault(choice.index, []).extend(choice.token_ids)
        if choice.finish_reason is not None:
            finished.add(choice.index)
            assert choice.finish_reason == "stop"
            assert tokens[choice.index] == sample_tokens(backend.received[-1][0], choice.index, 5)
            assert choice.prompt_token_ids == [4, 5] and chunk.das["accepted_tokens"] == 1
    assert sorted(tokens) == [0, 1, 2]
    assert len(choices) > 3  # deltas before each choice's last chunk, not one chunk a choice
    assert sum(c.choices[0].finish_reason == "stop" for c in choices) == 3
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == (2, 15)


def test_streaming_chat(openai_serve):
    backend = stub_backend(tokens=4)
    _, client = openai_serve(backend)
    chunks = list(client.chat.completions.create(model="das", messages=[{"role": "user", "content": "hi"}], n=2,
                                                 stream=True, logprobs=True, max_tokens=5,
                                                 extra_body={"return_token_ids": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    tokens: dict[int, list[int]] = {}
    logprobs: dict[int, int] = {}
    for chunk in chunks:
        (choice,) = chunk.choices
        assert choice.delta.role == "assistant"
        tokens.setdefault(choice.index, []).extend(choice.token_ids)
        logprobs[choice.index] = logprobs.get(choice.index, 0) + len(choice.logprobs.content)
        if choice.finish_reason is not None:
            assert choice.finish_reason == "stop"
        assert chunk.usage is None
    (group,) = backend.received[-1]
    assert tokens == {i: sample_tokens(group, i, 4) for i in (0, 1)} and logprobs == {0: 4, 1: 4}
    assert sum(c.choices[0].finish_reason == "stop" for c in chunks) == 2 < len(chunks)


def test_async_client_and_the_accumulating_stream_helper(openai_serve):
    server, _ = openai_serve(stub_backend(tokens=3))

    async def run() -> Any:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=TOKEN, max_retries=0) as client:
            async with client.chat.completions.stream(model="das", messages=[{"role": "user", "content": "x"}],
                                                      max_tokens=4) as stream:
                return await stream.get_final_completion()

    final = asyncio.run(run())
    assert final.choices[0].finish_reason == "stop" and final.choices[0].message.content == ""


def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    """The raw body, checked to be OpenAI's error shape."""
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_bad_input_gets_openai_errors_with_the_right_status(openai_serve):
    backend = stub_backend(max_model_len=32)
    server, client = openai_serve(backend)
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4", prompt="x")
    assert _error(missing.value) == {"message": "The model `gpt-4` does not exist.", "type": "invalid_request_error",
                                     "param": "model", "code": "model_not_found"}
    with pytest.raises(openai.BadRequestError) as zero:
        client.completions.create(model="das", prompt="x", n=0)
    assert zero.value.param == "n" and "greater than or equal to 1" in zero.value.message
    with pytest.raises(openai.BadRequestError) as long_prompt:
        client.completions.create(model="das", prompt=list(range(40)))
    assert long_prompt.value.param == "prompt" and "prompt is 40 tokens" in _error(long_prompt.value)["message"]
    with pytest.raises(openai.BadRequestError) as long_chat:
        client.chat.completions.create(model="das", messages=[{"role": "user", "content": "w " * 40}])
    assert long_chat.value.param == "messages"
    for bad, param in [({"prompt": ["a", "b"]}, "prompt"), ({"prompt": "a", "temperature": "hot"}, "temperature"),
                       ({"prompt": "a", "max_tokens": 0}, "max_tokens"), ({"prompt": "a", "logprobs": -1}, "logprobs"),
                       ({"prompt": []}, "prompt")]:
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model="das", **bad)
        assert error.value.param == param, bad
    for bad, param in [({"top_logprobs": 2}, "top_logprobs"), ({"messages": []}, "messages")]:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model="das", **{"messages": [{"role": "user", "content": "x"}], **bad})
        assert error.value.param == param, bad
    with pytest.raises(openai.BadRequestError) as function:  # OpenAI's legacy function role (tool turns are served)
        client.chat.completions.create(model="das", messages=[{"role": "function", "content": "x", "name": "f"}])
    assert function.value.param == "messages.0.role"
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as auth:
        wrong.completions.create(model="das", prompt="x")
    assert _error(auth.value)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    # the official client refuses to send no key at all: without one, over plain HTTP
    anonymous = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "das", "messages": []})
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"
    # a refusal that echoes input stays a JSON body (a lone surrogate in the model name)
    odd = httpx.post(f"{server.url}/v1/completions", content=b'{"model": "\\ud800", "prompt": "x"}',
                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    assert odd.status_code == 404 and odd.json()["error"]["param"] == "model"
    assert backend.runs == 0
    # unknown fields are ignored, as OpenAI's API does; vLLM's top_k -1 means no cut
    ok = client.completions.create(model="das", prompt="x", max_tokens=1, extra_body={"frobnicate": True, "top_k": -1},
                                   presence_penalty=0.0, user="u")
    assert len(ok.choices) == 1 and backend.runs == 1


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", r'{"model": "das", "prompt": "\ud800"}', "prompt"),
    ("/v1/chat/completions", r'{"model": "das", "messages": [{"role": "user", "content": "\ud800"}]}', "messages"),
    ("/v1/chat/completions", r'{"model": "das", "messages": [{"role": "user", "content": [{"type": "text", '
                             r'"text": "x\udc80"}]}]}', "messages"),
])
def test_a_lone_surrogate_in_a_prompt_is_a_400_naming_it(openai_serve, path, body, param):
    # Was a 500: hashing the prompt into a problem id raised before GroupRequest could refuse it.
    backend = stub_backend()
    server, _ = openai_serve(backend)
    response = httpx.post(f"{server.url}{path}", content=body.encode(),
                          headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "unicode" in error["message"].lower() and backend.runs == 0


def test_a_seed_beyond_int64_is_a_400_as_vllm_answers(openai_serve):
    backend = stub_backend()
    _, client = openai_serve(backend)
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="das", prompt="x", seed=2**63)
    assert error.value.param == "seed" and backend.runs == 0
    assert len(client.completions.create(model="das", prompt="x", max_tokens=1, seed=-(2**63)).choices) == 1


def test_a_body_that_is_not_utf8_is_an_openai_400(openai_serve):
    # Found by the schema fuzz: FastAPI's own 400 came in its shape ({"detail"}), not OpenAI's.
    server, _ = openai_serve(stub_backend())
    response = httpx.post(f"{server.url}/v1/completions", content=b'{"model": "\xff"}',
                          headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "the body is not valid JSON: it is not UTF-8"


def test_the_schema_says_what_the_routes_answer(openai_serve):
    # The schema fuzz found a stream's text/event-stream, 400, 401 and 404 undocumented; 429, 500 and 503 may be too.
    server, _ = openai_serve(stub_backend())
    schema = httpx.get(f"{server.url}/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"400", "401", "404", "413", "429", "500", "503"} <= set(responses)
        assert "text/event-stream" in responses["200"]["content"]
        assert responses["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/"
                                                                                     "ErrorResponse"}
    # the roles a chat may carry (another is refused with a 400 naming the message)
    role = schema["components"]["schemas"]["ChatMessageParam"]["properties"]["role"]
    assert role["enum"] == ["system", "developer", "user", "assistant", "tool"]


def test_limits_and_readiness_answer_429_and_503(openai_serve):
    backend = stub_backend(first_sample_s=1.0)
    _, client = openai_serve(backend, max_batches_in_flight=1)
    with client.completions.create(model="das", prompt=[1], max_tokens=1, stream=True) as holding:
        assert holding.response.status_code == 200
        with pytest.raises(openai.RateLimitError) as busy:
            client.completions.create(model="das", prompt=[2], max_tokens=1)
    assert _error(busy.value)["code"] == "rate_limit_exceeded" and busy.value.response.headers["retry-after"] == "1"
    _, idle = openai_serve(stub_backend(ready=False))
    with pytest.raises(openai.InternalServerError) as not_ready:
        idle.chat.completions.create(model="das", messages=[{"role": "user", "content": "x"}])
    assert not_ready.value.status_code == 503 and _error(not_ready.value)["type"] == "server_error"


def test_more_samples_than_a_batch_may_hold_is_400_naming_n(openai_serve):
    backend = stub_backend()
    _, client = openai_serve(backend, max_batch_samples=4)
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="das", prompt="x", n=5)
    assert error.value.param == "n" and "max_batch_samples" in error.value.message and backend.runs == 0


def test_served_model_name_setting(openai_serve):
    _, client = openai_serve(stub_backend(), served_model_name="smollm2-rl")
    assert [m.id for m in client.models.list()] == ["smollm2-rl"]
    assert client.completions.create(model="smollm2-rl", prompt="x", max_tokens=1).model == "smollm2-rl"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="das", prompt="x")


def _concurrent(server: LiveServer, requests: list[dict[str, Any]]) -> list[Any]:
    """The requests at once through AsyncOpenAI; each answer with its X-Batch-Id."""
    async def run() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=TOKEN, max_retries=0) as client:
            async def one(body: dict[str, Any]) -> tuple[str, Any]:
                raw = await client.completions.with_raw_response.create(model="das", **body)
                return raw.headers["x-batch-id"], raw.parse()
            return list(await asyncio.gather(*(one(b) for b in requests)))
    return asyncio.run(run())


def test_requests_for_one_problem_arriving_together_run_as_one_group(openai_serve):
    backend = stub_backend(tokens=4, draft_figures=True)
    server, _ = openai_serve(backend, openai_coalesce_s=0.2)
    same = {"prompt": [1, 2], "n": 2, "max_tokens": 4, "extra_body": {"problem_id": "q"}}
    answers = _concurrent(server, [same] * 4 + [{**same, "temperature": 0.5}])
    assert backend.runs == 2  # the four equal requests as one group of 8, the other sampling on its own
    assert len({batch for batch, _ in answers[:4]}) == 1 and answers[4][0] != answers[0][0]
    for _, out in answers:
        assert [c.index for c in out.choices] == [0, 1] and out.usage.completion_tokens == 8
        assert out.das["draft_tokens"] == 2 * 2
    assert len({out.id for _, out in answers}) == 5

    backend = stub_backend(tokens=4)
    server, _ = openai_serve(backend, openai_coalesce_s=0)
    _concurrent(server, [same] * 3)
    assert backend.runs == 3


def test_a_seeded_request_is_its_own_group_with_its_seed(openai_serve):
    """OpenAI's `seed` is the group's: its choices are samples 0..n-1 of that seed, so it never joins others."""
    backend = stub_backend(tokens=4)
    server, _ = openai_serve(backend, openai_coalesce_s=0.2)
    same = {"prompt": [1, 2], "n": 2, "max_tokens": 4, "extra_body": {"problem_id": "q"}}
    _concurrent(server, [{**same, "seed": 5}, {**same, "seed": 5}, same, same])
    assert backend.runs == 3  # each seeded request alone, the two unseeded ones together
    seeds = sorted((groups[0].n, groups[0].sampling.seed) for groups in backend.received)
    assert seeds[:2] == [(2, 5), (2, 5)] and seeds[2][0] == 4 and seeds[2][1] not in (None, 5)


def test_a_dropped_stream_aborts_its_batch(openai_serve):
    server, client = openai_serve(stub_backend(first_sample_s=0.05, sample_s=0.2))
    stream = client.completions.create(model="das", prompt=[1], n=8, stream=True)
    batch_id = stream.response.headers["x-batch-id"]
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 5
    while True:
        summary = httpx.get(f"{server.url}/v1/rollouts/{batch_id}",
                            headers={"Authorization": f"Bearer {TOKEN}"}).json()
        if summary["status"] != "running" or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert summary["status"] == "aborted" and summary["samples"] < 8
