"""`das bench drafter-loss`: the replay's misses against the exact future and where their tokens were."""

from __future__ import annotations

import json

import numpy as np
from typer.testing import CliRunner

from das.service.cli import program
from das.bench.drafter_loss import _add_output_grams, _Corpus, drafter_loss
from das.drafter.records import RolloutRecord

app = program()

PROMPT = (1, 2, 3, 4, 5)


def record(problem: str, version: int, index: int, output) -> RolloutRecord:
    return RolloutRecord(problem, version, index, PROMPT, tuple(int(t) for t in output))


def test_novel_text_is_missed_at_every_step_and_held_nowhere():
    rng = np.random.default_rng(0)
    records = [record("p", v, 0, rng.permutation(np.arange(1000, 1060)) + 100 * v) for v in range(2)]
    report = drafter_loss(records, max_draft=8, match=2).to_dict()
    assert report["tokens"] == 60 and report["steps"] == 60  # one token a step: nothing ever held
    assert report["tokens_per_step"] == 1.0
    assert report["exact_tokens_per_step"] == 60 / 7  # ceil(60 / 9) steps
    assert report["misses"] == 59  # the last step's one token needs no draft
    assert report["predicted_by"] == {"nowhere": 1.0}


def test_a_repeated_sample_is_drafted_from_its_previous_version():
    text = np.arange(2000, 2080)
    records = [record("p", 0, 0, text), record("p", 1, 0, text)]
    report = drafter_loss(records, max_draft=8, match=2).to_dict()
    assert report["tokens_per_step"] > 5
    assert report["sources"]["sealed-age-1"]["accepted"] > 0.8 * 80


def test_the_corpus_names_history_by_age_and_other_problems():
    corpus = _Corpus(3)
    corpus.add_history([record("p", 0, 0, [7, 8, 9, 10]), record("p", 2, 0, [7, 8, 9]),
                        record("q", 1, 0, [20, 21, 22])])
    assert corpus.places((7, 8, 9), "p", 3) == ["sealed-age-1", "sealed-age-3"]
    assert corpus.places((8, 9, 10), "p", 3) == ["sealed-age-3"]
    assert corpus.places((20, 21, 22), "p", 3) == ["global"]   # another problem's rollout
    assert corpus.places((20, 21, 22), "q", 3) == ["sealed-age-2"]  # its own history is not global
    assert corpus.places((1, 1, 1), "p", 3) == []


def test_output_grams_are_added_as_tokens_commit():
    grams: set[tuple[int, ...]] = set()
    prompt, out = np.array([1, 2, 3]), np.array([4, 5, 6])
    _add_output_grams(grams, prompt, out, 0, 2, 3)
    assert grams == {(2, 3, 4), (3, 4, 5)}
    _add_output_grams(grams, prompt, out, 2, 3, 3)
    assert grams == {(2, 3, 4), (3, 4, 5), (4, 5, 6)}
    short: set[tuple[int, ...]] = set()
    _add_output_grams(short, np.array([9]), out, 0, 3, 3)
    assert short == {(9, 4, 5), (4, 5, 6)}


def test_bench_drafter_loss_prints_json(tmp_path):
    from das.drafter.records import write_rollouts

    rng = np.random.default_rng(1)
    base = rng.integers(100, 400, size=40)
    records = [record(f"p{p}", v, i, base if i else rng.integers(100, 400, size=40))
               for p in range(2) for v in range(2) for i in range(2)]
    path = tmp_path / "t.jsonl.gz"
    write_rollouts(path, records)
    result = CliRunner().invoke(app, ["bench", "drafter-loss", "--traces", str(path), "--max-draft", "4",
                                      "--json"])
    assert result.exit_code == 0, result.output
    (run,) = json.loads(result.stdout)["runs"]
    assert run["tokens"] == 4 * 40 and run["misses"] == sum(v["misses"] for v in run["by_why"].values())
    assert abs(sum(run["by_position"].values()) - run["misses"]) == 0
    missing = CliRunner().invoke(app, ["bench", "drafter-loss", "--traces", str(tmp_path / "none.jsonl")])
    assert missing.exit_code != 0 and "none.jsonl" in missing.output
