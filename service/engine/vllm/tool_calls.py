"""Tool calling in chat, as vLLM's OpenAI server does it, on the engine's side (the gateway loads no vLLM): the
conversation and its tools rendered through the model's chat template, and each sample's text split into content
and tool calls by one of vLLM's own tool-call parsers (`ToolParserManager`, e.g. `hermes` for Qwen2.5's
`<tool_call>{...}</tool_call>` blocks), applied as vLLM's serving_chat applies them for tool_choice "auto": a
fresh parser per sample, `Parser.parse(text, request, enable_auto_tools=True)`, an id made for a call the parser
left without one.

The parse reads the text only: token_ids stay exactly what the engine generated.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from das.service.engine.contract import EngineInputError
from das.service.wire.api import ChatMessage, FunctionCall, GroupRequest, ToolCall


def tool_parser_names() -> list[str]:
    """The tool-call parsers vLLM registers (what `das serve --tool-call-parser` may name)."""
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.list_registered()


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The chat as Hugging Face chat templates take it: an assistant turn's tool call arguments as a dict, not
    OpenAI's JSON text (vLLM's renderer converts them so too; templates such as Qwen2.5's write `arguments |
    tojson`), a missing content as "" (templates that concatenate content fail on None)."""
    out = []
    for message in messages:
        turn: dict[str, Any] = {"role": message.role, "content": message.content or ""}
        if message.tool_calls:
            turn["tool_calls"] = [{"id": call.id, "type": call.type, "function": {
                "name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                for call in message.tool_calls]
        if message.tool_call_id is not None:
            turn["tool_call_id"] = message.tool_call_id
        out.append(turn)
    return out


def _arguments(text: str) -> dict[str, Any]:
    """vLLM's coercion: arguments that are not a JSON object render as {} (a malformed call in the history must
    not make every later turn unrenderable)."""
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def template_tools(group: GroupRequest) -> list[dict[str, Any]] | None:
    """The group's tools as the chat template's `tools` argument (OpenAI's shape, unset fields left out)."""
    if group.tools is None:
        return None
    return [tool.model_dump(exclude_none=True) for tool in group.tools]


class ToolCallParsing:
    """Splits sample texts into content and tool calls with vLLM's parser of a name, over the model's tokenizer
    (parsers read its vocabulary for their markers). Parser classes are looked up once per name."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._parsers: dict[str, Any] = {}

    def check(self, name: str) -> None:
        """Refuses (EngineInputError) a parser vLLM does not register or that cannot work with this tokenizer
        (vLLM's own start-up check, `ParserManager.validate_parser_tokenizer`)."""
        self._parser_class(name)

    def _parser_class(self, name: str) -> Any:
        parser = self._parsers.get(name)
        if parser is None:
            from vllm.parser.parser_manager import ParserManager

            if name not in tool_parser_names():
                raise EngineInputError(f"tool_parser: {name!r} is not a vLLM tool-call parser")
            try:
                parser = ParserManager.get_parser(tool_parser_name=name, enable_auto_tools=True,
                                                  tokenizer=self._tokenizer)
            except TypeError as exc:  # vLLM's words for a parser that cannot use this tokenizer
                raise EngineInputError(f"tool_parser: {exc}") from None
            self._parsers[name] = parser
        return parser

    def parse(self, group: GroupRequest, text: str, token_ids: Sequence[int]) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of one sample's `text` under `group.tool_parser`; content None where the text was
        tool calls only. A text the parser cannot read is content with no calls (vLLM's parsers decide that)."""
        assert group.tool_parser is not None
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.renderers.chat_utils import make_tool_call_id

        request = ChatCompletionRequest(messages=[], tools=template_tools(group), tool_choice="auto")
        parser = self._parser_class(group.tool_parser)(self._tokenizer, request.tools)
        _, content, calls = parser.parse(text, request, enable_auto_tools=True, model_output_token_ids=token_ids)
        return content, [ToolCall(id=call.id or make_tool_call_id(),
                                  function=FunctionCall(name=call.name, arguments=call.arguments))
                         for call in calls or ()]
