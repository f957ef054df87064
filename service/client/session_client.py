"""Agent trajectories from the trainer's side: `ClientSession`, one per trajectory (`RolloutClient.session`), and
`run_turns`, one turn of many trajectories in one batch; their asyncio twins `AsyncClientSession`
(`AsyncRolloutClient.session`, an agent loop per trajectory as a task) and `run_turns_async`.

Token ids in and out, nothing re-tokenized: a session keeps its context as token ids (every turn's prompt tokens,
then its output tokens exactly as sampled), and a turn sends the context plus the new tokens the agent adds (a
tool's output, the next user message, already tokenized with the model's chat template by the trainer). The server
runs a session's turns on the engine holding its prefix (service/cluster/sessions.py), so a turn prefills only its new
tokens there.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING
from urllib.parse import quote

from das.service.wire.api import GroupRequest, SampleRecord, SamplingSpec
from das.service.wire.sessions import SessionSummary

if TYPE_CHECKING:
    from das.service.client import AsyncRolloutClient, RolloutClient


class _Trajectory:
    """What both twins keep: one trajectory of problem `problem_id` (`session_id` default: a fresh uuid).
    `context`: its token ids so far; `records`: each finished turn's sample (its `policy_version` and
    `policy_spans` say which weights drew it). A turn that ends in error or abort leaves the context as it was (the
    turn may be run again)."""

    def __init__(self, problem_id: str, session_id: str | None, sampling: SamplingSpec | None) -> None:
        self.problem_id = problem_id
        self.session_id = session_id or uuid.uuid4().hex
        self.sampling = sampling or SamplingSpec()
        self.context: list[int] = []
        self.records: list[SampleRecord] = []

    def group(self, new_tokens: Sequence[int], sampling: SamplingSpec | None = None) -> GroupRequest:
        """The next turn as a group (n = 1): the context plus `new_tokens` as its prompt."""
        prompt = [*self.context, *new_tokens]
        if not prompt:
            raise ValueError("a turn needs tokens: the first turn's new_tokens are the trajectory's prompt")
        return GroupRequest(problem_id=self.problem_id, session_id=self.session_id, n=1,
                            prompt_token_ids=tuple(prompt), sampling=sampling or self.sampling)

    def take(self, group: GroupRequest, record: SampleRecord) -> None:
        """Appends a finished turn (`group` as `group()` built it, `record` its sample) to the context."""
        if record.finish_reason in ("stop", "length"):
            self.context = [*(group.prompt_token_ids or ()), *record.output_token_ids]
        self.records.append(record)

    def _path(self) -> str:
        return f"/v1/sessions/{quote(self.session_id, safe='')}"


def _done(groups: Sequence[GroupRequest], records: Sequence[SampleRecord | None]) -> list[SampleRecord]:
    done = [r for r in records if r is not None]
    if len(done) != len(groups):  # generate yields every group's sample or raises: a server breaking its contract
        raise RuntimeError(f"the batch ended with {len(groups) - len(done)} turn(s) missing")
    return done


class ClientSession(_Trajectory):
    """A trajectory through the blocking `RolloutClient`."""

    def __init__(self, client: RolloutClient, problem_id: str, session_id: str | None = None,
                 sampling: SamplingSpec | None = None) -> None:
        super().__init__(problem_id, session_id, sampling)
        self.client = client

    def turn(self, new_tokens: Sequence[int], sampling: SamplingSpec | None = None) -> SampleRecord:
        """Runs one turn on `new_tokens` (the whole prompt, the first time) and returns its sample, whose
        `output_token_ids` the context now ends with. RolloutError if the server refuses it or its batch fails."""
        group = self.group(new_tokens, sampling)
        (record,) = list(self.client.generate([group], logprobs=True))
        self.take(group, record)
        return record

    def summary(self) -> SessionSummary:
        """The server's view (turns with their engines and policy versions, moves); RolloutError (404) once the
        session ended."""
        return SessionSummary.model_validate(self.client._call("GET", self._path()))

    def end(self) -> SessionSummary:
        """Ends the session on the server, aborting its turn still running (which frees its engine's work)."""
        return SessionSummary.model_validate(self.client._call("DELETE", self._path()))


class AsyncClientSession(_Trajectory):
    """A trajectory through `AsyncRolloutClient`: the same, awaited."""

    def __init__(self, client: AsyncRolloutClient, problem_id: str, session_id: str | None = None,
                 sampling: SamplingSpec | None = None) -> None:
        super().__init__(problem_id, session_id, sampling)
        self.client = client

    async def turn(self, new_tokens: Sequence[int], sampling: SamplingSpec | None = None) -> SampleRecord:
        """As `ClientSession.turn`."""
        group = self.group(new_tokens, sampling)
        (record,) = [r async for r in self.client.generate([group], logprobs=True)]
        self.take(group, record)
        return record

    async def summary(self) -> SessionSummary:
        return SessionSummary.model_validate(await self.client._call("GET", self._path()))

    async def end(self) -> SessionSummary:
        return SessionSummary.model_validate(await self.client._call("DELETE", self._path()))


def run_turns(client: RolloutClient, steps: Sequence[tuple[ClientSession, Sequence[int]]],
              sampling: SamplingSpec | None = None) -> list[SampleRecord]:
    """One turn of each (session, new tokens) in one batch (a turn per session; many trajectories at once, each
    placed on its own engine); the records in `steps` order, each session's context extended."""
    groups = [session.group(tokens, sampling) for session, tokens in steps]
    records: list[SampleRecord | None] = [None] * len(groups)
    for record in client.generate(groups, logprobs=True):
        records[record.group_index] = record
    done = _done(groups, records)
    for (session, _), group, record in zip(steps, groups, done):
        session.take(group, record)
    return done


async def run_turns_async(client: AsyncRolloutClient, steps: Sequence[tuple[AsyncClientSession, Sequence[int]]],
                          sampling: SamplingSpec | None = None) -> list[SampleRecord]:
    """As `run_turns`, awaited."""
    groups = [session.group(tokens, sampling) for session, tokens in steps]
    records: list[SampleRecord | None] = [None] * len(groups)
    async for record in client.generate(groups, logprobs=True):
        records[record.group_index] = record
    done = _done(groups, records)
    for (session, _), group, record in zip(steps, groups, done):
        session.take(group, record)
    return done
