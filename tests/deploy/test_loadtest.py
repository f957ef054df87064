"""loadtests/soak.py, briefly: 3 trainers for a few seconds against a stub gateway in a child process finish with
no error and every sample exactly once, as the gateway's own counters confirm; failures are counted, not hidden;
the memory verdict tells a flat series from a growing one. loadtests/history_scale.py at a tiny size reports every
figure."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from loadtests.soak import SoakConfig, StubGateway, memory_trend, require_loopback, run

SMALL = SoakConfig(trainers=3, duration_s=3.0, groups=3, group_size=4, tokens=32, memory_interval_s=0.5,
                   progress_interval_s=60.0, grace_s=15.0)


def counter(text: str, name: str, labels: str = "") -> float:
    """A counter's value in Prometheus text, summed over label sets that contain `labels`."""
    return sum(float(value) for found_labels, value in
               re.findall(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", text, re.MULTILINE) if labels in found_labels)


def test_three_trainers_get_every_sample_exactly_once() -> None:
    with StubGateway(SMALL.tokens, 0.0) as gateway:
        result = run(SoakConfig(**{**SMALL.__dict__, "server": gateway.url, "token": gateway.token}))
        metrics = httpx.get(f"{gateway.url}/metrics", headers={"Authorization": f"Bearer {gateway.token}"}).text
    assert (result.errors, result.error_examples) == (0, [])
    assert result.missing == 0 and result.duplicates == 0
    per_batch = SMALL.groups * SMALL.group_size
    assert result.batches >= SMALL.trainers and result.samples == result.samples_expected == result.batches * per_batch
    # The server's side of the count: each sample served once, each batch done once.
    assert counter(metrics, "das_samples_served_total") == result.samples
    assert counter(metrics, "das_batches_total", 'status="done"') == result.batches
    assert result.samples_per_s > 0 and set(result.batch_latency_ms) == {"p50", "p90", "p99", "max"}
    gateway_memory = result.memory["gateway"]
    assert gateway_memory.samples >= 3 and gateway_memory.start_bytes > 10 * 2**20


def test_failed_batches_are_counted() -> None:
    with StubGateway(SMALL.tokens, 0.0) as gateway:
        result = run(SoakConfig(**{**SMALL.__dict__, "server": gateway.url, "token": "wrong", "max_batches": 2,
                                   "duration_s": 1.0}))
    assert result.errors == result.batches == 2 * SMALL.trainers
    assert "401" in result.error_examples[0] and result.missing == result.samples_expected
    assert not result.passed


def test_memory_verdict() -> None:
    mib = 2**20
    flat = [(t, 100 * mib + (mib if t % 2 else 0)) for t in range(0, 60)]  # noise, no trend
    growing = [(t, 100 * mib + t * mib) for t in range(0, 60)]  # 1 MiB/s: ~29 MiB over the second half
    warm_up_then_flat = [(t, 50 * mib + min(t, 20) * 2 * mib) for t in range(0, 60)]
    assert memory_trend(flat, "test", 16 * mib).flat is True
    trend = memory_trend(growing, "test", 16 * mib)
    assert trend.flat is False and trend.second_half_growth_bytes == pytest.approx(29 * mib)
    assert memory_trend(warm_up_then_flat, "test", 16 * mib).flat is True
    assert memory_trend([(0.0, mib), (1.0, mib)], "test", 16 * mib).flat is None  # too short to judge


@pytest.mark.parametrize("url", ["http://10.0.0.5:8000", "http://example.test:8000", "http://192.168.1.2"])
def test_only_loopback_targets(url: str) -> None:
    with pytest.raises(SystemExit, match="only loopback"):
        require_loopback(url)
    require_loopback("http://127.0.0.1:8000")
    require_loopback("http://[::1]:8000")
    require_loopback("http://localhost:8000")


def test_history_scale_smoke(tmp_path: Path) -> None:
    """loadtests/history_scale.py end to end at a tiny size, in-process (no Ray start): every figure it reports and
    the shard count it derives are there and positive."""
    out = tmp_path / "scale.json"
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "loadtests/history_scale.py", "--mode", "in-process", "--problems", "12",
                           "--samples", "4", "--steps", "2", "--median-tokens", "200", "--max-tokens", "1000",
                           "--engines", "6", "--out", str(out)], cwd=root, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "shards needed" in done.stdout
    result = json.loads(out.read_text())
    figures, cluster = result["figures"], result["cluster"]
    for name in ("push_tokens_per_s", "pull_tokens_per_s", "memory_bytes_per_token", "snapshot_s", "snapshot_bytes",
                 "stored_tokens", "mean_tokens"):
        assert figures[name] > 0, name
    assert 0 < figures["pull_ms"]["p50"] <= figures["pull_ms"]["p99"]
    assert figures["stored_rollouts"] == 12 * 4 * 2 and figures["push_calls"] == 12 * 2
    assert set(cluster["shards_by"]) == {"push", "dispatch", "memory", "snapshot"}
    assert cluster["shards"] == max(cluster["shards_by"].values()) >= 1
