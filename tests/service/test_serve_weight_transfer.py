"""vLLM's weight transfer through `das serve` with real processes (docs/design.md "vLLM's RL control plane"): a
server on SmolLM2 with `--weight-transfer gloo`, trainers in processes of their own pushing with `WeightSender`.
Bad pushes first (a wrong name, a wrong shape, a trainer killed mid-push: a clear error, nothing loaded, the same
samples as before); an engine killed after a push, which must come back serving it; then a perturbed copy pushed,
whose next samples must be token for token those of a server started on that copy. The server is the session's
shared one (tests/conftest.py: the verifiers example runs on it first), then the reference server (this machine runs
one at a time). Several engines, an engine killed mid-push and a tensor-parallel engine are tested on the tiny model
(test_serve_weight_transfer_two_engines.py, test_serve_weight_transfer_tensor_parallel.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from das.service.client import RolloutClient
from das.service.wire.sample_progress import ProgressRecord
from tests.service.cluster.stub_service import process_pids, wait_until
from tests.service.serve_process import SMOLLM2_SERVE_FLAGS, TOKEN, Server, metric

# every test here runs on the session's shared server and changes its weights, or stops it: after its other users
pytestmark = pytest.mark.changes_shared_weights

GROUPS = [{"problem_id": f"w{i}", "prompt": prompt, "n": 2,
           "sampling": {"max_tokens": 16, "temperature": 1.0, "seed": 1234 + i, "ignore_eos": True}}
          for i, prompt in enumerate(["The capital of France is", "def fibonacci(n):"])]

# A trainer process: loads a checkpoint's tensors, optionally spoils them, pushes them with WeightSender and prints
# the outcome as one JSON line. No vLLM, Ray or server import (the sender's contract).
TRAINER = textwrap.dedent("""
    import json, sys
    from safetensors.torch import load_file
    from das.service.client.weights import WeightPushError, WeightSender
    url, token, checkpoint, spoil = sys.argv[1:5]
    pairs = sorted(load_file(checkpoint).items())
    if spoil == "name":
        pairs[0] = ("model.layers.0.no_such_proj.weight", pairs[0][1])
    elif spoil == "shape":
        pairs[-1] = (pairs[-1][0], pairs[-1][1][:-1])
    with WeightSender(url, token, timeout_s=30) as sender:
        try:
            print(json.dumps({"version": sender.push(pairs)}))
        except WeightPushError as exc:
            print(json.dumps({"status": exc.status, "error": exc.message}))
""")

# A trainer that dies mid-push: it joins, opens the push, sends a third of the tensors and ends its process.
DYING_TRAINER = textwrap.dedent("""
    import dataclasses, os, socket, sys, threading
    import httpx
    from safetensors.torch import load_file
    from das.service.client.weights import TransferControl
    from das.service.engine.vllm.gloo_transfer import GlooUpdateInfo, join_as_trainer
    url, token, checkpoint = sys.argv[1:4]
    pairs = sorted(load_file(checkpoint).items())
    control = TransferControl(httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=None))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # unpacked (a broadcast per tensor), so that it can die a third of the way through
    group = join_as_trainer(control, "127.0.0.1", port, control.call("GET", "/get_world_size")["world_size"] + 1, 30,
                            None)
    info = GlooUpdateInfo.of(pairs)
    control.start_weight_update()
    threading.Thread(target=control.update_weights, args=(dataclasses.asdict(info),), daemon=True).start()
    assert group.verdict(False) == 0
    for _, tensor in pairs[: len(pairs) // 3]:
        group.broadcast(tensor.contiguous())
    print("dying", flush=True)
    os._exit(9)
""")


def run_trainer(url: str, checkpoint: Path, spoil: str = "none") -> dict:
    result = subprocess.run([sys.executable, "-c", TRAINER, url, TOKEN, str(checkpoint), spoil],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def samples(url: str) -> tuple[list[list[int]], set[int]]:
    """The groups' tokens (by group, sample) and the policy versions they came from."""
    with RolloutClient(url, TOKEN) as client:
        got = sorted(client.generate(GROUPS), key=lambda s: (s.problem_id, s.sample_index))
    return [s.output_token_ids for s in got], {s.policy_version for s in got}


def scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60).text


