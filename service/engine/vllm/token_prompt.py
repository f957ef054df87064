"""A prompt of token ids in the form vLLM's engine takes it: rendered by the engine's own Renderer.

vLLM 0.32 deprecates handing `AsyncLLM.generate` a raw `{"prompt_token_ids": ...}` dict (it logs "Passing raw
prompts to InputProcessor is deprecated" and will drop the path); its docstring shows the replacement, which is
what the raw path did inside `add_request` anyway, so the cost per request is unchanged."""

from __future__ import annotations

from typing import Any


def engine_prompt(llm: Any, token_ids: list[int]) -> Any:
    """`token_ids` rendered for vLLM `AsyncLLM` `llm` (its `model_config` and `renderer`), ready for `generate`."""
    from vllm.renderers.inputs.preprocess import parse_model_prompt

    parsed = parse_model_prompt(llm.model_config, {"prompt_token_ids": token_ids})
    (rendered,) = llm.renderer.render_cmpl([parsed], llm.renderer.default_cmpl_tok_params)
    return rendered
