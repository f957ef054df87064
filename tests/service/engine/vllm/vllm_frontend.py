"""What a stand-in for vLLM's AsyncLLM needs of its frontend for `token_prompt.engine_prompt`: a decoder-only
model config and a renderer that passes a parsed token prompt through unchanged."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


class PassThroughRenderer:
    default_cmpl_tok_params = None

    def render_cmpl(self, prompts: list[Any], params: Any) -> list[Any]:
        return list(prompts)


class PassThroughFrontend:
    """Mixin for AsyncLLM stand-ins: `generate` then receives {"prompt_token_ids": [...]}."""

    model_config = SimpleNamespace(is_encoder_decoder=False)
    renderer = PassThroughRenderer()
