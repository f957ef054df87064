"""`das serve` as a real process on loopback with a tiny model: a two-epoch batch through the trainer client."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

from das.service.client import RolloutClient
from das.service.models import prepare_model
from tests.tiny_models import build_tiny_model

TOKEN = "serve-test-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(text: str, name: str) -> float:
    """Sum of every sample of a counter family in Prometheus text (all label sets)."""
    return sum(float(v) for v in re.findall(rf"^{name}(?:_total)?(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def test_das_serve_two_epochs_through_the_client(tmp_path):
    model = build_tiny_model(tmp_path / "tiny", prepare_model("smollm2", progress=False), vocab_size=64, seed=0,
                             sharpness=12.0)
    port = free_port()
    das = Path(sys.executable).with_name("das")
    proc = subprocess.Popen([str(das), "serve", "--model", str(model), "--port", str(port), "--dtype", "float32",
                             "--max-model-len", "256", "--eager"], env={**os.environ, "DAS_TOKEN": TOKEN},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else "das serve exited"
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "das serve did not become ready"
            time.sleep(1)
        assert httpx.post(f"{url}/v1/rollouts", json={"groups": []}).status_code == 401
        groups = [{"problem_id": f"p{i}", "prompt_token_ids": [5, 6, 7 + i], "n": 4,
                   "sampling": {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}} for i in range(3)]
        accepted = []
        with RolloutClient(url, TOKEN) as client:
            for _ in range(2):
                samples = list(client.generate(groups))
                assert Counter((s.problem_id, s.sample_index) for s in samples) == \
                    Counter((f"p{i}", j) for i in range(3) for j in range(4))
                assert all(len(s.output_token_ids) == 24 and s.finish_reason == "length" for s in samples)
                accepted.append(sum(s.accepted_tokens for s in samples))
        assert accepted[1] > 0
        text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
        assert metric(text, "das_samples_served") == 24
        assert metric(text, "das_draft_tokens_accepted") == sum(accepted)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
