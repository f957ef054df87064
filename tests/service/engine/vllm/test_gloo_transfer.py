"""The gloo transfer's data plane (service/engine/vllm/gloo_transfer.py), torch only: a trainer rank and two worker
ranks in threads of this process, each with its own group over loopback; and the trainer's `push` over a group that
breaks under its broadcast."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from das.service.engine.vllm import gloo_transfer
from das.service.engine.vllm.gloo_transfer import (
    GlooGroup,
    GlooInitInfo,
    GlooUpdateInfo,
    TransferRefused,
    checkpoint_manifest,
    packed_chunks,
    push,
    receive,
    refusal,
    send,
)

PAIRS = [("a.weight", torch.arange(12, dtype=torch.float32).reshape(3, 4)),
         ("b.bias", torch.tensor([1.5, -2.0], dtype=torch.bfloat16))]
MANIFEST = {"a.weight": (3, 4), "b.bias": (2,)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def exchange(pairs, worker_refusals: list[str | None], chunk_bytes: int = 0):
    """Rank 0 sends `pairs`; worker w receives with its refusal; returns (trainer outcome, worker outcomes).
    `chunk_bytes`: the group's packing, on every rank."""
    port, world = free_port(), 1 + len(worker_refusals)
    info = GlooUpdateInfo.of(pairs)
    outcomes: dict[int, object] = {}

    def worker(rank: int, why_not: str | None) -> None:
        group = GlooGroup("127.0.0.1", port, rank, world, timeout_s=20, chunk_bytes=chunk_bytes)
        try:
            outcomes[rank] = receive(group, info, why_not)
        except TransferRefused as exc:
            outcomes[rank] = exc

    threads = [threading.Thread(target=worker, args=(r + 1, w)) for r, w in enumerate(worker_refusals)]
    for t in threads:
        t.start()
    group = GlooGroup("127.0.0.1", port, 0, world, timeout_s=20, chunk_bytes=chunk_bytes)
    try:
        trainer: object = send(group, pairs, info)
    except TransferRefused as exc:
        trainer = exc
    for t in threads:
        t.join(30)
    return trainer, [outcomes[r + 1] for r in range(len(worker_refusals))]


def test_every_worker_receives_every_tensor_in_its_dtype():
    sent, (first, second) = exchange(PAIRS, [None, None])
    assert sent == 12 * 4 + 2 * 2
    for received in (first, second):
        assert [n for n, _ in received] == ["a.weight", "b.bias"]
        assert all(torch.equal(r, p) and r.dtype == p.dtype for (_, r), (_, p) in zip(received, PAIRS))


def test_packed_chunks_carry_every_tensor_bit_for_bit_at_any_alignment():
    # odd-sized bfloat16 and int-like tensors between float32 ones: each slice must start where its dtype can view it
    pairs = [("a", torch.randn(3, 5)), ("b", torch.randn(7).to(torch.bfloat16)), ("c", torch.randn(2, 3)),
             ("d", torch.randn(1).to(torch.float16)), ("e", torch.randn(4, 4, dtype=torch.float64)),
             ("f", torch.randn(0)), ("g", torch.randn(9).to(torch.bfloat16))]
    for chunk_bytes in (64, 100, 1 << 20):
        sent, (first, second) = exchange(pairs, [None, None], chunk_bytes)
        assert sent == sum(t.numel() * t.element_size() for _, t in pairs)
        for received in (first, second):
            assert [n for n, _ in received] == [n for n, _ in pairs]
            for (_, r), (_, p) in zip(received, pairs):
                assert r.dtype == p.dtype and r.shape == p.shape and torch.equal(r.view(-1), p.view(-1))


def test_packed_chunks_fit_the_buffer_and_keep_the_order():
    assert packed_chunks([10, 10, 10], 0) == [range(0, 1), range(1, 2), range(2, 3)]  # unpacked: one each
    # 10 bytes pad to 16: 16 + 10 = 26 fits 32, a third does not
    assert packed_chunks([10, 10, 10], 32) == [range(0, 2), range(2, 3)]
    assert packed_chunks([5, 100, 5, 5], 64) == [range(0, 1), range(1, 2), range(2, 4)]  # the big one alone
    assert packed_chunks([], 64) == []
    assert packed_chunks([8] * 5, 1 << 20) == [range(0, 5)]


def test_one_refusal_stops_every_rank_before_any_tensor_moves():
    sent, (refused, other) = exchange(PAIRS, ["update_info.names: 'x' is not a tensor", None])
    assert isinstance(sent, TransferRefused) and "1 model worker(s) refused" in str(sent)
    assert isinstance(refused, TransferRefused) and "'x' is not a tensor" in str(refused)
    assert isinstance(other, TransferRefused) and "1 other model worker(s) refused" in str(other)


