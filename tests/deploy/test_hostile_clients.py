"""loadtests/hostile_clients.py at a tiny size against a stub gateway in a child process: every figure is reported,
and the guards hold (401 before the body, memory flat, slow heads and stalled bodies cut off within their timeouts,
dropped requests' batches aborted within a second). The /healthz latency bound is the full run's to judge (a busy
test machine says nothing about it); here its figures must be there and no poll may fail."""

from __future__ import annotations

import json

from loadtests.hostile_clients import MIB, HostileConfig, run, summary

TINY = HostileConfig(big_connections=3, big_body_mib=8, big_sent_mib=7, slowloris=4, slowloris_interval_s=0.3,
                     stalled_bodies=2, drops=2, header_timeout_s=1.0, body_timeout_s=1.0, slack_s=1.5)


def test_hostile_clients_are_refused_cut_off_and_abandoned_work_ends() -> None:
    result = run(TINY)
    figures = json.loads(json.dumps(summary(result)))  # what --json prints is JSON
    assert [b.status for b in result.big_bodies] == [401] * TINY.big_connections
    assert all(b.sent_bytes_at_answer is not None and b.sent_bytes_at_answer < TINY.big_sent_mib * MIB
               for b in result.big_bodies)
    assert figures["memory_mb"]["before"] > 10 and figures["memory_mb"]["growth"] < 50
    assert figures["slow_heads"]["cut_off"] == TINY.slowloris
    assert TINY.header_timeout_s <= figures["slow_heads"]["cutoff_s_max"] <= TINY.header_timeout_s + TINY.slack_s
    assert figures["stalled_bodies"]["statuses"] == [408] * TINY.stalled_bodies
    assert figures["drops"]["abandoned_metric"] == TINY.drops and figures["drops"]["batches_back_s"] <= 1.0
    assert figures["healthz_ms"]["polls"] > 10 and figures["healthz_failures"] == 0
    assert set(figures["healthz_p99_ms_by_phase"]) == {"idle", "big_bodies", "slow_senders", "drops"}
    verdicts = figures["verdicts"]
    assert all(verdicts[name] for name in verdicts if name != "healthz_p99_under_100ms"), verdicts
