"""`das serve` as a real process on loopback with a tiny model: two epochs through the trainer client, repeated
requests through the official `openai` client, then a restart on the saved history, and on the restarted server a
session (the must-show check of sessions): the official `openai` client runs a 3-turn session (session_id in
extra_body, prompt as token ids, return_token_ids appended to the context with a tool's tokens), and /metrics shows
the das_session_* series and the engine's prefix-cache hits: turns after the first find at least 90% of their
context in the prefix cache."""

from __future__ import annotations

import re
import time
from collections import Counter

import httpx
import openai
import pytest

from das.service.client import RolloutClient
from das.service.engine.vllm.known_warnings import KNOWN_WARNINGS
from das.service.engine.vllm.models import prepare_model
from tests.tiny_models import build_tiny_model
from tests.service.serve_process import Server, TOKEN, metric


GROUPS = [{"problem_id": f"p{i}", "prompt_token_ids": [5, 6, 7 + i], "n": 4,
           "sampling": {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}} for i in range(3)]
EXPECTED = Counter((f"p{i}", j) for i in range(3) for j in range(4))


PROMPT = [5 + (7 * i) % 50 for i in range(320)]  # ten 32-token KV blocks (vLLM's CPU block size here)
TOOL_OUTPUT = [11, 12, 13, 14, 15, 16, 17, 18]


def prompt_tokens(server: Server, after: float) -> tuple[float, float]:
    """(prompt tokens, of them cached) of the engine once its figures (refreshed every 2 s) passed `after`."""
    deadline = time.monotonic() + 20
    while True:
        text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
        seen = metric(text, "das_engine_prompt_tokens")
        if seen > after or time.monotonic() > deadline:
            return seen, metric(text, "das_engine_prompt_tokens_cached")
        time.sleep(0.25)


