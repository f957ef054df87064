"""`das rollout` against a live gateway (stub backend): epochs, figures, and the history file it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from das.drafter.records import load_rollouts
from das.service.cli import app
from das.service.client.prompt_sets import Problem
from das.service.client.rollout_run import run_rollouts
from das.service.http.gateway import create_app
from das.service.wire.api import SampleRecord, SamplingSpec, seeded_groups
from das.service.wire.sample_keys import derive
from tests.service.live_gateway import TOKEN, LiveServer, gateway_settings
from tests.service.stub_backend import stub_backend


def test_das_rollout_runs_epochs_and_writes_a_history_file(tmp_path: Path) -> None:
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps({"problem_id": f"q{i}", "prompt_token_ids": [3, 4, i]}) + "\n"
                                for i in range(3)))
    out = tmp_path / "history.jsonl.gz"
    backend = stub_backend(tokens=12)
    with LiveServer(create_app(backend, gateway_settings(token=TOKEN))) as server:
        result = CliRunner().invoke(app, ["rollout", "--server", server.url, "--problems", str(problems),
                                          "--samples", "4", "--epochs", "2", "--max-tokens", "10", "--out", str(out),
                                          "--json"], env={"DAS_TOKEN": TOKEN})
        refused = CliRunner().invoke(app, ["rollout", "--server", server.url, "--problems", str(problems),
                                           "--token", "wrong"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [e["epoch"] for e in report["epochs"]] == [1, 2] and backend.runs == 2
    assert all(e["samples"] == 12 and e["output_tokens"] == 120 and e["makespan_s"] > 0 for e in report["epochs"])
    records = load_rollouts(out)
    assert report["records"] == len(records) == 24
    assert {(r.problem_id, r.prompt_token_ids) for r in records} == {(f"q{i}", (3, 4, i)) for i in range(3)}
    assert all(len(r.output_token_ids) == 10 and r.finish_reason == "length" for r in records)
    assert refused.exit_code == 2 and "401" in refused.output


class _Client:
    """Answers every batch with samples of (tokens, accepted draft tokens) as given."""

    def __init__(self, samples: list[tuple[int, int]]) -> None:
        self.samples = samples

    def generate(self, groups, return_prompt_token_ids=False, seed=None):
        return [SampleRecord(group_index=0, problem_id="q", sample_index=i, output_token_ids=[5] * tokens, text=None,
                             finish_reason="length", policy_version=0, draft_tokens=2 * accepted,
                             accepted_tokens=accepted, latency_s=0.0)
                for i, (tokens, accepted) in enumerate(self.samples)]


def test_critical_path_is_the_most_steps_any_sample_took_not_the_longest_sample() -> None:
    # 20 tokens with 12 accepted took 8 steps; the 15-token sample with 2 accepted took 13: the critical path
    client = _Client([(10, 0), (20, 12), (15, 2)])
    run = run_rollouts(client, [Problem("q", prompt_token_ids=(1, 2))], 3, 1, SamplingSpec(max_tokens=20), None)
    (epoch,) = run.epochs
    assert (epoch.longest_tokens, epoch.critical_steps, epoch.accepted_tokens) == (20, 13, 14)
    assert epoch.seconds_per_critical_step == epoch.makespan_s / 13


def test_outputs_are_kept_by_the_key_each_sample_drew_with() -> None:
    client = _Client([(3, 0), (4, 0)])
    problems = [Problem("q", prompt_token_ids=(1, 2))]
    outputs: list[dict[int, list[int]]] = []
    run_rollouts(client, problems, 2, 2, SamplingSpec(max_tokens=8), None, seed=7, outputs=outputs)
    for epoch, kept in enumerate(outputs):
        (group,) = seeded_groups([problems[0].group(2, SamplingSpec(max_tokens=8))], derive(7, epoch))
        assert kept == {group.sample_key(0): [5] * 3, group.sample_key(1): [5] * 4}
    assert len(outputs) == 2 and outputs[0].keys() != outputs[1].keys()
    with pytest.raises(ValueError, match="needs a seed"):
        run_rollouts(client, problems, 2, 1, SamplingSpec(max_tokens=8), None, outputs=[])


def test_coupled_epochs_give_each_sample_the_same_key_every_epoch() -> None:
    client = _Client([(3, 0), (4, 0)])
    problems = [Problem("q", prompt_token_ids=(1, 2))]
    outputs: list[dict[int, list[int]]] = []
    run_rollouts(client, problems, 2, 3, SamplingSpec(max_tokens=8), None, seed=7, outputs=outputs, coupled=True)
    (group,) = seeded_groups([problems[0].group(2, SamplingSpec(max_tokens=8))], 7)
    assert outputs == [{group.sample_key(0): [5] * 3, group.sample_key(1): [5] * 4}] * 3
    with pytest.raises(ValueError, match="needs a seed"):
        run_rollouts(client, problems, 2, 1, SamplingSpec(max_tokens=8), None, coupled=True)
