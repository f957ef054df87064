"""loadtests/history_import.py at a small size against a real `das serve --stub-engine` (embedded Ray; run under
`flock /tmp/das-heavy.lock` on a shared machine): 3 MB of history under a 1 MB body limit goes in several requests,
every record is read back exactly once, `/healthz` answers within a bound throughout, and a second `das serve` on
the same state directory refuses to start, naming it, while the first goes on."""

from __future__ import annotations

import json
from pathlib import Path

from loadtests.history_import import ImportConfig, history_records, run, summary

SMALL = ImportConfig(megabytes=3.0, tokens=512, per_problem=8, max_body_bytes=1_000_000, healthz_bound_ms=1000.0)


def test_the_records_are_the_size_asked_for_with_per_problem_sample_indices() -> None:
    records = history_records(2.0, 100, 4)
    size = sum(len(json.dumps(r, separators=(",", ":"))) for r in records)
    assert abs(size - 2e6) < 0.02 * 2e6  # the ids grow by a few digits over the records
    assert [(r["problem_id"], r["sample_index"]) for r in records[:6]] == [
        ("p0", 0), ("p0", 1), ("p0", 2), ("p0", 3), ("p1", 0), ("p1", 1)]


def test_a_split_import_is_stored_once_and_a_second_server_on_the_state_dir_is_refused(tmp_path: Path) -> None:
    result = run(SMALL, tmp_path)
    figures = json.loads(json.dumps(summary(result)))  # what the script prints is JSON
    assert result.requests >= 3 and result.over_limit_status == 413  # 3 MB under a 1 MB limit, which is enforced
    assert result.added == result.records == result.read_back_rollouts == int(result.imported_metric) > 0
    assert result.read_back_tokens == result.records * SMALL.tokens and result.problems_wrong == []
    assert result.healthz_failures == 0 and result.healthz_ms["polls"] >= 1
    assert result.healthz_ms["max"] <= SMALL.healthz_bound_ms
    assert result.second_exit_code == 2
    assert f"--state-dir {tmp_path} is in use by another das serve (pid " in result.second_message
    assert result.first_alive_after and result.first_exit_code == 0
    assert figures["passed"] is True and all(figures["verdicts"].values()), figures["verdicts"]
