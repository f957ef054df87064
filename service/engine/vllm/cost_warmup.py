"""Start-up warm-up that shows the online cost fit every batch size before the first batch arrives.

The draft budget decides on r = c_base / c_tok (scheduler/budget.py), and one RL batch keeps the number of running
requests in a narrow band (say 60-130) where the online fit (scheduler/cost_model.py) cannot tell a fixed cost from
a per-token one: the prior's shape decides until the batch's tail has spread the sizes. With the prior shipped for
SmolLM2 (measured on an Intel machine, r ~ 91) on the AMD development machine (r ~ 13), a synthetic replay of such
steps put c_base at 2-4x its value for the first ~100 steps, so the first batch drafted as if tokens were cheap.

So an engine with the length-aware budget decodes `requests` requests once at start, request i (1-based) stopping
after 2i tokens: the running batch shrinks from `requests` to 1, two steps per size, and the proposer times those
steps like any other (prefill excluded). ~2 x requests decode steps: ~4 s for 16 on the 2-core CPU with SmolLM2,
well under a second on a GPU. The probes get no drafts from the drafter (`RequestTags.draft`), so no draft count or
acceptance estimate sees them, and their text goes to one throwaway problem's history (`WARMUP_PROBLEM`), never a
caller's.

The same steps price a drafted step (c_spec: the verification sampler, the spec-decode bookkeeping): on every
other step one probe verifies a junk draft token (`RequestTags.cost_probe`), so the fit sees a drafted and a plain
step at each batch size. Without them c_spec came only from exploration's rare drafted steps, and a prior far above
the machine's price kept those rare: Qwen2.5's shipped 50 ms (measured before the CPU sampling fixes) left das
hardly drafting on Qwen (docs/design.md#the-online-cost-model, Warm-up).
"""

from __future__ import annotations

import asyncio
from typing import Any

from das.service.engine.vllm.extra_args import RequestTags
from das.service.engine.vllm.sampling import sampling_params
from das.service.engine.vllm.token_prompt import engine_prompt
from das.service.wire.api import SamplingSpec

WARMUP_PROBLEM = "das-cost-warmup"
_PROMPT_TOKENS = 8


async def warm_up_cost_fit(llm: Any, requests: int, vocab_size: int) -> int:
    """Runs the staggered decode on vLLM `AsyncLLM` `llm`; returns the tokens generated (sum of 2i, i = 1..requests).
    `requests` >= 1; prompts are distinct runs of token ids below `vocab_size`."""
    if requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")

    async def one(i: int) -> int:
        prompt = [(1000 + i * _PROMPT_TOKENS + j) % vocab_size for j in range(_PROMPT_TOKENS)]
        tags = RequestTags(WARMUP_PROBLEM, key=f"{WARMUP_PROBLEM}-{i}", sample_index=i, draft=False,
                           cost_probe=True)
        params = sampling_params(SamplingSpec(max_tokens=2 * i, temperature=1.0, ignore_eos=True), vocab_size,
                                 tags.to_extra_args())
        tokens = 0
        async for out in llm.generate(engine_prompt(llm, prompt), params, request_id=tags.key):
            tokens += len(out.outputs[0].token_ids)
        return tokens

    return sum(await asyncio.gather(*(one(i) for i in range(1, requests + 1))))
