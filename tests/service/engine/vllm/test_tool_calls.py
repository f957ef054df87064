"""The engine's side of chat tool calling (service/engine/vllm/tool_calls.py): vLLM's parsers by name over SmolLM2's
tokenizer, the history as chat templates take it, and what SmolLM2's own template makes of tools (it ignores them:
its template has no tools block, so a tool-calling model such as Qwen2.5 is what shows them to the model)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from das.service.engine.contract import EngineInputError
from das.service.engine.vllm.models import prepare_model
from das.service.engine.vllm.tool_calls import ToolCallParsing, template_messages, template_tools, tool_parser_names
from das.service.wire.api import GroupRequest

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(prepare_model("smollm2", progress=False))


def group(**fields) -> GroupRequest:
    return GroupRequest(**{"problem_id": "p", "messages": [{"role": "user", "content": "weather?"}],
                           "tools": [WEATHER], "tool_parser": "hermes", **fields})


def test_hermes_splits_content_and_calls_and_leaves_other_text_alone(tokenizer):
    parsing = ToolCallParsing(tokenizer)
    content, calls = parsing.parse(group(), 'On it.<tool_call>\n{"name": "get_weather", "arguments": '
                                            '{"city": "Paris", "days": 2}}\n</tool_call>', [5, 6])
    assert content == "On it."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2})]
    assert calls[0].id.startswith("chatcmpl-tool-")
    assert parsing.parse(group(), "no calls here", [5]) == ("no calls here", [])
    # a call the model left unfinished is not a call (vLLM's parser: its JSON does not load)
    broken = '<tool_call>\n{"name": "get_weather", "argu'
    assert parsing.parse(group(), broken, [5]) == (broken, [])


def test_an_unknown_parser_is_refused(tokenizer):
    assert "hermes" in tool_parser_names()
    with pytest.raises(EngineInputError, match="'nope' is not a vLLM tool-call parser"):
        ToolCallParsing(tokenizer).check("nope")


def test_history_renders_as_templates_take_it(tokenizer):
    history = group(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "get_weather",
                                                                        "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny.",
         "tool_calls": [{"id": "c2", "function": {"name": "get_weather", "arguments": "not json"}}]}])
    turns = template_messages(history.messages)
    assert turns[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert turns[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    assert turns[3]["tool_calls"][0]["function"]["arguments"] == {}  # vLLM's coercion of a malformed call
    assert template_tools(history) == [WEATHER]
    text = tokenizer.apply_chat_template(turns, tools=template_tools(history), add_generation_prompt=True,
                                         tokenize=False)
    assert "<|im_start|>tool\nsunny<|im_end|>" in text
    assert "get_weather" not in text  # SmolLM2's template renders neither the tools nor the calls
