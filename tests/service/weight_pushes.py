"""What the weight-transfer tests over several model workers share (tests/service/test_serve_weight_transfer_*.py:
two engines, a tensor-parallel engine): two tiny checkpoints of one architecture, a push with `WeightSender`, a
checkpoint reload, the transfer's report, and `draws`: one batch's samples, checked to be one draw per prompt and
sample index whichever engine drew it.

The batch sends each group twice under two problem ids (copies): sampling is keyed by (seed, sample index,
position), not by problem or engine (service/wire/sample_keys.py), so under one set of weights every copy draws the
same tokens, and placement spreads the copies over the engines (equal predicted lengths go to the least loaded
engine). A copy drawn under other weights than its twin (an engine a push missed) fails the check."""

from __future__ import annotations

from pathlib import Path

import httpx

from das.service.client import RolloutClient
from das.service.client.weights import WeightSender
from das.service.engine.vllm.models import prepare_model
from das.service.wire.weight_transfer import WeightTransferInfo
from tests.service.serve_process import TOKEN
from tests.tiny_models import build_tiny_model

AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPTS = ([5, 6, 7], [9, 10, 11, 12])
COPIES = 2
SAMPLES = 2  # n of each group
PROMPT_OF = {f"p{p}-copy{c}": p for p in range(len(PROMPTS)) for c in range(COPIES)}  # problem id -> prompt index
GROUPS = [{"problem_id": problem, "prompt_token_ids": PROMPTS[p], "n": SAMPLES,
           "sampling": {"max_tokens": 16, "temperature": 1.0, "seed": 1234 + p, "ignore_eos": True}}
          for problem, p in PROMPT_OF.items()]

Draws = dict[tuple[int, int], list[int]]  # (prompt index, sample index) -> the tokens drawn


def tiny_checkpoints(root: Path) -> tuple[Path, Path]:
    """(served, other): two tiny random Llamas of the same names and shapes under `root` (a server's
    --weights-root, so either reloads by path). The tests start servers on `served`, load `other` and push
    `served` back."""
    smollm2 = prepare_model("smollm2", progress=False)
    return (build_tiny_model(root / "served", smollm2, vocab_size=64, seed=1, sharpness=12.0),
            build_tiny_model(root / "other", smollm2, vocab_size=64, seed=0, sharpness=12.0))


def draws(url: str, engines: int) -> tuple[Draws, int]:
    """The batch's draws and the one policy version they came from, checked: every copy of a group drew the same
    tokens, every sample came from that one version, and `engines` engines drew them."""
    with RolloutClient(url, TOKEN) as client:
        got = list(client.generate(GROUPS))
    assert len(got) == len(GROUPS) * SAMPLES
    seen: dict[tuple[int, int], list[list[int]]] = {}
    for sample in got:
        seen.setdefault((PROMPT_OF[sample.problem_id], sample.sample_index), []).append(sample.output_token_ids)
    mixed = {key: copies for key, copies in seen.items() if any(c != copies[0] for c in copies)}
    assert not mixed, f"copies drew different tokens (engines on different weights): {mixed}"
    assert len({s.engine for s in got}) == engines, [s.engine for s in got]
    versions = {s.policy_version for s in got}
    assert len(versions) == 1, f"samples of several versions: {[(s.engine, s.policy_version) for s in got]}"
    return {key: copies[0] for key, copies in seen.items()}, versions.pop()


def push(url: str, checkpoint: Path) -> int:
    """`checkpoint`'s tensors pushed with `WeightSender`; the policy version served after it."""
    from safetensors.torch import load_file

    with WeightSender(url, TOKEN, timeout_s=30) as sender:
        return sender.push(sorted(load_file(checkpoint / "model.safetensors").items()))


def reload(url: str, checkpoint: Path) -> int:
    """`checkpoint` loaded by path (/update_weights {path}); the policy version served after it."""
    response = httpx.post(f"{url}/update_weights", json={"path": str(checkpoint)}, headers=AUTH, timeout=300)
    assert response.status_code == 200, response.text
    return int(response.json()["policy_version"])


def transfer(url: str) -> WeightTransferInfo:
    """GET /v1/weights/transfer, checked against vLLM's GET /get_world_size."""
    info = WeightTransferInfo.model_validate(httpx.get(f"{url}/v1/weights/transfer", headers=AUTH, timeout=60).json())
    world = httpx.get(f"{url}/get_world_size", headers=AUTH, timeout=60).json()
    assert world == {"world_size": info.world_size}
    return info


def tensor_bytes(checkpoint: Path) -> int:
    """The bytes of a checkpoint's tensors (what a push of it sends)."""
    path = checkpoint / "model.safetensors"
    with path.open("rb") as f:
        return path.stat().st_size - 8 - int.from_bytes(f.read(8), "little")
