import asyncio
from types import SimpleNamespace

import pytest

from das.service.engine.vllm.cost_warmup import WARMUP_PROBLEM, warm_up_cost_fit
from das.service.engine.vllm.extra_args import RequestTags
from tests.service.engine.vllm.vllm_frontend import PassThroughFrontend


class RecordingLLM(PassThroughFrontend):
    """Stands in for AsyncLLM.generate: records each request and streams its max_tokens tokens in two deltas."""

    def __init__(self) -> None:
        self.requests: list[tuple[list[int], object, str]] = []

    async def generate(self, prompt, params, request_id):
        self.requests.append((prompt["prompt_token_ids"], params, request_id))
        half = params.max_tokens // 2
        for part in (list(range(half)), list(range(params.max_tokens - half))):
            await asyncio.sleep(0)
            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=part)])


def test_the_warmup_runs_the_batch_down_from_its_size_to_one_two_steps_per_size():
    llm = RecordingLLM()
    tokens = asyncio.run(warm_up_cost_fit(llm, 6, vocab_size=1010))
    assert tokens == 2 * (1 + 2 + 3 + 4 + 5 + 6)
    assert sorted(p.max_tokens for _, p, _ in llm.requests) == [2, 4, 6, 8, 10, 12]
    assert all(p.ignore_eos and p.temperature == 1.0 for _, p, _ in llm.requests)
    tags = [RequestTags.from_extra_args(p.extra_args, prompt) for prompt, p, _ in llm.requests]
    assert {t.problem_id for t in tags} == {WARMUP_PROBLEM}  # one throwaway problem, never a caller's
    assert not any(t.draft for t in tags)  # the drafter drafts nothing for them: no draft count sees them
    assert all(t.cost_probe for t in tags)  # but they verify junk drafts that time a drafted step
    assert len({rid for _, _, rid in llm.requests}) == 6
    prompts = [tuple(prompt) for prompt, _, _ in llm.requests]
    assert len(set(prompts)) == 6 and all(0 <= t < 1010 for p in prompts for t in p)


def test_a_warmup_of_no_requests_is_refused():
    with pytest.raises(ValueError, match="requests"):
        asyncio.run(warm_up_cost_fit(RecordingLLM(), 0, vocab_size=100))
