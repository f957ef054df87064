"""`das bench history` at a small size: what it imports is stored, snapshotted and restored whole, and lookups ran
both while the import ran and on the idle store."""

import pytest

from das.bench.history_scale import HistoryScaleConfig, run_history_bench


def test_small_import_snapshot_and_restore() -> None:
    config = HistoryScaleConfig(problems=3000, tokens=300_000, rollouts_per_problem=2, shards=2, chunk_records=500,
                                lookup_interval_s=0.001)
    result = run_history_bench(config, progress=lambda _: None)
    assert result.problems_stored == 3000 and result.tokens_stored == 300_000
    assert (result.problems_restored, result.tokens_restored) == (3000, 300_000)
    assert result.snapshot_bytes > 4 * 300_000  # int32 tokens at least
    assert result.snapshot_s > 0 and result.restore_s > 0 and result.import_tokens_per_s > 0
    assert result.resident_bytes_after > result.resident_bytes_before
    assert result.lookups["summary while importing"].count > 0
    assert result.lookups["summary, idle"].count > 0
    assert result.lookups["pull, idle"].p50_ms <= result.lookups["pull, idle"].max_ms


def test_refuses_rollouts_without_tokens() -> None:
    with pytest.raises(ValueError):
        HistoryScaleConfig(problems=10, tokens=5, rollouts_per_problem=1).check()
    assert HistoryScaleConfig(problems=10, tokens=100, rollouts_per_problem=2).output_tokens == 5
