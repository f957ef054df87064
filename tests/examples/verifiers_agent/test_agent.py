"""The verifiers example end to end (examples/verifiers_agent): verifiers' client drives a real `das serve` with the
tiny real model (SmolLM2, eager): two code-repair trajectories of up to two turns, each a session whose turns stay
on one engine, every turn's token ids collected for training. The server is the session's shared SmolLM2 one
(tests/conftest.py), passed as the base URL as `run.py --url` does; this test is its first user, so its sessions and
weights are those of a fresh server.

verifiers 0.4.0 pins openai<3 while this project runs openai 3.x: setup.sh installs it from requirements/verifiers.txt
with `--no-deps`."""

from __future__ import annotations

import asyncio

import httpx

from examples.verifiers_agent.agent import AgentConfig, run_agent
from tests.service.serve_process import TOKEN


def test_verifiers_drives_das_serve_through_sessions_and_collects_token_ids(smollm2_gloo_server):
    url, auth = smollm2_gloo_server.url, {"Authorization": f"Bearer {TOKEN}"}
    rollouts = asyncio.run(run_agent(AgentConfig(base_url=url, tasks=2, turns=2, max_tokens=48, api_key=TOKEN)))
    assert [r.task for r in rollouts] == ["running_median", "merge_intervals"]
    for r in rollouts:
        assert r.reward in (0.0, 1.0) and len(r.turns) == (1 if r.reward else 2)
        for t in r.turns:
            assert t.prompt_token_ids and 0 < len(t.completion_token_ids) <= 48
        # the conversation grows: a later turn's prompt starts with the first turn's
        assert r.turns[-1].prompt_token_ids[:len(r.turns[0].prompt_token_ids)] == r.turns[0].prompt_token_ids
        session = httpx.get(f"{url}/v1/sessions/vf-{r.task}-0", headers=auth).json()
        assert len(session["turns"]) == len(r.turns)
        assert [t["prompt_tokens"] for t in session["turns"]] == [len(t.prompt_token_ids) for t in r.turns]
        assert len({t["engine"] for t in session["turns"]}) == 1
    metrics = httpx.get(f"{url}/metrics", headers=auth).text
    turns = sum(len(r.turns) for r in rollouts)
    assert f"das_session_turns_total {float(turns)}" in metrics
