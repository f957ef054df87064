"""The drafter replay: bookkeeping, and that history across versions and siblings pays."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from das.service.cli import program
from das.bench.drafter_replay import (
    DasDrafter,
    FrontierPoint,
    frontier_grid,
    replay_arm,
    run_drafter_bench,
    tokens_per_step_at,
    upper_envelope,
)
from das.drafter.history import DrafterConfig
from das.drafter.records import RolloutRecord, write_rollouts

app = program()


def synthetic_traces(versions: int = 3, problems: int = 4, samples: int = 4, seed: int = 0) -> list[RolloutRecord]:
    """Each problem has a solution template; every sample is the template with ~10% of tokens changed."""
    rng = np.random.default_rng(seed)
    out = []
    for p in range(problems):
        template = rng.integers(0, 5000, size=int(rng.integers(80, 200)))
        for v in range(versions):
            for s in range(samples):
                x = template.copy()
                flip = rng.random(len(x)) < 0.1
                x[flip] = rng.integers(0, 5000, size=int(flip.sum()))
                out.append(RolloutRecord(problem_id=f"p{p}", policy_version=v, sample_index=s,
                                         prompt_token_ids=(1, 2, 3, p + 10), output_token_ids=tuple(int(t) for t in x)))
    return out


def test_replay_bookkeeping_and_gain():
    traces = synthetic_traces()
    stats = replay_arm(DasDrafter(DrafterConfig(max_depth=32)), traces, max_draft=8)
    measured = [r for r in traces if r.policy_version > 0]
    assert stats.tokens == sum(len(r.output_token_ids) for r in measured)
    assert stats.steps < stats.tokens  # every step advances at least one token
    assert stats.tokens_per_step == pytest.approx(stats.tokens / stats.steps)
    assert stats.tokens_per_step > 2.0  # repeated problems: history must pay
    assert 0.0 < stats.acceptance_rate <= 1.0 and 0.0 < stats.draft_share <= 1.0
    assert stats.bytes_per_token > 0


def test_history_beats_no_history():
    """Version 0 alone (nothing measured before it) vs later versions: ingesting history must raise acceptance."""
    traces = synthetic_traces(versions=2)
    cold = [RolloutRecord(**{**r.to_dict(), "policy_version": r.policy_version + 1,
                             "problem_id": f"cold-{r.problem_id}" if r.policy_version == 1 else r.problem_id})
            for r in traces]
    warm_stats = replay_arm(DasDrafter(), traces, max_draft=8)
    cold_stats = replay_arm(DasDrafter(), cold, max_draft=8)
    assert warm_stats.tokens_per_step > cold_stats.tokens_per_step


def test_bench_cli_json(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    write_rollouts(path, synthetic_traces(problems=2, samples=2))
    result = CliRunner().invoke(app, ["bench", "drafter", "--traces", str(path), "--arms", "das,ngram",
                                      "--max-draft", "4", "--repeats", "2", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert set(doc["arms"]) == {"das", "ngram"}
    for arm in doc["arms"].values():
        assert {"tokens_per_step", "draft_share", "mean_draft_len", "acceptance_rate", "speculate_us_p50",
                "speculate_us_p99", "append_us_per_token", "bytes_per_token"} <= set(arm)


def test_bench_rejects_bad_arguments(tmp_path):
    path = tmp_path / "one.jsonl"
    write_rollouts(path, [r for r in synthetic_traces(problems=1, samples=1) if r.policy_version == 0])
    with pytest.raises(ValueError, match="at least two policy versions"):
        run_drafter_bench(path, arms=["das"], progress=False)
    with pytest.raises(ValueError, match="unknown arm"):
        run_drafter_bench(path, arms=["nope"], progress=False)
    result = CliRunner().invoke(app, ["bench", "drafter", "--traces", str(tmp_path / "missing.jsonl")])
    assert result.exit_code == 2


def test_the_frontier_compares_das_with_a_peer_at_the_peers_draft_tokens_per_step(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    write_rollouts(path, synthetic_traces(problems=2, samples=2))
    result = run_drafter_bench(path, max_draft=4, arms=["das", "arctic-d24"], progress=False, frontier=True)
    assert [(p.max_draft, p.min_prob) for p in result.frontier] == frontier_grid(4)
    assert frontier_grid(4) == [(1, 0.0), (2, 0.0), (3, 0.0), (4, 0.0), (4, 0.05), (4, 0.1), (4, 0.15), (4, 0.2),
                                (4, 0.25), (4, 0.3), (4, 0.4), (4, 0.5)]
    envelope = upper_envelope(result.frontier)
    xs = [p.draft_tokens_per_step for p in envelope]
    ys = [p.tokens_per_step for p in envelope]
    assert xs == sorted(xs) and all(b > a for a, b in zip(ys, ys[1:]))  # more drafts only where they buy more
    assert all(any(q.draft_tokens_per_step <= p.draft_tokens_per_step and q.tokens_per_step >= p.tokens_per_step
                   for q in envelope) for p in result.frontier)  # every point is dominated by the envelope
    peer = result.arms["arctic-d24"]
    at_peer = tokens_per_step_at(envelope, peer.draft_tokens_per_step)
    assert result.ratios()["arctic-d24"]["tokens_per_step_at_equal_drafts"] == pytest.approx(
        at_peer / peer.tokens_per_step)
    doc = result.to_dict()
    assert [p["draft_tokens_per_step"] for p in doc["arms"]["das"]["frontier"]] == xs
    assert doc["arms"]["arctic-d24"]["draft_tokens_per_step"] == pytest.approx(peer.draft_tokens_per_step)


def test_reading_the_envelope_between_beyond_and_below_its_points():
    envelope = [FrontierPoint(2, 0.0, 1.0, 1.5), FrontierPoint(4, 0.0, 3.0, 2.0)]
    assert tokens_per_step_at(envelope, 0.0) == 1.0  # no drafts: one token a step
    assert tokens_per_step_at(envelope, 0.5) == pytest.approx(1.25)
    assert tokens_per_step_at(envelope, 2.0) == pytest.approx(1.75)
    assert tokens_per_step_at(envelope, 10.0) == 2.0
    dominated = FrontierPoint(8, 0.0, 5.0, 1.9)
    assert upper_envelope([*envelope, dominated]) == envelope
