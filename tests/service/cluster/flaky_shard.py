"""`FlakyShard`: an in-process history shard that can be made unavailable, for the engine actor's push and pull
tests."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import ray

from das.service.cluster.history_store import HistoryShard
from das.service.config import HistoryConfig


class FlakyShard:
    """A `HistoryShard` behind an actor-handle look-alike (`shard.push.remote(...)` awaitable); `down` calls fail
    as Ray fails a call to a restarting actor, and `restart()` replaces the shard by one restored from its snapshot
    (another epoch)."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.shard = HistoryShard(0, HistoryConfig(shards=1), str(state))
        self.down = 0
        self.calls = 0
        self.push = SimpleNamespace(remote=self._call("push"))
        self.pull = SimpleNamespace(remote=self._call("pull"))

    def _call(self, method: str) -> Any:
        async def remote(*args: Any) -> Any:
            self.calls += 1
            if self.down:
                self.down -= 1
                raise ray.exceptions.ActorUnavailableError("restarting", None)
            return getattr(self.shard, method)(*args)
        return remote

    def restart(self) -> None:
        self.shard = HistoryShard(0, HistoryConfig(shards=1), str(self.state))