def test_refusal_names_the_first_unknown_name_or_wrong_shape():
    assert refusal(GlooUpdateInfo.of(PAIRS), MANIFEST) is None
    assert "'c' is not a tensor of the served checkpoint" in refusal(
        GlooUpdateInfo.of([("c", torch.zeros(1))]), MANIFEST)
    assert "'a.weight' is [4, 3], the served checkpoint's is [3, 4]" in refusal(
        GlooUpdateInfo.of([("a.weight", torch.zeros(4, 3))]), MANIFEST)


def test_the_manifest_is_read_from_the_checkpoint_headers(tmp_path: Path):
    save_file({name: tensor for name, tensor in PAIRS}, str(tmp_path / "model.safetensors"))
    assert checkpoint_manifest(tmp_path) == MANIFEST


@pytest.mark.parametrize("fields, says", [
    ({"names": ["a"], "dtype_names": ["float32"], "shapes": []}, "as long as each other"),
    ({"names": ["a"], "dtype_names": ["int8"], "shapes": [[1]]}, "'int8' is not one of"),
    ({"names": ["a", "a"], "dtype_names": ["float32"] * 2, "shapes": [[1], [1]]}, "appears twice"),
])
def test_malformed_update_info_is_refused_naming_the_field(fields, says):
    with pytest.raises(ValueError, match=says):
        GlooUpdateInfo(**fields)


@pytest.mark.parametrize("fields, says", [
    ({"master_port": 0}, "init_info.master_port"), ({"rank_offset": 0}, "init_info.rank_offset"),
    ({"rank_offset": 2, "world_size": 2}, "init_info.rank_offset"), ({"timeout_s": 0}, "init_info.timeout_s"),
    ({"packed": True, "packed_buffer_size_bytes": 0}, "init_info.packed_buffer_size_bytes"),
])
def test_init_info_outside_the_group_is_refused(fields, says):
    with pytest.raises(ValueError, match=says):
        GlooInitInfo(**{"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1, "world_size": 2,
                        **fields})


def test_a_worker_packs_only_as_the_trainer_says():
    base = {"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1, "world_size": 2}
    assert GlooInitInfo(**base).chunk_bytes == 0  # an older trainer that says nothing: one tensor a broadcast
    assert GlooInitInfo(**base, packed=True, packed_buffer_size_bytes=4096).chunk_bytes == 4096


class BrokenGroup:
    """A trainer's group whose broadcast breaks as gloo's does when a worker dies; `closed` once the trainer left
    it."""

    chunk_bytes = 0
    timeout_s = 0.2

    def __init__(self) -> None:
        self.closed = threading.Event()

    def verdict(self, refused: bool) -> int:
        return 0

    def broadcast(self, tensor: torch.Tensor) -> None:
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:913")

    def close(self) -> None:
        self.closed.set()


class Service:
    """The service's transfer routes as the trainer's client calls them: /update_weights answers `answer` (an
    error, or None: success) `delay_s` after the surviving workers' receives have ended, which the trainer's leaving
    the group brings about at once (else their timeout: not within these tests)."""

    def __init__(self, group: BrokenGroup, answer: Exception | None, delay_s: float = 0.0) -> None:
        self.group = group
        self.answer = answer
        self.delay_s = delay_s
        self.finished = False

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict) -> None:
        self.group.closed.wait(5)
        time.sleep(self.delay_s)
        if self.answer is not None:
            raise self.answer

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.finished = True


@pytest.fixture
def no_grace(monkeypatch):
    """The trainer waits for the service's answer only the group's timeout (0.2 s here)."""
    monkeypatch.setattr(gloo_transfer, "_ANSWER_GRACE_S", 0.0)


def test_a_push_whose_group_breaks_raises_the_services_answer_naming_the_dead_engine(no_grace):
    """gloo names only the address that closed; the service's answer names the engine, so the trainer gets that,
    caused by gloo's (WeightSender's WeightPushError, with the version every engine serves). The trainer leaves
    the group first, or the surviving workers would answer only at their timeout."""
    group = BrokenGroup()
    service = Service(group, RuntimeError("500: ... engine n/1 died during the weight transfer"))
    with pytest.raises(RuntimeError, match="engine n/1 died during the weight transfer") as raised:
        push(service, group, PAIRS)
    assert "Connection closed by peer" in str(raised.value.__cause__)
    assert group.closed.is_set() and not service.finished


@pytest.mark.parametrize("answer, delay_s", [(None, 0.0), (RuntimeError("late"), 1.0)],
                         ids=["the service saw no failure", "no answer within the group's timeout"])
def test_without_an_answer_naming_a_cause_the_broken_broadcasts_error_is_raised(no_grace, answer, delay_s):
    group = BrokenGroup()
    service = Service(group, answer, delay_s)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        push(service, group, PAIRS)
    assert not service.finished
