"""The agent benchmark's logic (bench/agent.py) with a fake model, renderer, tool and server counters: the
trajectory loop's token bookkeeping, stop on success, per-turn seeds, per-epoch figures from /metrics deltas."""

from __future__ import annotations

import asyncio

import pytest

from das.bench.agent import (AgentBenchConfig, ServerCounters, Trajectory, TurnOutput, epoch_figures,
                             parse_counters, run_epochs, run_trajectory, same_trajectories, settled_counters)
from das.service.client.code_checks import CodeCheck
from das.service.client.code_tasks import CODE_TASKS


class FakeModel:
    """Replies `fixed` from turn `solve_at` on (0-based, per session); records every call."""

    def __init__(self, solve_at: int) -> None:
        self.solve_at = solve_at
        self.calls: list[tuple[list[int], str, str, int, int]] = []
        self.turns: dict[str, int] = {}

    async def turn(self, context, session_id, problem_id, seed, max_tokens):
        self.calls.append((list(context), session_id, problem_id, seed, max_tokens))
        k = self.turns.get(session_id, 0)
        self.turns[session_id] = k + 1
        text = "fixed" if k >= self.solve_at else "broken"
        return TurnOutput(list(context), [100 + k, 200 + k], text)


class FakeRenderer:
    def first(self, system, user):
        return [1, 2, 3]

    def tool_turn(self, reply_token_ids, feedback):
        assert feedback == "assert failed"
        return [7, 8]


async def fake_check(name: str, reply: str) -> CodeCheck:
    return CodeCheck(reply == "fixed", "" if reply == "fixed" else "assert failed")


def test_a_trajectory_extends_its_context_by_exactly_the_returned_and_tool_tokens_and_stops_when_solved():
    model = FakeModel(solve_at=2)
    config = AgentBenchConfig(arms=("none",), tasks=1, turns=4, max_tokens=32)
    trajectory = asyncio.run(run_trajectory(model, FakeRenderer(), fake_check, 0, 0, config))
    assert trajectory.turns == 3 and trajectory.reward == 1.0 and trajectory.output_tokens == 6
    contexts = [call[0] for call in model.calls]
    assert contexts == [[1, 2, 3], [1, 2, 3, 100, 200, 7, 8], [1, 2, 3, 100, 200, 7, 8, 101, 201, 7, 8]]
    assert trajectory.tokens == contexts[-1] + [102, 202]
    name = CODE_TASKS[0][0]
    assert {call[1] for call in model.calls} == {f"agent-e0-{name}"}
    assert {call[2] for call in model.calls} == {f"code/{name}"} and {call[4] for call in model.calls} == {32}
    assert len({call[3] for call in model.calls}) == 3  # a seed of its own per turn


def test_an_unsolved_trajectory_ends_after_its_turns_without_a_dangling_tool_turn():
    model = FakeModel(solve_at=99)
    config = AgentBenchConfig(arms=("none",), tasks=1, turns=2)
    trajectory = asyncio.run(run_trajectory(model, FakeRenderer(), fake_check, 0, 0, config))
    assert trajectory.turns == 2 and trajectory.reward == 0.0
    assert trajectory.tokens == [1, 2, 3, 100, 200, 7, 8, 101, 201]


def test_seeds_repeat_across_runs_and_differ_across_epochs_and_tasks():
    config = AgentBenchConfig(arms=("none",), tasks=2, epochs=2, turns=2)

    def seeds() -> list[int]:
        model = FakeModel(solve_at=99)
        async def read() -> ServerCounters:
            return ServerCounters(steps=len(model.calls))

        asyncio.run(run_epochs(model, FakeRenderer(), fake_check, read, config, lambda m: None, quiet_s=0.0))
        return sorted(call[3] for call in model.calls)

    first = seeds()
    assert first == seeds() and len(set(first)) == 2 * 2 * 2


