"""`HistoryClient`: how a node engine hands finished rollouts to the history shards without losing any, and pulls
what others pushed.

The guarantee: a finished rollout an engine pushed is in its shard's history as long as the engine's process lives,
whatever happens to the shard (with a state directory and Ray restarting the shard). Every record gets an id,
1, 2, ... per (origin, shard), and stays in the client's outbox until the shard says a snapshot on disk holds it
(`PushReply.durable`). A push that fails because the shard is unavailable (dead, restarting) is retried with
backoff for `HistoryPushConfig.retry_s`, then its records stay in the outbox and go with the next push to that
shard. A reply from a new shard process (another `epoch`: it restarted and restored its last snapshot) makes the
client send the whole outbox again; the shard stores each (origin, id) once, so what its snapshot already held is
not stored twice.

Not covered: the engine's process dying too (its outbox goes with it: what came after the shard's last snapshot
is lost), a shard that stays down while the outbox passes `max_pending_tokens` (the oldest records are given up,
with a warning), and a record the shard refuses as invalid (logged and dropped: sending it again cannot help).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from das.service.cluster.history_store import PushReply, shard_of
from das.service.config import HistoryPushConfig

log = logging.getLogger(__name__)


@dataclass
class _Outbox:
    """What one origin pushed to one shard and the shard has not yet snapshotted (in id order)."""

    next_id: int = 1
    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    acked: set[int] = field(default_factory=set)  # ids the shard process of `epoch` has stored
    epoch: str | None = None

    def settled(self) -> int:
        """Every id up to this one is durable or given up: the shard may forget them."""
        return min(self.records, default=self.next_id) - 1


class HistoryClient:
    """Pushes and pulls for every origin of one node engine. `shards`: the shard actor handles, in shard order.
    Runs on one event loop (the node engine's); concurrent pushes to one shard may send a record twice, which the
    shard's ids make harmless."""

    def __init__(self, shards: Sequence[Any], config: HistoryPushConfig) -> None:
        self.shards = list(shards)
        self.config = config
        self._outboxes: dict[tuple[str, int], _Outbox] = {}
        self._tokens = 0  # output tokens in every outbox
        self.given_up = 0  # records dropped from a full outbox or refused by a shard

    def pending(self) -> int:
        """Records not yet known to be in a snapshot."""
        return sum(len(box.records) for box in self._outboxes.values())

    async def pull(self, s: int, cursors: dict[str, int], origin: str
                   ) -> dict[str, tuple[list[dict[str, Any]], int]]:
        """`HistoryShard.pull` on shard `s`, retried like a push while the shard is unavailable; after that {} (the
        engine drafts without those rollouts this time; its cursors stay, so the next pull gets them)."""
        import ray

        deadline = time.monotonic() + self.config.retry_s
        delay = self.config.backoff_s
        while True:
            try:
                reply: dict[str, tuple[list[dict[str, Any]], int]] = await self.shards[s].pull.remote(cursors, origin)
                return reply
            except ray.exceptions.RayActorError as exc:
                if time.monotonic() + delay > deadline:
                    log.warning("%s: history shard %d unavailable (%s); running without its rollouts", origin, s,
                                type(exc).__name__)
                    return {}
                await asyncio.sleep(delay)
                delay = min(2 * delay, self.config.max_backoff_s)

    async def push(self, origin: str, records: Sequence[dict[str, Any]]) -> None:
        """Hands history-format records to their shards; returns once each shard acknowledged them or the retry
        time ran out (they are then kept for the next push). Never raises for an unavailable shard."""
        touched: set[int] = set()
        for record in records:
            s = shard_of(record["problem_id"], len(self.shards))
            box = self._outboxes.setdefault((origin, s), _Outbox())
            box.records[box.next_id] = record
            box.next_id += 1
            self._tokens += len(record["output_token_ids"])
            touched.add(s)
        self._bound()
        await asyncio.gather(*(self._send(origin, s) for s in sorted(touched)))

    async def _send(self, origin: str, s: int) -> None:
        import ray

        box = self._outboxes[(origin, s)]
        deadline = time.monotonic() + self.config.retry_s
        delay = self.config.backoff_s
        while True:
            ids = [i for i in box.records if i not in box.acked]
            if not ids:
                return
            try:
                reply: PushReply = await self.shards[s].push.remote(origin, [box.records[i] for i in ids], ids,
                                                                     box.settled())
            except ray.exceptions.RayActorError as exc:  # dead or restarting: the records stay in the outbox
                if time.monotonic() + delay > deadline:
                    log.warning("%s: history shard %d unavailable (%s); %d rollouts kept for the next push",
                                origin, s, type(exc).__name__, len(ids))
                    return
                await asyncio.sleep(delay)
                delay = min(2 * delay, self.config.max_backoff_s)
                continue
            except ray.exceptions.RayTaskError:  # the shard refused the records: re-sending cannot help
                log.exception("%s: history shard %d refused %d rollouts; dropped", origin, s, len(ids))
                self._drop(box, ids)
                self.given_up += len(ids)
                return
            if box.epoch is not None and reply.epoch != box.epoch:
                # A new shard process: it holds what its snapshot held, so everything not yet durable goes again.
                log.warning("%s: history shard %d restarted; re-sending %d rollouts not in its snapshot", origin,
                            s, len(box.records) - len(ids))
                box.acked.clear()
            box.epoch = reply.epoch
            box.acked.update(ids)
            self._drop(box, [i for i in box.records if i <= reply.durable])

    def _drop(self, box: _Outbox, ids: Sequence[int]) -> None:
        for i in ids:
            record = box.records.pop(i, None)
            if record is not None:
                self._tokens -= len(record["output_token_ids"])
            box.acked.discard(i)

    def _bound(self) -> None:
        """Gives up the oldest records while the outboxes hold more than `max_pending_tokens`."""
        dropped = 0
        while self._tokens > self.config.max_pending_tokens:
            box = max((b for b in self._outboxes.values() if b.records), key=lambda b: len(b.records))
            self._drop(box, [next(iter(box.records))])
            dropped += 1
        if dropped:
            self.given_up += dropped
            log.warning("history outbox full (%d tokens): gave up the %d oldest rollouts not yet in a snapshot",
                        self.config.max_pending_tokens, dropped)
