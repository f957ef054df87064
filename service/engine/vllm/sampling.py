"""A group's sampling as vLLM's `SamplingParams`, built and checked in the request path as vLLM's own server does,
so whatever vLLM would refuse is refused before anything is scheduled (`EngineInputError` naming the field) and
never inside a running sample's task, where a refusal used to leave its group waiting forever."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from das.service.engine.contract import EngineInputError
from das.service.wire.api import SamplingSpec

if TYPE_CHECKING:
    from vllm import SamplingParams


def sampling_params(spec: SamplingSpec, vocab_size: int, extra_args: dict[str, Any] | None = None
                    ) -> SamplingParams:
    """One sample's `SamplingParams` (n=1, streamed as deltas, with the sampled token's logprob), with
    `extra_args` for the proposer. EngineInputError names the `sampling.` field vLLM refuses: its own checks
    (`SamplingParams._verify_args`) and the model-dependent one our fields reach (stop token ids within the
    vocabulary, which vLLM checks only when the request reaches the engine)."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import RequestOutputKind

    outside = [t for t in spec.stop_token_ids if not 0 <= t < vocab_size]
    if outside:
        raise EngineInputError(f"sampling.stop_token_ids: {outside[0]} is outside the vocabulary [0, {vocab_size})")
    try:
        return SamplingParams(
            n=1, max_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
            stop=list(spec.stop), stop_token_ids=list(spec.stop_token_ids), ignore_eos=spec.ignore_eos, logprobs=0,
            output_kind=RequestOutputKind.DELTA, extra_args=extra_args)
    except (VLLMValidationError, ValueError, TypeError) as exc:  # some of vLLM's checks raise plain errors
        field = getattr(exc, "parameter", None)
        raise EngineInputError(f"sampling.{field}: {exc}" if field else f"sampling: {exc}") from None