def test_epoch_figures_are_the_deltas_of_the_counters():
    trajectories = [Trajectory("a", turns=2, output_tokens=30, reward=1.0), Trajectory("b", turns=4, output_tokens=50)]
    before = ServerCounters(100.0, 40.0, {"context": 10.0}, {"context": 5.0}, steps=10, busy_s=1.0, verified=4,
                            verified_accepted=2)
    after = ServerCounters(300.0, 220.0, {"context": 30.0, "history": 8.0}, {"context": 15.0, "history": 2.0},
                           steps=50, busy_s=3.0, verified=34, verified_accepted=14)
    e = epoch_figures(2, trajectories, 4.0, before, after)
    assert (e.epoch, e.turns, e.solved, e.trajectories, e.output_tokens) == (2, 6, 1, 2, 80)
    assert e.tokens_per_s == 20.0 and e.prefix_hit_rate == pytest.approx(0.9)
    assert e.proposed == {"context": 20.0, "history": 8.0} and e.accepted == {"context": 10.0, "history": 2.0}
    assert (e.steps, e.verified, e.verified_accepted) == (40, 30, 12)
    assert e.step_ms == pytest.approx(50.0) and e.tokens_per_step == 2.0


def test_parse_counters_sums_engines_and_splits_sources():
    text = """# HELP das_engine_prompt_tokens_total x
das_engine_prompt_tokens_total{engine="0"} 100.0
das_engine_prompt_tokens_total{engine="1"} 50.0
das_engine_prompt_tokens_cached_total{engine="0"} 90.0
das_source_draft_tokens_proposed_total{source="context"} 12.0
das_source_draft_tokens_accepted_total{source="context"} 6.0
das_source_draft_tokens_proposed_total{source="history"} 4.0
das_session_turns_total 3.0
das_engine_steps_total{engine="0"} 40.0
das_engine_steps_total{engine="1"} 2.0
das_engine_busy_seconds_total{engine="0"} 1.5
das_engine_draft_tokens_total{engine="0"} 30.0
das_engine_draft_tokens_accepted_total{engine="0"} 20.0
das_engine_step_base_seconds{engine="0"} 0.05
das_engine_step_token_seconds{engine="0"} 0.001
das_engine_step_base_seconds{engine="1"} 0.07
"""
    c = parse_counters(text)
    assert (c.prompt_tokens, c.cached_tokens) == (150.0, 90.0)
    assert (c.steps, c.busy_s, c.verified, c.verified_accepted) == (42.0, 1.5, 30.0, 20.0)
    assert c.step_cost == {"c_base_s": 0.05, "c_tok_s": 0.001}  # the first engine's
    assert c.proposed == {"context": 12.0, "history": 4.0} and c.accepted == {"context": 6.0}


def test_settled_counters_wait_for_the_epochs_steps_and_then_for_quiet():
    """The counters lag the engines by a refresh: an epoch's figures are read once they moved and then held."""
    before = ServerCounters(steps=10)
    reads = iter([ServerCounters(steps=10), ServerCounters(steps=12), ServerCounters(steps=15)])
    last = ServerCounters(steps=15)

    async def counters() -> ServerCounters:
        return next(reads, last)

    got = asyncio.run(settled_counters(counters, before, quiet_s=0.6, limit_s=10.0))
    assert got.steps == 15
    stuck = asyncio.run(settled_counters(lambda: asyncio.sleep(0, ServerCounters(steps=10)), before, quiet_s=0.1,
                                         limit_s=1.0))
    assert stuck.steps == 10  # nothing moved: gives up at the limit with what it has


def test_same_trajectories_compares_every_arm_token_for_token():
    a = [[Trajectory("t", tokens=[1, 2])]]
    assert same_trajectories({"none": a, "das": [[Trajectory("t", tokens=[1, 2])]]})
    assert not same_trajectories({"none": a, "das": [[Trajectory("t", tokens=[1, 3])]]})


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="tasks"):
        AgentBenchConfig(tasks=len(CODE_TASKS) + 1)
    with pytest.raises(ValueError):
        AgentBenchConfig(arms=())
