"""`das history stats`: JSON figures on a good file, exit code 2 and a located message on a bad one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from das.service.cli import app

runner = CliRunner()


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _row(version: int, n_out: int, pid: str = "p", **extra: object) -> dict:
    return {"problem_id": pid, "policy_version": version, "sample_index": 0, "prompt_token_ids": [1, 2],
            "output_token_ids": list(range(n_out)), **extra}


def test_stats_json(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    # Version 4: lengths 1 2 3 (median 2, max 3); version 5: lengths 2 2 10 (median 2, max 10).
    _write(path, [_row(4, 1, "a", finish_reason="stop", reward=1.0), _row(4, 2, "b"), _row(4, 3, "a"),
                  _row(5, 2, "c"), _row(5, 2, "c"), _row(5, 10, "c", finish_reason="length", reward=0.0)])
    result = runner.invoke(app, ["history", "stats", str(path), "--json"])
    assert result.exit_code == 0, result.output
    d = json.loads(result.stdout)
    assert (d["rollouts"], d["problems"], d["policy_versions"]) == (6, 3, 2)
    assert (d["prompt_tokens"], d["output_tokens"]) == (12, 20)
    assert d["finish_reasons"] == {"stop": 1, "length": 1} and d["mean_reward"] == 0.5
    assert [v["policy_version"] for v in d["versions"]] == [4, 5]
    assert [v["problems"] for v in d["versions"]] == [2, 1]
    assert [v["output_lengths"]["straggler_ratio"] for v in d["versions"]] == [1.5, 5.0]
    assert d["versions"][1]["output_lengths"]["p50"] == 2.0 and d["versions"][1]["output_lengths"]["max"] == 10
    assert d["mean_straggler_ratio"] == 3.25


def test_stats_table(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl.gz"
    from das.drafter.records import RolloutRecord, write_rollouts

    write_rollouts(path, [RolloutRecord("p", 0, i, (1,), tuple(range(n))) for i, n in enumerate([1, 2, 9])])
    result = runner.invoke(app, ["history", "stats", str(path)])
    assert result.exit_code == 0, result.output
    assert "max/p50" in result.stdout and "4.50" in result.stdout


@pytest.mark.parametrize(("line3", "expected"), [
    ('{"problem_id": "p"', "bad.jsonl:3: invalid JSON"),
    (json.dumps(_row(0, 1) | {"output_token_ids": [1, -5]}),
     "bad.jsonl:3: field 'output_token_ids'[1]: token id -5 outside [0, 2147483647]"),
    # Text that looks like rich markup must be printed as is, not interpreted (or crash on a stray close tag).
    (json.dumps(_row(0, 1) | {"[/bold]": 1}), "bad.jsonl:3: field '[/bold]': not a field of the format"),
])
def test_stats_malformed_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line3: str, expected: str) -> None:
    monkeypatch.chdir(tmp_path)  # a short relative name, so the message is not wrapped at the console width
    Path("bad.jsonl").write_text(json.dumps(_row(0, 1)) + "\n\n" + line3 + "\n")
    result = runner.invoke(app, ["history", "stats", "bad.jsonl", "--json"])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert "error:" in result.stderr and expected in " ".join(result.stderr.split())


def test_stats_missing_file(tmp_path: Path) -> None:
    result = runner.invoke(app, ["history", "stats", str(tmp_path / "nope.jsonl")])
    assert result.exit_code == 2 and "No such file" in result.stderr
