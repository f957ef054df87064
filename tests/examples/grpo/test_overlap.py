"""The GRPO example's overlapped rollout against the gateway on a stub engine over real HTTP: a prefetched step
answers with its own prompts' samples, a step the plan got wrong falls back to generating on demand, the request for
step t+1 is under way before step t's answer is consumed, and the plan replays TRL's sampler."""

from __future__ import annotations

import io
import json
import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from das.service.http.gateway import create_app
from examples.grpo.report import compare
from examples.grpo.rollout import ServiceConfig, ServiceRollout, trl_generation_batches
from tests.service.live_gateway import LiveServer, gateway_settings
from tests.service.stub_backend import RecordingBackend, stub_backend

TOKEN = "grpo-overlap-token"
CHAT_A = [{"role": "user", "content": "What is 2 + 2?"}]
CHAT_B = [{"role": "user", "content": "What is 13 + 5?"}]
CHAT_C = [{"role": "user", "content": "What is 100 + 23?"}]
STEP_A, STEP_B, STEP_C = [CHAT_A] * 2, [CHAT_B] * 2, [CHAT_C] * 2


def ids(chat: list[dict[str, str]]) -> list[int]:
    """The stub engine's prompt token ids of a chat (no tokenizer: 1 + each word's length), which tell the three
    apart."""
    return [1 + len(word) for word in " ".join(m["content"] for m in chat).split()]


IDS_A, IDS_B, IDS_C = ids(CHAT_A), ids(CHAT_B), ids(CHAT_C)


def serve(tmp_path: Path, **stub: float) -> tuple[RecordingBackend, LiveServer]:
    backend = stub_backend(tokens=5, **stub)
    server = LiveServer(create_app(backend, gateway_settings(token=TOKEN, weights_root=tmp_path)))
    return backend, server


def config(server: LiveServer) -> ServiceConfig:
    return ServiceConfig(url=server.url, token=TOKEN, max_tokens=5, temperature=1.0, seed=3)


def asked(backend: RecordingBackend) -> list[str]:
    """The content of the first message of every request the backend received, in order."""
    return [groups[0].messages[0].content for groups in backend.received]


def test_a_prefetched_step_answers_with_its_own_prompts_samples(tmp_path):
    backend, server = serve(tmp_path)
    with server:
        rollout = ServiceRollout(config(server))
        rollout.prefetch([STEP_A, STEP_B, STEP_C])
        first = rollout(STEP_A)
        second = rollout(STEP_B)
        third = rollout(STEP_C)
        rollout.on_train_end(None, None, None)
    assert (first["prompt_ids"], second["prompt_ids"], third["prompt_ids"]) == ([IDS_A] * 2, [IDS_B] * 2, [IDS_C] * 2)
    assert [s.prefetched for s in rollout.steps] == [False, True, True]
    assert asked(backend) == [CHAT_A[0]["content"], CHAT_B[0]["content"], CHAT_C[0]["content"]]  # none twice
    assert [r["prompt_token_ids"] for r in rollout.records] == [IDS_A] * 2 + [IDS_B] * 2 + [IDS_C] * 2
    # a prefetched request carries its own step's seed, as the same step unoverlapped would
    seeds = [groups[0].sampling.seed for groups in backend.received]
    assert seeds == [rollout.config.request_seed(step, 0, chat) for step, chat in enumerate((CHAT_A, CHAT_B, CHAT_C))]
    assert all(s.spanning_samples == 0 and s.policy_versions == [0] for s in rollout.steps)


def test_a_step_the_plan_got_wrong_is_generated_on_demand_and_the_prefetch_dropped(tmp_path, caplog):
    backend, server = serve(tmp_path)
    with server, caplog.at_level(logging.WARNING, logger="examples.grpo.rollout"):
        rollout = ServiceRollout(config(server))
        rollout.prefetch([STEP_A, STEP_B, STEP_A])
        rollout(STEP_A)
        out = rollout(STEP_C)  # the plan said B
        rollout(STEP_A)  # the plan is still followed after a miss
        rollout.on_train_end(None, None, None)
    assert out["prompt_ids"] == [IDS_C] * 2
    assert [s.prefetched for s in rollout.steps] == [False, False, True]
    assert asked(backend) == [CHAT_A[0]["content"], CHAT_B[0]["content"], CHAT_C[0]["content"],
                              CHAT_A[0]["content"]]
    assert [r["prompt_token_ids"] for r in rollout.records] == [IDS_A] * 2 + [IDS_C] * 2 + [IDS_A] * 2  # B's: dropped
    assert "rollout step 1" in caplog.text and "prefetched" in caplog.text


