"""The verifiers example end to end (examples/verifiers_agent): verifiers' client drives a real `das serve` with the
tiny real model (SmolLM2, eager): two code-repair trajectories of up to two turns, each a session whose turns stay
on one engine, every turn's token ids collected for training.

verifiers 0.4.0 pins openai<3 while this project runs openai 3.x: setup.sh installs it from requirements/verifiers.txt
with `--no-deps`."""

from __future__ import annotations

import asyncio

import httpx

from examples.verifiers_agent.agent import AgentConfig, run_agent
from examples.verifiers_agent.run import _serve


def test_verifiers_drives_das_serve_through_sessions_and_collects_token_ids(tmp_path):
    proc, url = _serve("smollm2", tmp_path / "state", ready_timeout_s=120)
    try:
        rollouts = asyncio.run(run_agent(AgentConfig(base_url=url, tasks=2, turns=2, max_tokens=48)))
        assert [r.task for r in rollouts] == ["running_median", "merge_intervals"]
        for r in rollouts:
            assert r.reward in (0.0, 1.0) and len(r.turns) == (1 if r.reward else 2)
            for t in r.turns:
                assert t.prompt_token_ids and 0 < len(t.completion_token_ids) <= 48
            # the conversation grows: a later turn's prompt starts with the first turn's
            assert r.turns[-1].prompt_token_ids[:len(r.turns[0].prompt_token_ids)] == r.turns[0].prompt_token_ids
            session = httpx.get(f"{url}/v1/sessions/vf-{r.task}-0").json()
            assert len(session["turns"]) == len(r.turns)
            assert [t["prompt_tokens"] for t in session["turns"]] == [len(t.prompt_token_ids) for t in r.turns]
            assert len({t["engine"] for t in session["turns"]}) == 1
        metrics = httpx.get(f"{url}/metrics").text
        turns = sum(len(r.turns) for r in rollouts)
        assert f"das_session_turns_total {float(turns)}" in metrics
    finally:
        proc.send_signal(2)
        proc.wait(90)
