"""Tool calling on `/v1/chat/completions` with the official `openai` client over real HTTP against the gateway on
a stub engine whose samples carry a text the test chose (a Qwen2.5-style hermes `<tool_call>` block) and are parsed
by the engine's own path (service/engine/vllm/tool_calls.py: vLLM's `hermes` parser) over SmolLM2's tokenizer: the
reply's tool_calls and finish_reason, streaming, multi-turn history with tool turns, sessions and token ids, and the
400s for bad tool input."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from das.service.engine.vllm.models import prepare_model
from das.service.engine.vllm.tool_calls import ToolCallParsing
from das.service.config import GatewayConfig
from tests.service.live_gateway import TOKEN
from tests.service.stub_backend import sample_tokens, stub_backend

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_TEXT = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
TOOLS_ON = {"tool_call_parser": "hermes", "enable_auto_tool_choice": True}
USER = [{"role": "user", "content": "weather in Paris and Oslo?"}]


@pytest.fixture(scope="module")
def parsing() -> ToolCallParsing:
    return ToolCallParsing(AutoTokenizer.from_pretrained(prepare_model("smollm2", progress=False)))


def test_tool_calls_parsed_from_the_reply_with_token_ids_and_session(openai_serve, parsing):
    backend = stub_backend(tokens=5, text=CALL_TEXT, tool_parsing=parsing.parse)
    _, client = openai_serve(backend, **TOOLS_ON)
    out = client.chat.completions.create(model="das", messages=USER, tools=[WEATHER], max_tokens=5,
                                         extra_body={"return_token_ids": True, "session_id": "s1"})
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert all(c.type == "function" and c.id.startswith("chatcmpl-tool-") for c in calls)
    assert len({c.id for c in calls}) == 2
    (group,) = backend.received[-1]
    # exactly what the engine generated: the parse reads the text only
    assert choice.token_ids == sample_tokens(group, 0, 5)
    assert group.tool_parser == "hermes" and group.session_id == "s1"
    assert [t.model_dump(exclude_none=True) for t in group.tools] == [WEATHER]

    # the session's next turn: the call and the tool's answer in the history, rendered by the chat template
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
               {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny, 21 C"},
               {"role": "tool", "tool_call_id": calls[1].id, "content": "rain, 9 C"}]
    again = client.chat.completions.create(model="das", messages=history, tools=[WEATHER], max_tokens=5,
                                           extra_body={"session_id": "s1"})
    assert again.choices[0].finish_reason == "tool_calls"
    (turn,) = backend.received[-1]
    assert [m.role for m in turn.messages] == ["user", "assistant", "tool", "tool"]
    assert turn.messages[1].content is None
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in turn.messages[1].tool_calls] == [
        (c.id, "get_weather", json.loads(c.function.arguments)) for c in calls]
    assert [(m.tool_call_id, m.content) for m in turn.messages[2:]] == [(calls[0].id, "sunny, 21 C"),
                                                                      (calls[1].id, "rain, 9 C")]
    assert turn.problem_id == group.problem_id  # the session's problem


def test_a_reply_without_calls_is_content_and_tool_choice_none_parses_nothing(openai_serve, parsing):
    backend = stub_backend(tokens=3, text="It is sunny.", tool_parsing=parsing.parse)
    _, client = openai_serve(backend, **TOOLS_ON)
    out = client.chat.completions.create(model="das", messages=USER, tools=[WEATHER], tool_choice="auto")
    assert out.choices[0].message.content == "It is sunny." and out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "stop"

    backend.engine.config = backend.engine.config.model_copy(update={"text": CALL_TEXT})
    plain = client.chat.completions.create(model="das", messages=USER, tools=[WEATHER], tool_choice="none")
    assert plain.choices[0].message.content == CALL_TEXT and plain.choices[0].message.tool_calls is None
    (group,) = backend.received[-1]
    assert group.tool_parser is None and group.tools is not None  # shown to the model, not parsed


def test_streaming_sends_the_calls_in_each_choices_last_chunk(openai_serve, parsing):
    backend = stub_backend(tokens=5, text=CALL_TEXT, tool_parsing=parsing.parse, first_sample_s=0.02, sample_s=0.05)
    _, client = openai_serve(backend, **TOOLS_ON)
    chunks = list(client.chat.completions.create(model="das", messages=USER, tools=[WEATHER], n=2, stream=True,
                                                 extra_body={"return_token_ids": True}))
    tokens: dict[int, list[int]] = {}
    for chunk in chunks:
        (choice,) = chunk.choices
        tokens.setdefault(choice.index, []).extend(choice.token_ids)
        if choice.finish_reason is None:
            assert choice.delta.content is None and choice.delta.tool_calls is None
            continue
        assert choice.finish_reason == "tool_calls" and choice.delta.content == "Let me check."
        assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in choice.delta.tool_calls] == [
            (0, "get_weather", {"city": "Paris"}), (1, "get_weather", {"city": "Oslo"})]
        assert all(c.id and c.type == "function" for c in choice.delta.tool_calls)
    (group,) = backend.received[-1]
    assert tokens == {i: sample_tokens(group, i, 5) for i in (0, 1)}
    assert len(chunks) > 2  # token chunks came before the last ones


def test_bad_tool_input_gets_400s_naming_the_field(openai_serve, parsing):
    _, client = openai_serve(stub_backend(tokens=2, text=CALL_TEXT, tool_parsing=parsing.parse), **TOOLS_ON)
    _, unconfigured = openai_serve(stub_backend(tokens=2))

    def refused(c: openai.OpenAI, **request: Any) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as error:
            c.chat.completions.create(model="das", **{"messages": USER, **request})
        return error.value

    no_parser = refused(unconfigured, tools=[WEATHER])
    assert "--enable-auto-tool-choice and --tool-call-parser" in no_parser.message
    assert no_parser.body["param"] == "tool_choice"
    assert unconfigured.chat.completions.create(model="das", messages=USER, tools=[WEATHER],
                                                tool_choice="none").choices[0].finish_reason == "stop"
    cases = [({"tools": []}, "tools", "empty array"),
             ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice", "guided decoding"),
             ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
              "tool_choice", "function 'get_weather' is not supported"),
             ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "'sometimes' is not one of"),
             ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
             ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "name"),
             ({"messages": [*USER, {"role": "tool", "content": "sunny"}]}, "messages.1.tool_call_id", "required"),
             ({"messages": [{"role": "user", "content": "x", "tool_calls": [
                 {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
              "messages.0.tool_calls", "only an assistant turn"),
             ({"messages": [{"role": "user", "content": None}]}, "messages.0.content", "required"),
             ({"messages": [{"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
                                                                  "function": {"name": "f"}}]}]},
              "messages", "arguments")]
    for request, param, words in cases:
        error = refused(client, **request)
        assert error.body["param"] == param and words in error.message, (request, error.body)


def test_auto_tool_choice_needs_a_parser_in_the_settings():
    with pytest.raises(ValidationError, match="requires tool_call_parser"):
        GatewayConfig(enable_auto_tool_choice=True)
    assert GatewayConfig(**TOOLS_ON).tool_call_parser == "hermes"


def test_openapi_schema_lists_the_tool_fields(openai_serve):
    server, _ = openai_serve(stub_backend(tokens=1), **TOOLS_ON)
    schema = httpx.get(f"{server.url}/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    request = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"tools", "tool_choice", "parallel_tool_calls"} <= set(request)
    message = schema["components"]["schemas"]["ChatMessageParam"]["properties"]
    assert {"tool_calls", "tool_call_id"} <= set(message) and "tool" in message["role"]["enum"]
