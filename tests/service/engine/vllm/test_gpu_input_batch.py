"""DasProposer driven through a V1 model runner stand-in built on the GPU build's own input batch: the GPU wheel's
vllm/v1/worker/gpu_input_batch.py (pinned release), loaded from the wheel into a module of its own (its imports
resolve to the installed vLLM of the same release; it needs no CUDA), holding the requests, token table and
counts that vLLM hands the proposer. The stand-in calls `propose` exactly as the GPU build's runner does (the call
is checked by gpu_contract.check_custom_class_proposer) and does the runner's bookkeeping between steps."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch
from vllm import SamplingParams

from das.service.engine.vllm.extra_args import RequestTags
from das.service.engine.vllm.proposer import DasProposer
from tests.service.engine.vllm.gpu_wheel import Sources, WheelUnavailable, gpu_wheel
from tests.service.engine.vllm.proposer_setup import PROMPT, RESPONSE, make_proposer

INPUT_BATCH = "v1/worker/gpu_input_batch.py"


def load_module(sources: Sources, path: str, name: str) -> types.ModuleType:
    """`path` of the wheel as a fresh module `name` (not vLLM's installed one)."""
    module = types.ModuleType(name)
    module.__file__ = f"<GPU wheel>/vllm/{path}"
    sys.modules[name] = module  # dataclasses look their module up while the class body runs
    try:
        exec(compile(sources.text(path), module.__file__, "exec"), module.__dict__)
    finally:
        del sys.modules[name]
    return module


@pytest.fixture(scope="module")
def gpu_batch_module() -> types.ModuleType:
    try:
        sources = Sources(gpu_wheel())
    except WheelUnavailable as exc:
        pytest.fail(str(exc))
    module = load_module(sources, INPUT_BATCH, "das_gpu_wheel_input_batch")
    import vllm.v1.worker.gpu_input_batch as installed

    assert module.InputBatch is not installed.InputBatch  # the wheel's class, not the CPU build's
    return module


class V1Runner:
    """What the GPU build's V1 runner does around its drafter: `requests`, `input_batch` (the wheel's InputBatch),
    the custom_class `propose` call, and committing sampled tokens into the batch's token table."""

    def __init__(self, batch_module: types.ModuleType, vocab: int = 100, max_model_len: int = 64) -> None:
        self.module = batch_module
        self.input_batch = batch_module.InputBatch(
            max_num_reqs=8, max_model_len=max_model_len, max_num_batched_tokens=256, device=torch.device("cpu"),
            vocab_size=vocab, block_sizes=[16], max_num_blocks_per_req=[max_model_len // 16], num_spec_tokens=4)
        self.requests: dict[str, Any] = {}

    def add(self, rid: str, prompt: list[int], tags: RequestTags) -> None:
        params = SamplingParams(max_tokens=32, temperature=1.0, extra_args=tags.to_extra_args())
        state = self.module.CachedRequestState(req_id=rid, prompt_token_ids=list(prompt), mm_features=[],
                                               sampling_params=params, generator=None, block_ids=([0],),
                                               num_computed_tokens=0, output_token_ids=[])
        self.requests[rid] = state
        self.input_batch.add_request(state)
        self.input_batch.refresh_metadata()

    def remove(self, rid: str) -> None:
        self.input_batch.remove_request(rid)
        self.input_batch.condense()
        self.input_batch.refresh_metadata()  # as the runner's _update_states ends
        del self.requests[rid]

    def step(self, drafter: DasProposer, committed: dict[str, list[int]]) -> dict[str, list[int]]:
        batch = self.input_batch
        for rid, tokens in committed.items():
            i = batch.req_id_to_index[rid]
            end = int(batch.num_tokens_no_spec[i])
            batch.token_ids_cpu[i, end:end + len(tokens)] = tokens
            batch.num_tokens_no_spec[i] = end + len(tokens)
            self.requests[rid].output_token_ids.extend(tokens)
        sampled_token_ids = [committed.get(rid, []) for rid in batch.req_ids]
        drafts = drafter.propose(sampled_token_ids, self.input_batch.num_tokens_no_spec,
                                 self.input_batch.token_ids_cpu, slot_mappings=None)
        return dict(zip(batch.req_ids, drafts))


def decode(drafter: DasProposer, runner: V1Runner, rid: str, tags: RequestTags) -> int:
    """Decodes RESPONSE for one request, verifying drafts greedily against it; the number of steps."""
    runner.add(rid, PROMPT, tags)
    drafts, pos, steps = runner.step(drafter, {}), 0, 0
    while pos < len(RESPONSE):
        draft, accepted = drafts[rid], 0
        while (accepted < len(draft) and pos + accepted < len(RESPONSE) - 1
               and draft[accepted] == RESPONSE[pos + accepted]):
            accepted += 1
        commit = RESPONSE[pos:pos + accepted + 1]
        pos += len(commit)
        drafts, steps = runner.step(drafter, {rid: commit}), steps + 1
    runner.remove(rid)
    return steps


# A drafted step priced like a plain one: these tests follow drafts through the input batch, not the budget's gate.
FREE_STEP = {"c_base_s": 20e-3, "c_tok_s": 0.5e-3}


def test_the_proposer_drafts_a_siblings_tokens_through_the_gpu_builds_input_batch(gpu_batch_module):
    drafter, runner = make_proposer(budget=FREE_STEP), V1Runner(gpu_batch_module)
    drafter.attach(runner)
    first_steps = decode(drafter, runner, "a", RequestTags("p", key="a"))
    first = drafter.pop_counts(["a"])["a"]
    second_steps = decode(drafter, runner, "b", RequestTags("p", key="b"))
    second = drafter.pop_counts(["b"])["b"]
    assert first.accepted == 0 and first_steps == len(RESPONSE)
    # a cold calibrator rates a continuation seen once at 1/3 a token: the default plan drafts 1-3 tokens a step
    assert second.accepted >= 6 and second_steps < first_steps and drafter.failures == 0


def test_rows_follow_the_input_batchs_order_after_a_request_leaves(gpu_batch_module):
    """Three requests; the first leaves and vLLM condenses the batch (the last row moves into the hole): drafts
    still reach the right requests."""
    drafter, runner = make_proposer(budget=FREE_STEP), V1Runner(gpu_batch_module)
    drafter.attach(runner)
    decode(drafter, runner, "seed", RequestTags("p", key="seed"))
    for rid, problem in (("x", "other"), ("y", "p"), ("z", "p")):
        runner.add(rid, PROMPT, RequestTags(problem, key=rid))
    runner.step(drafter, {})
    runner.remove("x")
    assert runner.input_batch.req_ids == ["z", "y"]  # condensed: the last request took the empty row
    drafts = runner.step(drafter, {"y": RESPONSE[:1], "z": RESPONSE[:1]})
    assert drafts["y"] and drafts["z"] and drafts["y"] == RESPONSE[1:1 + len(drafts["y"])]
    assert drafts["z"] == RESPONSE[1:1 + len(drafts["z"])] and drafter.failures == 0


def test_the_drive_fails_when_the_input_batch_changes_what_the_proposer_reads():
    sources = Sources(gpu_wheel()).mutated(INPUT_BATCH, lambda text: text.replace("num_tokens_no_spec",
                                                                                  "num_tokens_unverified"))
    runner = V1Runner(load_module(sources, INPUT_BATCH, "das_gpu_wheel_input_batch_mutated"))
    drafter = make_proposer()
    drafter.attach(runner)
    runner.add("a", PROMPT, RequestTags("p", key="a"))
    with pytest.raises(AttributeError, match="num_tokens_no_spec"):
        runner.step(drafter, {})
