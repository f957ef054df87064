"""A session against `das serve` with a tiny real model (the must-show check of sessions): the official `openai`
client runs a 3-turn session (session_id in extra_body, prompt as token ids, return_token_ids appended to the
context with a tool's tokens), and /metrics shows the das_session_* series and the engine's prefix-cache hits:
turns after the first find at least 90% of their context in the prefix cache."""

from __future__ import annotations

import re
import time

import httpx
import openai

from das.service.engine.vllm.models import prepare_model
from tests.service.serve_process import TOKEN, Server, metric
from tests.tiny_models import build_tiny_model

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


def test_a_three_turn_session_prefills_only_its_new_tokens(tmp_path):
    model = build_tiny_model(tmp_path / "tiny", prepare_model("smollm2", progress=False), vocab_size=64, seed=0)
    server = Server(model, tmp_path / "state", "--max-model-len", "512")
    try:
        server.wait_ready()
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
    finally:
        server.stop()