def check_a_three_turn_session(server: Server) -> None:
    """A 3-turn session through the official `openai` client on `server` (the module's docstring)."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=TOKEN, max_retries=0, timeout=120)
    context, hits = PROMPT, []
    seen, cached = prompt_tokens(server, -1)
    for turn in range(3):
        reply = client.completions.create(
            model="das", prompt=context, max_tokens=48, temperature=0.0,
            extra_body={"session_id": "agent-1", "problem_id": "task", "return_token_ids": True,
                        "ignore_eos": True})
        (choice,) = reply.choices
        assert choice.prompt_token_ids == context and len(choice.token_ids) == 48
        now_seen, now_cached = prompt_tokens(server, seen)
        assert now_seen - seen == len(context)
        hits.append((now_cached - cached) / len(context))
        seen, cached = now_seen, now_cached
        context = [*context, *choice.token_ids, *TOOL_OUTPUT]
    print(f"prefix-cache hits per turn (share of the turn's context): {hits}")
    assert all(h >= 0.9 for h in hits[1:]), hits
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert metric(text, "das_session_turns") == 3 and metric(text, "das_session_open") == 1
    assert metric(text, "das_session_moves") == 0
    # the session's context is a draft source of its own (how much it drafts depends on measured step times)
    by_source = re.findall(r'^das_source_draft_tokens_(proposed|accepted)_total\{[^}]*source="([^"]+)"\} (\S+)$',
                           text, re.MULTILINE)
    print(f"drafts by source (proposed/accepted, source, tokens): {by_source}")
    assert {source for _, source, _ in by_source} >= {"context", "live"}
    session = httpx.get(f"{server.url}/v1/sessions/agent-1",
                        headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert [t["prompt_tokens"] for t in session["turns"]] == [320, 376, 432]
    assert len({t["engine"] for t in session["turns"]}) == 1


def run_epoch(client: RolloutClient) -> list:
    samples = list(client.generate(GROUPS))
    assert Counter((s.problem_id, s.sample_index) for s in samples) == EXPECTED  # each exactly once
    assert all(len(s.output_token_ids) == 24 and s.finish_reason == "length" for s in samples)
    return samples


def test_das_serve_two_epochs_and_openai_requests_then_a_restart_drafts_from_the_saved_history_and_serves_a_session(
        tmp_path):
    model = build_tiny_model(tmp_path / "tiny", prepare_model("smollm2", progress=False), vocab_size=64, seed=0,
                             sharpness=12.0)
    state = tmp_path / "state"
    # Uniform drafting first: how much the default budget drafts depends on the step times it measures (a loaded
    # CI machine drafted 7 accepted tokens, an idle one over 119), while these checks need drafts every step.
    server = Server(model, state, "--budget", "uniform")
    try:
        server.wait_ready()
        assert httpx.post(f"{server.url}/v1/rollouts", json={"groups": []}).status_code == 401
        with RolloutClient(server.url, TOKEN) as client:
            epochs = [run_epoch(client) for _ in range(2)]
            accepted = [sum(s.accepted_tokens for s in e) for e in epochs]
            assert accepted[1] > 0 and accepted[1] > accepted[0]
            held = client.history("p0")
            assert held.rollouts == 8 and held.output_tokens == 8 * 24 and held.policy_versions == [0]
            # Streaming: a long group keeps the batch running while the short ones have already arrived.
            long_group = {**GROUPS[0], "problem_id": "long", "n": 1,
                          "sampling": {"max_tokens": 200, "temperature": 0.0, "ignore_eos": True}}
            stream = client.generate([long_group, GROUPS[1]])
            samples = iter(stream)
            first = next(samples)
            assert first.problem_id == "p1" and client.status(stream.batch_id).status == "running"
            streamed = [first, *samples]
            assert [s.problem_id for s in streamed][-1] == "long" and len(streamed) == 5

        text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
        assert metric(text, "das_samples_served") == 5 + 24  # the streaming batch and two epochs
        assert metric(text, "das_draft_tokens_accepted") == sum(accepted) + sum(s.accepted_tokens for s in streamed)
        assert metric(text, "das_engines_ready") == 1
        # The store's figures are refreshed every 2 s: wait for one that has seen every push.
        deadline = time.monotonic() + 20
        while metric(text, "das_history_tokens_stored") < 872 and time.monotonic() < deadline:
            time.sleep(0.5)
            text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
        assert metric(text, "das_history_tokens_stored") == 872 == 3 * 8 * 24 + 4 * 24 + 200
        # the engine holds what no snapshot has yet: at least the last push (a reply names only what an earlier
        # snapshot holds), at most all 29 rollouts
        assert 1 <= metric(text, "das_history_outbox_records") <= 29
        assert metric(text, "das_history_records_given_up") == 0
        # the engine's own tally by draft source, from the same refresh: every accepted draft token counted once
        assert metric(text, "das_source_draft_tokens_accepted") == metric(text, "das_draft_tokens_accepted")

        # The official `openai` client on the same server: repeated completions for one problem draft from its
        # first request's rollouts (and the siblings' live text), with the greedy tokens unchanged.
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=TOKEN, max_retries=0, timeout=120)
        request = {"model": "das", "prompt": [5, 6, 40], "n": 4, "max_tokens": 24, "temperature": 0.0,
                   "logprobs": 0, "extra_body": {"problem_id": "openai", "ignore_eos": True, "return_token_ids": True}}
        first, second = (client.completions.create(**request) for _ in range(2))
        for reply in (first, second):
            assert [len(c.token_ids) for c in reply.choices] == [24] * 4
            assert all(c.prompt_token_ids == [5, 6, 40] and len(c.logprobs.token_logprobs) == 24
                       for c in reply.choices)
            assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (3, 96)
        assert second.das["accepted_tokens"] > 0
        assert [c.token_ids for c in second.choices] == [c.token_ids for c in first.choices]
        with pytest.raises(openai.BadRequestError) as long_prompt:
            client.completions.create(model="das", prompt=[5] * 300)
        assert long_prompt.value.param == "prompt" and "context" in long_prompt.value.message
    finally:
        out = server.stop()
    # the snapshots at the signal and at shutdown: two generations per shard, nothing quarantined; the journal of
    # the batches the client named; the lock file that keeps a second das serve off this directory; and the session
    # journal (rewritten at start with the open sessions: none here)
    assert sorted(p.name for p in state.iterdir()) == ["batch-journal.jsonl"] + [
        f"history-shard-{i}.msgpack{g}" for i in range(2) for g in ("", ".prev")] + [
        "serve.lock", "session-journal.jsonl"], out
    assert (state / "session-journal.jsonl").stat().st_size == 0
    # the log a user reads: none of the vLLM warnings known to say nothing (known_warnings.py), no deprecated
    # prompt form, no leak report at exit (from the CUDA triton that setup.sh removes)
    assert not [k.text for k in KNOWN_WARNINGS if k.text in out], out
    assert "Passing raw prompts" not in out and "nanobind: leaked" not in out, out
    assert "constructor arguments in the object store" not in out, out

    # The restart runs the defaults (the length-aware budget on the engine's live cost fit): what it drafts depends
    # on measured step times, so only what cannot depend on them is checked.
    restarted = Server(model, state, "--max-model-len", "512")  # the session's context grows to 480 tokens
    try:
        restarted.wait_ready()
        check_a_three_turn_session(restarted)  # first: its prompt-token counts start from the start's
        with RolloutClient(restarted.url, TOKEN) as client:
            assert client.history("p0").rollouts == 8  # restored before the first batch
            again = run_epoch(client)
        # greedy outputs identical to before (same weights, lossless verification whatever the budget drafted)
        before = {(s.problem_id, s.sample_index): s.output_token_ids for s in epochs[0]}
        assert {(s.problem_id, s.sample_index): s.output_token_ids for s in again} == before
        # the live cost fit is exported, fed from the start-up warm-up and the batch
        deadline = time.monotonic() + 20
        while True:
            text = httpx.get(f"{restarted.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
            if metric(text, "das_engine_step_token_seconds") > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert metric(text, "das_engine_step_token_seconds") > 0 and metric(text, "das_engine_step_base_seconds") > 0
    finally:
        restarted.stop()
