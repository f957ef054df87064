"""`das bench weight-sync`: how long a trainer's weights take to reach every engine of a running `das serve`, pushed
over vLLM's weight transfer (`WeightSender`: no disk) against the checkpoint path (the trainer writes safetensors
under the server's `--weights-root`, then `/update_weights {path}`: every engine reads it back).

Each repeat times a push and then one write + reload of the same tensors; with `packed`, also a push over a gloo
group that packs consecutive tensors into buffers of `DEFAULT_PACKED_BUFFER_BYTES` (the two pushes in alternating
order from one repeat to the next). Every push arm forms its group afresh and times its second push, so group
formation and a first push's allocations are left out of both alike. The figures are medians over repeats: seconds,
and GB/s of the tensors' bytes (1e9 bytes a GB). The checkpoint arm's write and reload are reported apart too. Each
sync moves the policy version by one; run it against a server no trainer uses.
"""

from __future__ import annotations

import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass(frozen=True)
class SyncTimes:
    """Medians over `repeats` of one sync's seconds: the push (one broadcast per tensor, the default), the packed
    push (None when not measured), and the checkpoint's write, reload and both."""

    bytes: int
    repeats: int
    push_s: float
    write_s: float
    reload_s: float
    push_packed_s: float | None = None

    @property
    def checkpoint_s(self) -> float:
        return self.write_s + self.reload_s

    def rows(self) -> list[tuple[str, float, float]]:
        """(arm, seconds, GB/s) for the report."""
        arms = [("push (weight transfer)", self.push_s), ("checkpoint write + reload", self.checkpoint_s),
                ("  write", self.write_s), ("  reload", self.reload_s)]
        if self.push_packed_s is not None:
            arms.insert(1, ("push, packed broadcasts", self.push_packed_s))
        return [(arm, s, self.bytes / s / 1e9) for arm, s in arms]


def time_weight_sync(url: str, token: str | None, checkpoint: Path, weights_root: Path, repeats: int,
                     packed: bool = False) -> SyncTimes:
    """Times `repeats` pushes and checkpoint syncs of the tensors in `checkpoint` (a model directory's
    safetensors, the served model's names and shapes) against the server at `url`, whose `--weights-root` is
    `weights_root` (as this process sees it). ValueError for a checkpoint without safetensors."""
    from safetensors.torch import load_file, save_file

    from das.service.client.weights import WeightSender
    from das.service.engine.vllm.gloo_transfer import DEFAULT_PACKED_BUFFER_BYTES

    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{checkpoint}: no *.safetensors weights")
    tensors = {name: tensor for path in files for name, tensor in load_file(path).items()}
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    arms: dict[int | None, list[float]] = {None: []}
    if packed:
        arms[DEFAULT_PACKED_BUFFER_BYTES] = []
    writes, reloads = [], []

    def push(buffer_bytes: int | None) -> float:
        with WeightSender(url, token, packed_buffer_size_bytes=buffer_bytes) as sender:
            sender.push(tensors.items())  # the group's first push: not timed
            start = time.perf_counter()
            sender.push(tensors.items())
            return time.perf_counter() - start

    with httpx.Client(base_url=url, headers=headers, timeout=None) as http:
        for repeat in range(repeats):
            order = list(arms) if repeat % 2 == 0 else list(reversed(arms))
            for buffer_bytes in order:
                arms[buffer_bytes].append(push(buffer_bytes))
            target = weights_root / f"das-bench-weight-sync-{repeat}"
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            try:
                start = time.perf_counter()
                save_file(tensors, str(target / "model.safetensors"))
                writes.append(time.perf_counter() - start)
                start = time.perf_counter()
                response = http.post("/update_weights", json={"path": str(target)})
                reloads.append(time.perf_counter() - start)
                response.raise_for_status()
            finally:
                shutil.rmtree(target, ignore_errors=True)
    packed_pushes = arms.get(DEFAULT_PACKED_BUFFER_BYTES) if packed else None
    return SyncTimes(size, repeats, statistics.median(arms[None]), statistics.median(writes),
                     statistics.median(reloads), statistics.median(packed_pushes) if packed_pushes else None)