def test_the_next_steps_request_starts_before_this_steps_answer_is_consumed(tmp_path):
    backend, server = serve(tmp_path, first_sample_s=0.3)
    with server:
        rollout = ServiceRollout(config(server))
        rollout.prefetch([STEP_A, STEP_B])
        rollout(STEP_A)
        deadline = time.monotonic() + 10
        while len(backend.received) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert asked(backend) == [CHAT_A[0]["content"], CHAT_B[0]["content"]]  # B under way, not yet asked for
        assert not rollout._pending[1].done()  # still generating while the trainer would train step 0
        rollout.on_step_end(None, None, None)  # the end of step 0 waits for it before the push
        assert rollout._pending[1].done() and rollout.steps[0].wait_s >= 0.2
        before = time.perf_counter()
        out = rollout(STEP_B)
        assert time.perf_counter() - before < 0.25  # answered from the prefetch: no generation left to wait for
        rollout.on_train_end(None, None, None)
    assert out["prompt_ids"] == [IDS_B] * 2 and rollout.steps[1].prefetched and len(backend.received) == 2


def test_without_a_plan_every_step_is_generated_on_demand(tmp_path):
    backend, server = serve(tmp_path)
    with server:
        rollout = ServiceRollout(config(server))
        rollout(STEP_A)
        rollout.on_step_end(None, None, None)
        rollout(STEP_B)
    assert [s.prefetched for s in rollout.steps] == [False, False] and backend.runs == 2
    assert all(s.wait_s >= s.seconds > 0 for s in rollout.steps)


@pytest.mark.parametrize(("steps_per_generation", "num_iterations"), [(1, 1), (2, 1), (1, 3)])
def test_the_plan_replays_trls_sampler_across_epochs(steps_per_generation, num_iterations):
    """TRL's dataloader, as its trainer builds it on one process: its RepeatSampler in generation batches,
    iterated once per epoch; TRL generates on every `steps_per_generation * num_iterations`-th batch."""
    from torch.utils.data import DataLoader
    from trl.trainer.utils import RepeatSampler

    dataset = [{"prompt": [{"role": "user", "content": f"problem {i}"}]} for i in range(7)]
    prompts, samples, max_steps = 2, 3, 9
    args = SimpleNamespace(max_steps=max_steps, gradient_accumulation_steps=steps_per_generation,
                           steps_per_generation=steps_per_generation,
                           generation_batch_size=prompts * samples * steps_per_generation)
    generate_every = steps_per_generation * num_iterations

    def sampler() -> RepeatSampler:
        return RepeatSampler(dataset, mini_repeat_count=samples, batch_size=args.generation_batch_size // samples,
                             repeat_count=generate_every, shuffle=True, seed=5)

    trainer = SimpleNamespace(args=args, num_iterations=num_iterations, train_dataset=dataset,
                              _get_train_sampler=sampler)
    loader = DataLoader(dataset, batch_size=args.generation_batch_size, sampler=sampler(), collate_fn=list)
    micro_steps = max_steps * steps_per_generation
    batches = [batch for _ in range(micro_steps) for batch in loader][:micro_steps]  # epochs, as the trainer
    expected = [[row["prompt"] for row in batch] for batch in batches[::generate_every]]
    plan = list(trl_generation_batches(trainer))
    assert plan == expected and len(plan) == -(-micro_steps // generate_every)
    assert len({str(p) for p in plan}) > 1  # shuffled across epochs, not one batch over and over


def test_the_plan_needs_max_steps():
    trainer = SimpleNamespace(args=SimpleNamespace(max_steps=-1))
    with pytest.raises(ValueError, match="max_steps"):
        next(trl_generation_batches(trainer))


def test_the_report_states_seconds_a_step_and_the_wait_for_rollouts(tmp_path):
    (tmp_path / "das").mkdir()
    lines = [{"step": step, "reward": 0.1 * step, "sync_mode": "push", "overlap": True, "step_s": step_s,
              "policy_lag": min(step - 1, 1), "sync": {"reload_s": 1.0, "policy_version": step},
              "rollout": {"seconds": 5.0, "completion_tokens": 100, "longest_tokens": 10, "samples": 4,
                          "draft_tokens": 0, "accepted_tokens": 0, "policy_versions": [max(step - 2, 0)],
                          "drafts_by_source": {}, "wait_s": wait_s, "prefetched": step > 1, "spanning_samples": 0}}
             for step, step_s, wait_s in ((1, 12.0, 5.0), (2, 8.0, 1.0), (3, 9.0, 2.0))]
    (tmp_path / "das" / "steps.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    printed = io.StringIO()
    summary = compare(tmp_path, ["das"], Console(file=printed, width=200))
    das = summary["arms"]["das"]
    assert das["step_seconds"] == [12.0, 8.0, 9.0] and das["rollout_wait_seconds"] == [5.0, 1.0, 2.0]
    assert not das["policy_version_advances_every_step"]  # one step behind: said, not hidden
    assert "das (push, overlapped): 9.0 s a step (median), 2.0 s of it waiting for rollouts" in printed.getvalue()
