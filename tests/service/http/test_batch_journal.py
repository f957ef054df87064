"""The batch journal: records survive a reopen, a torn last record is dropped and counted, a damaged file is set
aside without stopping the start, compaction bounds the file; and through the gateway and the client, a batch id
that an earlier run of the service accepted is answered 409 `batch_from_previous_run`, never run twice."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from das.service.client import BatchFromPreviousRunError, RolloutClient
from das.service.http.batch_journal import JOURNAL_FILE, BatchJournal
from das.service.config import BatchJournalConfig
from das.service.http.gateway import create_app
from das.service.wire.api import BatchFromPreviousRun
from tests.service.client.batch_keys import ALL_12, keys
from tests.service.live_gateway import LiveServer, gateway_settings, groups
from tests.service.stub_backend import stub_backend


def config(state_dir: Path, **extra: Any) -> BatchJournalConfig:
    return BatchJournalConfig(state_dir=state_dir, **extra)


def reopen(state_dir: Path, **extra: Any) -> BatchJournal:
    journal = BatchJournal(config(state_dir, **extra))
    journal.close()  # reading and the rewrite at start are what these tests look at
    return journal


def test_records_survive_a_reopen(tmp_path: Path) -> None:
    journal = BatchJournal(config(tmp_path))
    journal.accepted("a", "d" * 64, 12)
    journal.accepted("b", "e" * 64, 4)
    journal.ended("a", "done", 12)
    assert journal.previous("a") is None  # this run's own batches are the registry's business
    journal.close()

    again = reopen(tmp_path)
    a, b = again.previous("a"), again.previous("b")
    assert a is not None and (a.status, a.samples, a.samples_expected, a.digest) == ("done", 12, 12, "d" * 64)
    assert a.ended_unix_s is not None and a.ended_unix_s >= a.accepted_unix_s
    assert b is not None and (b.status, b.samples) == ("accepted", None)  # the process never recorded its end
    refusal = b.refusal("e" * 64)
    assert (refusal.status, refusal.samples_delivered, refusal.same_request) == ("interrupted", None, True)
    assert a.refusal("x").same_request is False and "12 of 12" in a.refusal("x").message
    assert again.counters().previous_run_batches == 2 and again.counters().torn_records == 0


def test_a_torn_last_record_is_dropped_and_counted(tmp_path: Path) -> None:
    journal = BatchJournal(config(tmp_path))
    journal.accepted("a", "d", 2)
    journal.ended("a", "done", 2)
    journal.accepted("b", "d", 2)
    journal.close()
    path = tmp_path / JOURNAL_FILE
    whole = path.read_bytes()
    path.write_bytes(whole[:-9])  # the process died while writing b's record

    again = reopen(tmp_path)
    assert again.counters().torn_records == 1 and again.counters().quarantined_files == 0
    assert again.previous("a") is not None and again.previous("b") is None
    # Rewritten whole at start: appends never follow the torn bytes, and the next start finds nothing torn.
    assert path.read_bytes().endswith(b"\n") and not list(tmp_path.glob("*.bad-*"))
    assert reopen(tmp_path).counters().torn_records == 0


@pytest.mark.parametrize("damage", ["flipped byte", "foreign file", "empty"])
def test_a_damaged_file_is_set_aside_and_the_start_goes_on(tmp_path: Path, damage: str) -> None:
    journal = BatchJournal(config(tmp_path))
    for batch_id in ("a", "b", "c"):
        journal.accepted(batch_id, "d", 1)
        journal.ended(batch_id, "done", 1)
    journal.close()
    path = tmp_path / JOURNAL_FILE
    if damage == "flipped byte":
        lines = path.read_bytes().split(b"\n")
        lines[2] = lines[2].replace(b'"a"', b'"z"')  # a's ended record: its checksum no longer matches
        path.write_bytes(b"\n".join(lines))
    elif damage == "foreign file":
        path.write_bytes(b"\x00\x01 not a journal\n" * 10)
    else:
        path.write_bytes(b"")

    again = reopen(tmp_path)
    quarantined = list(tmp_path.glob(f"{JOURNAL_FILE}.bad-*"))
    if damage == "empty":
        assert quarantined == [] and again.counters().quarantined_files == 0
        return
    assert again.counters().quarantined_files == 1 and len(quarantined) == 1
    if damage == "flipped byte":
        assert "bad-record" in quarantined[0].name
        a, c = again.previous("a"), again.previous("c")  # the records that check out are kept
        assert a is not None and a.status == "accepted" and c is not None and c.status == "done"
    else:
        assert "bad-format" in quarantined[0].name and again.previous("a") is None
    assert reopen(tmp_path).counters().quarantined_files == 0  # the rewritten file reads clean


def test_compaction_bounds_the_file_and_keeps_the_newest_and_the_running(tmp_path: Path) -> None:
    journal = BatchJournal(config(tmp_path, max_bytes=4096))
    path = tmp_path / JOURNAL_FILE
    journal.accepted("running-since-the-start", "d" * 64, 8)
    sizes = []
    for i in range(300):
        journal.accepted(f"batch-{i}", "d" * 64, 8)
        journal.ended(f"batch-{i}", "done", 8)
        sizes.append(path.stat().st_size)
    assert max(sizes) <= 4096 and journal.counters().compactions > 2
    journal.close()

    again = reopen(tmp_path, max_bytes=4096)
    assert again.previous("batch-299") is not None and again.previous("batch-0") is None
    running = again.previous("running-since-the-start")  # never ended: kept however old
    assert running is not None and running.refusal("d" * 64).status == "interrupted"


# ---- through the gateway and the client ----


class Service:
    """A gateway with a batch journal in `state_dir`, over a fresh stub engine: one run of the service."""

    def __init__(self, state_dir: Path | None, **stub: Any) -> None:
        self.backend = stub_backend(**stub)
        journal = config(state_dir) if state_dir is not None else None
        self.server = LiveServer(create_app(self.backend, gateway_settings(batch_journal=journal))).__enter__()
        self.http = httpx.Client(base_url=self.server.url, timeout=10)

    def stop(self) -> None:
        self.http.close()
        self.server.__exit__()


def test_a_retry_after_a_restart_gets_409_and_runs_nothing_twice(tmp_path: Path) -> None:
    first = Service(tmp_path, tokens=5, sample_s=0.2)
    try:
        body = {"batch_id": "b1", "groups": groups(3, 4, prompt_token_ids=[11, 12, 13])}
        done = first.http.post("/v1/rollouts", json=body)
        assert done.status_code == 200 and json.loads(done.text.splitlines()[-1])["summary"]["status"] == "done"
        with first.http.stream("POST", "/v1/rollouts", json={"batch_id": "b2", "groups": groups(1, 20)}) as cut:
            next(cut.iter_lines())  # b2 has begun; the service stops under it
    finally:
        first.stop()
    assert first.backend.runs == 2

    second = Service(tmp_path, tokens=5)
    try:
        refused = second.http.post("/v1/rollouts", json=body)
        assert refused.status_code == 409
        detail = BatchFromPreviousRun.model_validate(refused.json()["detail"])
        assert (detail.code, detail.batch_id, detail.status) == ("batch_from_previous_run", "b1", "done")
        assert (detail.samples_delivered, detail.samples_expected, detail.same_request) == (12, 12, True)
        assert detail.ended_unix_s is not None and "new batch_id" in detail.message

        cut_off = second.http.post("/v1/rollouts", json={"batch_id": "b2", "groups": groups(1, 20)}).json()
        assert cut_off["detail"]["status"] == "interrupted"  # aborted by the shutdown, not by anyone's DELETE
        assert 1 <= cut_off["detail"]["samples_delivered"] < 20

        other = second.http.post("/v1/rollouts", json={"batch_id": "b1", "groups": groups(1, 1)}).json()
        assert other["detail"]["same_request"] is False
        assert second.backend.runs == 0  # no sample of either batch ran a second time
        metrics = second.http.get("/metrics").text
        assert "das_batches_from_previous_run_refused_total 3.0" in metrics
        assert "das_samples_served_total{" not in metrics  # no sample served by this run

        fresh = second.http.post("/v1/rollouts", json={"batch_id": "b3", "groups": groups(1, 2)})
        assert fresh.status_code == 200 and second.backend.runs == 1
    finally:
        second.stop()
    # The journal holds ids, digests, counts and times: no prompt token ids, no text.
    text = (tmp_path / JOURNAL_FILE).read_text()
    assert "11,12,13" not in text and "prompt" not in text and '"b1"' in text


def test_a_batch_the_process_died_in_reads_as_interrupted_with_unknown_samples(tmp_path: Path) -> None:
    killed = BatchJournal(config(tmp_path))
    killed.accepted("b9", "whatever", 6)  # and no end: the process was killed
    killed.close()
    service = Service(tmp_path)
    try:
        detail = service.http.post("/v1/rollouts", json={"batch_id": "b9", "groups": groups(2, 3)}).json()["detail"]
    finally:
        service.stop()
    assert (detail["status"], detail["samples_delivered"], detail["samples_expected"]) == ("interrupted", None, 6)
    assert service.backend.runs == 0


def test_without_a_state_directory_a_retried_id_runs_again_after_a_restart() -> None:
    body = {"batch_id": "b1", "groups": groups(1, 2)}
    for _ in range(2):
        service = Service(None)
        try:
            assert service.http.post("/v1/rollouts", json=body).status_code == 200
        finally:
            service.stop()
        assert service.backend.runs == 1


class Redirect(httpx.HTTPTransport):
    """Sends every request to `port` on loopback, whatever the URL says: the service's address across restarts."""

    def __init__(self, port: int) -> None:
        super().__init__()
        self.port = port

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.url = request.url.copy_with(port=self.port)
        return super().handle_request(request)


def port(service: Service) -> int:
    return int(service.server.url.rsplit(":", 1)[1])


def test_the_client_raises_batch_from_previous_run_when_its_retry_meets_a_restarted_service(tmp_path: Path) -> None:
    first = Service(tmp_path, sample_s=0.3)
    transport = Redirect(port(first))
    received = []
    second: Service | None = None
    with RolloutClient("http://127.0.0.1:1", retries=3, backoff_s=0.05, transport=transport) as client:
        stream = client.generate(groups(3, 4), batch_id="trainer-step-7")
        with pytest.raises(BatchFromPreviousRunError) as raised:
            for record in stream:
                received.append(record)
                if second is None:  # the service restarts on the same state dir while the batch runs
                    first.stop()
                    second = Service(tmp_path)
                    transport.port = port(second)
    assert second is not None
    second.stop()
    error = raised.value
    assert error.status_code == 409 and error.batch_id == "trainer-step-7" and error.status == "interrupted"
    assert error.records_received == len(received) >= 1 and error.same_request is True
    assert error.samples_delivered is not None and error.samples_delivered >= len(received)
    assert error.samples_expected == 12 and set(keys(received)) < set(ALL_12)
    assert first.backend.runs == 1 and second.backend.runs == 0
