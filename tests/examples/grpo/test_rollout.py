"""The GRPO example's service hooks against the gateway on a stub engine over real HTTP: the rollout function's
answer in TRL's shape, the step record, and the weight push after an optimizer step."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from das.service.engine.stub_engine import STUB_LOGPROB, StubEngine, StubEngineConfig
from das.service.http.gateway import create_app
from examples.grpo.rollout import (
    ServiceConfig,
    ServiceRollout,
    WeightSync,
    counts_delta,
    draft_counts_by_source,
    problem_key,
    prompt_runs,
)
from tests.service.live_gateway import LiveServer, gateway_settings
from tests.service.stub_backend import RecordingBackend, sample_tokens, stub_backend

TOKEN = "grpo-test-token"
CHAT_A = [{"role": "user", "content": "What is 2 + 2?"}]
CHAT_B = [{"role": "user", "content": "What is 13 + 5?"}]


def test_prompt_runs_keep_trl_order():
    assert prompt_runs([CHAT_A, CHAT_A, CHAT_B, CHAT_B, CHAT_B, CHAT_A]) == [(CHAT_A, 2), (CHAT_B, 3), (CHAT_A, 1)]
    assert prompt_runs([]) == []


def test_draft_counts_by_source_sum_engines_and_difference():
    text = "\n".join([
        "# TYPE das_source_draft_tokens_proposed counter",
        'das_source_draft_tokens_proposed_total{engine="n0",source="live"} 10.0',
        'das_source_draft_tokens_proposed_total{engine="n1",source="live"} 5.0',
        'das_source_draft_tokens_proposed_total{engine="n0",source="sealed-age-1"} 7.0',
        "# TYPE das_source_draft_tokens_accepted counter",
        'das_source_draft_tokens_accepted_total{engine="n0",source="live"} 4.0',
        'das_source_draft_tokens_accepted_total{engine="n0",source="sealed-age-1"} 3.0', ""])
    counts = draft_counts_by_source(text)
    assert counts == {"live": {"proposed": 15, "accepted": 4}, "sealed-age-1": {"proposed": 7, "accepted": 3}}
    assert counts_delta(counts, {"live": {"proposed": 5, "accepted": 1}}) == {
        "live": {"proposed": 10, "accepted": 3}, "sealed-age-1": {"proposed": 7, "accepted": 3}}


# The stub engine's prompt token ids of the chats (no tokenizer: 1 + each word's length), which differ between them.
PROMPT_A = [5, 3, 2, 2, 3]
PROMPT_B = [5, 3, 3, 2, 3]


class NoPromptIds(RecordingBackend):
    """Answers without the prompt's token ids, as an engine that does not report them."""

    async def generate(self, groups, on_progress=None, aborts=None):  # noqa: ANN001, ANN201 - as EngineBackend's
        async for index, sample in super().generate(groups, on_progress, aborts):
            sample.prompt_token_ids = None
            yield index, sample


def drawn(backend: RecordingBackend, chat: list[dict[str, str]], index: int) -> list[int]:
    """The tokens the stub engine drew for sample `index` of the group on `chat`."""
    (group,) = [g for batch in backend.received for g in batch if g.messages[0].content == chat[0]["content"]]
    return sample_tokens(group, index, 5)


@pytest.fixture
def service(tmp_path: Path):
    backend = stub_backend(tokens=5, draft_figures=True)
    with LiveServer(create_app(backend, gateway_settings(token=TOKEN, weights_root=tmp_path))) as server:
        yield backend, ServiceConfig(url=server.url, token=TOKEN, max_tokens=5, temperature=1.0)


def test_rollout_answers_in_trls_shape_one_request_per_prompt(service):
    backend, config = service
    rollout = ServiceRollout(config)
    out = rollout([CHAT_A, CHAT_A, CHAT_A, CHAT_B, CHAT_B, CHAT_B])
    assert backend.runs == 2  # one chat completion with n = 3 per prompt, not one per sample
    assert len(out["prompt_ids"]) == len(out["completion_ids"]) == len(out["logprobs"]) == 6
    assert out["completion_ids"] == [drawn(backend, chat, i) for chat in (CHAT_A, CHAT_B)
                                     for i in range(3)]
    assert all(lp == [STUB_LOGPROB] * 5 for lp in out["logprobs"])
    assert out["prompt_ids"] == [PROMPT_A] * 3 + [PROMPT_B] * 3
    assert out["policy_version"] == [0] * 6
    (step,) = rollout.steps
    assert (step.samples, step.completion_tokens, step.longest_tokens) == (6, 30, 5)
    assert step.draft_tokens == 6 * 2 and step.accepted_tokens == 6 * 1 and step.seconds > 0
    assert step.policy_versions == [0]
    assert [g[0].sampling.seed is not None for g in backend.received] == [True, True]  # drawn by the service