@pytest.fixture(scope="module")
def perturbed(smollm2_float32, smollm2_weights_root) -> Path:
    """`das models perturb`: SmolLM2 with 5% noise on every tensor, under the shared server's weights root."""
    target = smollm2_weights_root / "smollm2-perturbed"
    das = Path(sys.executable).with_name("das")
    subprocess.run([str(das), "models", "perturb", str(smollm2_float32), str(target), "--scale", "0.05", "--seed",
                    "3"], check=True, capture_output=True, timeout=300)
    return target


@pytest.fixture(scope="module")
def server(smollm2_gloo_server) -> Server:
    """The session's SmolLM2 server with `--weight-transfer gloo` (tests/conftest.py); this module's last test stops
    it."""
    return smollm2_gloo_server


@pytest.fixture(scope="module")
def before(server) -> list[list[int]]:
    tokens, versions = samples(server.url)
    assert versions == {0}
    return tokens


def served_version(url: str) -> int:
    reply = httpx.get(f"{url}/v1/weights/transfer", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60).json()
    assert reply["backend"] == "gloo" and reply["world_size"] == 1
    return int(reply["policy_version"])


@pytest.mark.parametrize("spoil, says", [("name", "'model.layers.0.no_such_proj.weight' is not a tensor of the "
                                                  "served checkpoint"),
                                         ("shape", "the served checkpoint's is")])
def test_a_push_with_a_wrong_name_or_shape_is_refused_naming_it_and_loads_nothing(server, before, perturbed, spoil,
                                                                                  says):
    outcome = run_trainer(server.url, perturbed / "model.safetensors", spoil)
    assert outcome["status"] == 400 and says in outcome["error"], outcome
    assert served_version(server.url) == 0
    assert samples(server.url) == (before, {0})  # nothing of the refused push was loaded
    assert metric(scrape(server.url), "das_weight_transfers") == 0


