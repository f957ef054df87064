"""The trainer clients' sessions (service/client/session_client.py) against the gateway on a stub engine over real HTTP:
one trajectory at a time, a turn of many in one batch, and (asyncio) many agent loops at once."""

from __future__ import annotations

import asyncio

import pytest

from das.service.wire.api import SamplingSpec
from das.service.client import AsyncRolloutClient, RolloutClient, RolloutError
from das.service.client.session_client import AsyncClientSession, run_turns, run_turns_async
from tests.service.live_gateway import TOKEN
from tests.service.stub_backend import RecordingBackend, sample_tokens, stub_backend


def turns_drawn(backend: RecordingBackend, problem_id: str, length: int) -> list[list[int]]:
    """The tokens the stub engine drew for each turn of the session on `problem_id`, in turn order."""
    return [sample_tokens(g, 0, length) for batch in backend.received for g in batch if g.problem_id == problem_id]


def test_the_rollout_client_runs_sessions_one_at_a_time_and_many_at_once(session_serve):
    backend = stub_backend(tokens=4)
    server, _, _ = session_serve(backend)
    sampling = SamplingSpec(max_tokens=4)
    with RolloutClient(server.url, token=TOKEN) as client:
        session = client.session("task", sampling=sampling)
        first = session.turn([1, 2])
        (drawn,) = turns_drawn(backend, "task", 4)
        assert first.output_token_ids == drawn and session.context == [1, 2, *drawn]
        session.turn([50])  # a tool's output: the context grows by it, then by the output
        assert session.context == [1, 2, *drawn, 50, *turns_drawn(backend, "task", 4)[1]]
        assert backend.received[-1][0].prompt_token_ids == (1, 2, *drawn, 50)
        summary = session.summary()
        assert len(summary.turns) == 2 and summary.problem_id == "task"

        many = [client.session(f"task{i}", sampling=sampling) for i in range(3)]
        records = run_turns(client, [(s, [9, i]) for i, s in enumerate(many)])
        assert len(backend.received[-1]) == 3  # one batch, a turn per session
        assert [s.context for s in many] == [[9, i, *turns_drawn(backend, f"task{i}", 4)[0]] for i in range(3)]
        assert [r.group_index for r in records] == [0, 1, 2]
        run_turns(client, [(s, [7]) for s in many])
        assert all(len(s.summary().turns) == 2 for s in many)
        assert session.end().state == "closed"
        with pytest.raises(RolloutError) as gone:
            session.summary()
        assert gone.value.status_code == 404


def test_the_async_client_runs_agent_loops_concurrently_and_batched_turns(session_serve):
    backend = stub_backend(tokens=3, first_sample_s=0.05)
    server, _, _ = session_serve(backend)
    sampling = SamplingSpec(max_tokens=3)

    async def main() -> None:
        async with AsyncRolloutClient(server.url, token=TOKEN) as client:
            async def agent(i: int) -> AsyncClientSession:
                session = client.session(f"task{i}", sampling=sampling)
                await session.turn([1, i])
                for step in range(2):
                    await session.turn([40 + step])  # a tool's output
                return session

            agents = await asyncio.gather(*(agent(i) for i in range(4)))
            for i, session in enumerate(agents):
                drawn = turns_drawn(backend, f"task{i}", 3)
                assert session.context == [1, i, *drawn[0], 40, *drawn[1], 41, *drawn[2]]
                assert len((await session.summary()).turns) == 3
            batched = [client.session("many", sampling=sampling) for _ in range(3)]
            await run_turns_async(client, [(s, [8]) for s in batched])
            assert len(backend.received[-1]) == 3
            assert [s.context for s in batched] == [[8, *sample_tokens(g, 0, 3)] for g in backend.received[-1]]
            assert (await batched[0].end()).state == "closed"

    asyncio.run(main())
    assert backend.runs == 4 * 3 + 1  # a batch per agent turn, one for the batched turns