def test_a_seeded_rollout_sends_one_seed_per_step_and_request(service):
    backend, config = service
    seeded = dataclasses.replace(config, seed=3)
    rollout = ServiceRollout(seeded)
    for _ in range(2):
        rollout([CHAT_A, CHAT_A, CHAT_B, CHAT_B])
    seeds = [g[0].sampling.seed for g in backend.received]
    assert sorted(seeds) == sorted(seeded.request_seed(step, r, chat) for step in (0, 1)
                                   for r, chat in enumerate((CHAT_A, CHAT_B)))
    assert len(set(seeds)) == 4


def test_a_coupled_rollout_gives_each_problem_one_seed_for_every_step(service):
    backend, config = service
    rollout = ServiceRollout(dataclasses.replace(config, seed=3, coupled=True))
    rollout([CHAT_A, CHAT_A, CHAT_B, CHAT_B])
    rollout([CHAT_B, CHAT_B, CHAT_A, CHAT_A])  # the problems come back in another order
    seeds = [(g[0].messages[0].content, g[0].sampling.seed) for g in backend.received]
    by_problem = {content: {seed for c, seed in seeds if c == content} for content, _ in seeds}
    assert all(len(s) == 1 for s in by_problem.values()) and len(by_problem) == 2
    assert by_problem[CHAT_A[0]["content"]] != by_problem[CHAT_B[0]["content"]]
    # each record carries the key its sample drew with: the engine's, and the same at both visits
    problem_of = {chat[0]["content"]: problem_key(chat) for chat in (CHAT_A, CHAT_B)}
    drew = {(problem_of[g[0].messages[0].content], i): g[0].sample_key(i)
            for g in backend.received for i in range(g[0].n)}
    keys = {(r["problem_id"], r["sample_index"]): r["sample_key"] for r in rollout.records}
    assert len(rollout.records) == 8 and len(keys) == 4 and keys == drew
    other = ServiceRollout(dataclasses.replace(config, seed=4, coupled=True))
    other([CHAT_A, CHAT_A])
    assert backend.received[-1][0].sampling.seed not in by_problem[CHAT_A[0]["content"]]  # the run's seed counts


def test_rollout_keeps_every_sample_as_a_trace_record(service):
    from das.drafter.records import RolloutRecord

    backend, config = service
    rollout = ServiceRollout(config)
    rollout([CHAT_A, CHAT_A, CHAT_B])
    records = [RolloutRecord(**r) for r in rollout.records]  # the trace format accepts them as they are
    assert [(r.problem_id == problem_key(CHAT_A), r.sample_index) for r in records] == [
        (True, 0), (True, 1), (False, 0)]
    assert [r.output_token_ids for r in records] == [tuple(drawn(backend, chat, i))
                                                     for chat, i in ((CHAT_A, 0), (CHAT_A, 1), (CHAT_B, 0))]
    assert all(r.policy_version == 0 and r.sample_key is None for r in records)  # unseeded: no key known
    assert records[0].prompt_token_ids == tuple(PROMPT_A) and records[2].prompt_token_ids == tuple(PROMPT_B)


def test_rollout_refuses_an_answer_without_prompt_ids(tmp_path):
    backend = NoPromptIds(StubEngine(StubEngineConfig(tokens=5)))
    with LiveServer(create_app(backend, gateway_settings(token=TOKEN))) as server:
        rollout = ServiceRollout(ServiceConfig(url=server.url, token=TOKEN, max_tokens=5, temperature=1.0))
        with pytest.raises(RuntimeError, match="prompt_token_ids"):
            rollout([CHAT_A, CHAT_A])


def test_weight_sync_saves_pushes_the_next_version_and_keeps_one_checkpoint(service, tmp_path):
    backend, config = service

    class Model:
        def save_pretrained(self, path: Path, safe_serialization: bool) -> None:
            assert safe_serialization
            path.mkdir(parents=True)
            (path / "model.safetensors").write_bytes(b"weights")

    sync = WeightSync(config, tmp_path)
    for step in (1, 2):
        sync.on_step_end(None, SimpleNamespace(global_step=step), None, model=Model())
    assert [r["policy_version"] for r in sync.reloads] == [1, 2] == [r["step"] for r in sync.reloads]
    assert backend.policy_version == 2
    assert not (tmp_path / "step-00001").exists() and (tmp_path / "step-00002").exists()
    with pytest.raises(RuntimeError, match="409"):  # not newer than the served version: refused, said so
        sync.push(tmp_path / "step-00002", 2)