def test_a_trainer_killed_mid_push_leaves_the_old_weights_serving(server, before, perturbed):
    result = subprocess.run([sys.executable, "-c", DYING_TRAINER, server.url, TOKEN,
                             str(perturbed / "model.safetensors")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 9 and "dying" in result.stdout, result.stderr
    # the engines' receive breaks at once (the peer closed); the push is given up and the batches run again
    assert samples(server.url) == (before, {0})
    assert served_version(server.url) == 0


def test_a_push_while_paused_splits_the_held_sample_between_the_two_versions(server, perturbed):
    long = [{"problem_id": "span", "prompt": "Once upon a time", "n": 1,
             "sampling": {"max_tokens": 96, "temperature": 1.0, "seed": 7, "ignore_eos": True}}]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    started = threading.Event()
    result: list = []

    def run() -> None:
        with RolloutClient(server.url, TOKEN) as client:
            for record in client.generate(long, progress=True):
                started.set()
                if not isinstance(record, ProgressRecord):
                    result.append(record)

    reader = threading.Thread(target=run)
    reader.start()
    assert started.wait(120)
    assert httpx.post(f"{server.url}/pause", params={"mode": "keep"}, headers=auth, timeout=60).status_code == 200
    served = served_version(server.url)
    assert run_trainer(server.url, perturbed / "model.safetensors") == {"version": served + 1}
    assert httpx.post(f"{server.url}/resume", headers=auth, timeout=60).status_code == 200
    reader.join(300)
    (sample,) = result
    (old, start), (new, resumed) = sample.policy_spans
    assert (old, start, new) == (served, 0, served + 1) and 0 < resumed < 96 and len(sample.output_token_ids) == 96


def test_the_grpo_examples_push_callback_moves_the_served_version_each_step(server, perturbed):
    """examples/grpo's `WeightPush`, as TRL calls it after an optimizer step: the model's parameters pushed with
    version = the steps taken; the service serves that version, and the trainer's end leaves the group."""
    from transformers import AutoModelForCausalLM

    from examples.grpo.rollout import ServiceConfig, WeightPush

    model = AutoModelForCausalLM.from_pretrained(perturbed, dtype="float32")
    served = served_version(server.url)
    push = WeightPush(ServiceConfig(url=server.url, token=TOKEN, max_tokens=16, temperature=1.0))
    for step in (served + 1, served + 2):
        push.on_step_end(None, SimpleNamespace(global_step=step), None, model=model)
    push.on_train_end(None, None, None)
    assert [r["policy_version"] for r in push.reloads] == [served + 1, served + 2]
    assert all(r["reload_s"] > 0 and r["save_s"] == 0 for r in push.reloads)
    assert served_version(server.url) == served + 2
    assert samples(server.url)[1] == {served + 2}


def test_an_engine_restarted_after_a_push_serves_the_pushed_weights(server, perturbed):
    """The push is saved under the state directory once the trainer has its answer; the engine actor killed after
    that is restarted, loads the saved push as it catches up, and samples as it did before the kill, as the pushed
    version (booting on its model again, it would serve version 0)."""
    served = served_version(server.url)
    assert run_trainer(server.url, perturbed / "model.safetensors") == {"version": served + 1}
    pushed = samples(server.url)
    assert pushed[1] == {served + 1}
    saved = server.state_dir / "pushed-weights" / f"v{served + 1}"
    wait_until(saved.is_dir, 120, f"the push was not saved at {saved}")
    restarts = metric(scrape(server.url), "das_engine_restarts")
    (actor,) = process_pids(server.proc.pid, "ray::NodeEngine")
    os.kill(actor, signal.SIGKILL)

    def serves_again() -> bool:
        text = scrape(server.url)
        return metric(text, "das_engine_restarts") == restarts + 1 and metric(text, "das_engines_ready") == 1

    wait_until(serves_again, 300, "the killed engine did not serve again")
    assert served_version(server.url) == served + 1
    assert samples(server.url) == pushed
    assert [p.name for p in saved.parent.iterdir()] == [saved.name]  # only the latest push is kept


def test_a_pushed_checkpoint_serves_the_samples_of_a_server_started_on_it(server, before, perturbed, tmp_path):
    served = served_version(server.url)
    outcome = run_trainer(server.url, perturbed / "model.safetensors")
    assert outcome == {"version": served + 1}
    pushed, versions = samples(server.url)
    assert versions == {served + 1} and pushed != before
    text = scrape(server.url)
    assert metric(text, "das_policy_version") == served + 1
    pushes = metric(text, "das_weight_transfers")
    checkpoint = perturbed / "model.safetensors"
    assert pushes >= 1  # this one, and any pushed by the tests before
    assert metric(text, "das_weight_transfer_bytes") == pushes * (checkpoint.stat().st_size - _header_bytes(checkpoint))
    # the same copy through the checkpoint path: the same samples (both reload a tied head: weight_transfer.py)
    reload = httpx.post(f"{server.url}/update_weights", json={"path": str(perturbed)},
                        headers={"Authorization": f"Bearer {TOKEN}"}, timeout=300)
    assert reload.status_code == 200, reload.text
    assert samples(server.url) == (pushed, {served + 2})
    server.stop()  # the shared server's last user (tests/conftest.py)
    reference = Server(perturbed, tmp_path / "state", *SMOLLM2_SERVE_FLAGS)  # the shared server's engine flags
    try:
        reference.wait_ready()
        assert samples(reference.url) == (pushed, {0})
    finally:
        reference.stop()


def _header_bytes(path: Path) -> int:
    """A safetensors file's header (8-byte length + JSON): the rest is the tensors' bytes."""
    with path.open("rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")
