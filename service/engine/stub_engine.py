"""`StubEngine`: an `Engine` (service/engine/protocol.py) without a model, for tests and load tests of the Ray service
and of the gateway (`EngineBackend` over a stub engine).

Each sample is `tokens` tokens long (capped by max_tokens) of a fixed pattern that follows from the sample's key
(`stub_tokens`), produced at `token_s` seconds a token, or all at once without it. Samples may also be paced per
sample: `first_sample_s` after its group started at the earliest, and one every `sample_s` seconds across every
group in flight (samples of concurrent groups take turns: sample 0 of each, then sample 1, ...; unpaced they take
turns too, each letting the loop run before it). It drafts nothing unless told (`draft_figures`): `draft_tokens`
and `accepted_tokens` are 0, so no figure from it can pass for a speedup. Every sample carries `text` (None: no
tokenizer ran), and for a group naming a tool_parser what `tool_parsing` makes of that text. It counts the history
it was given (`history_records`), which is what service tests check. It refuses what the engine refuses without
needing vLLM: the API's bounds (service/wire/api.py, vLLM's own sampling limits) and the
model's (prompt and stop token ids within the vocabulary, the prompt and max_tokens within the context). It reports
progress and resumes samples from a prefix as `Engine.generate` does. It keeps the trace headers its latest samples
were given (`trace_headers`: what a vLLM engine that traces passes to vLLM, GroupRequest.trace_headers), which is what
tracing tests check.

Pause and resume as vLLM's engine does them (`pause`, docs/design.md "vLLM's RL control plane"): a group's n
samples are all in flight from the moment `generate` is called (they are produced one after another, as if the
engine's steps served them in that order). Groups that arrive while paused are held until `resume` (vLLM 0.32's
queue), or under `pause_behavior="reject"` ended at once, every sample with finish_reason "error", unless the pause is
"keep" (a vLLM that rejects new requests while paused, as the audit of issue 45 read vLLM 0.33: the service must never
send work to a paused engine, service/engine/pause_gate.py). "keep" freezes
the samples in flight between two tokens; each token carries the policy version served when its step began, so a
sample spanning a weight update says so (`SampleResult.policy_spans`). "abort" ends every sample in flight, held
groups included, with finish_reason "abort" and the tokens it had. "wait" returns once the groups in flight ended.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from das.service.engine.pause_gate import PauseGate
from das.service.engine.runner_choice import RunnerChoice
from das.service.engine.contract import (EngineConfigError, EngineInputError, EngineTally, StepPartTotals,
                                         context_error, validate_rollouts)
from das.service.wire.api import GroupRequest, PauseMode, SampleResult, ToolCall, seeded_groups
from das.service.wire.sample_progress import SampleProgress


# (group, a sample's text, its token ids) -> (content, tool calls): what an engine's tool-call parsing returns
# (service/engine/vllm/tool_calls.py `ToolCallParsing.parse`, which tests hand a stub engine: this one loads no vLLM)
ToolParsing = Callable[[GroupRequest, str, Sequence[int]], tuple[str | None, list[ToolCall]]]

# The log-probability every stub token is drawn with.
STUB_LOGPROB = -1.0

# Trace headers a stub engine keeps, the latest samples' (a load test runs millions of samples through one).
TRACE_HEADERS_KEPT = 1024

# The errors a stub engine's load can be told to raise (`StubLoadError`): the kinds a real engine's load raises.
_LOAD_ERRORS: dict[str, type[Exception]] = {
    "ImportError": ImportError, "ModuleNotFoundError": ModuleNotFoundError, "FileNotFoundError": FileNotFoundError,
    "EngineConfigError": EngineConfigError, "ValueError": ValueError, "RuntimeError": RuntimeError,
    "MemoryError": MemoryError}


class StubLoadError(BaseModel):
    """A load that fails, for tests: `create` raises `kind(message)` on the Ray nodes `nodes` (node ids in hex;
    None: everywhere)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["ImportError", "ModuleNotFoundError", "FileNotFoundError", "EngineConfigError", "ValueError",
                  "RuntimeError", "MemoryError"]
    message: str
    nodes: tuple[str, ...] | None = None

    def applies_here(self) -> bool:
        if self.nodes is None:
            return True
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_node_id() in self.nodes


class StubEngineConfig(BaseModel):
    """A stub engine's shape (`kind: stub` in the service's engine configuration, service/engine/factory.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["stub"] = "stub"
    tokens: int = Field(16, ge=0, description="output tokens per sample (before max_tokens)")
    token_s: float = Field(0.0, ge=0, description="seconds per output token of a sample")
    first_sample_s: float = Field(0.0, ge=0, description="seconds from a group's start before its first sample "
                                  "can finish")
    sample_s: float = Field(0.0, ge=0, description="seconds between two samples the engine finishes, across all "
                            "groups in flight (a fixed throughput: concurrent groups' samples take turns)")
    text: str | None = Field(None, description="every sample's text (None: no tokenizer ran)")
    draft_figures: bool = Field(False, description="each sample reports half its new tokens drafted and a quarter "
                                "accepted (one decode step saved per accepted token), for tests of the figures' "
                                "sums; off, the stub drafts nothing, so no figure from it can pass for a speedup")
    max_model_len: int = Field(2048, ge=2)
    vocab_size: int = Field(32000, ge=2)
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs an engine takes on a GPU node (placement "
                                      "only: the stub has no model workers), as EngineConfig's")
    pause_behavior: Literal["queue", "reject"] = Field(
        "queue", description="what a group that arrives while paused meets: queue (held until resume, as vLLM 0.32 "
        "does), reject (under abort and wait pauses its samples end at once with finish_reason error, as a vLLM "
        "with reject_new_requests does)")
    exit_on_problem: str | None = Field(None, description="a problem_id whose group, once started, ends the "
                                        "engine's process at once: a prompt that crashes the engine, for tests")
    load_s: float = Field(0.0, ge=0, description="seconds a load takes (a model's load, for tests)")
    load_error: StubLoadError | None = Field(None, description="a load that fails (after load_s), for tests")
    engines_per_actor: int = Field(1, ge=1, description="engines one NodeEngine actor hosts (load tests of the "
                                   "coordinator at hundreds of engines: each is still an engine of its own to the "
                                   "coordinator's placement, but they share a process and one stream a batch, so a "
                                   "death takes all of them; a vLLM engine always has an actor of its own)")


    @property
    def cpu_workers(self) -> int:
        """No model workers: a stub engine fits any node."""
        return 0

    @property
    def weight_transfer(self) -> Literal["none"]:
        """No weight transfer: vLLM's transfer routes answer 501 over stub engines."""
        return "none"


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def stub_tokens(key: int, start: int, stop: int, vocab_size: int) -> list[int]:
    """A stub sample's tokens at positions [start, stop): token p is (7 p + key) % vocab_size, `key` the sample's key
    (GroupRequest.sample_key), so a sample drawn again under its key repeats its draw.

    A slice of a table of the vocabulary's ids (`_token_table`): its entries are ints made once, where building the
    list afresh would make one int object a token (most ids are above CPython's small-int cache), about 8 us a
    256-token sample in an in-process stub's event loop."""
    first = (7 * start + key) % vocab_size
    end = first + 7 * (stop - start)
    return _token_table(vocab_size, end)[first:end:7]


_TOKEN_TABLES: dict[int, list[int]] = {}  # vocabulary size -> its `_token_table`


def _token_table(vocab_size: int, length: int) -> list[int]:
    """At least `length` entries, entry j being j % vocab_size: the vocabulary's ids 0 .. vocab_size - 1 repeated,
    each id one int object (the repeats are references to it). Kept per vocabulary size, grown when a longer one is
    asked for (one sample of a max_model_len-long output needs vocab_size + 7 max_model_len)."""
    table = _TOKEN_TABLES.get(vocab_size)
    if table is None or len(table) < length:
        ids = table[:vocab_size] if table is not None else list(range(vocab_size))
        table = _TOKEN_TABLES[vocab_size] = (ids * -(-length // vocab_size))[:max(length, vocab_size)]
    return table


class StubEngine:
    """An `Engine` without a model (the module's docstring says what it plays); `tool_parsing` parses each sample's
    text for a group naming a tool_parser (None: such groups get no tool calls)."""

    def __init__(self, config: StubEngineConfig, tool_parsing: ToolParsing | None = None) -> None:
        self.config = config
        self.tool_parsing = tool_parsing
        self.policy_version = 0
        self.tally = EngineTally()
        self.history_records = 0
        self._gate = PauseGate()
        self._groups = 0  # groups in flight (held ones excluded)
        self._unfinished = 0  # samples of the groups in flight not yet yielded
        self._waiting: set[asyncio.Future[None]] = set()  # samples waiting for their turn under per-sample pacing
        self._next_turn = 0.0  # loop time of the next turn under per-sample pacing
        self.dead = False  # no engine core that could die
        self.runner: RunnerChoice | None = None  # no model runner
        self.tokens_made: Counter[str] = Counter()  # per problem_id, tokens generated (tests see a sample stop)
        # (problem_id, sample index in the request, its headers) of the latest samples started with trace headers
        self.trace_headers: deque[tuple[str, int, dict[str, str]]] = deque(maxlen=TRACE_HEADERS_KEPT)
        # every sample is a copy of it with its own fields (building and checking a model per sample, or per group,
        # would cost a load test's gateway process, where an in-process stub runs, time a real engine spends
        # elsewhere: a batch's groups all start in one turn of the event loop); nothing of the config is copied into
        # it, since a running engine's config may be replaced
        self._blank = SampleResult.model_construct(
            problem_id="", sample_index=0, token_ids=[], logprobs=[], finish_reason="stop", policy_version=0)

    @classmethod
    async def create(cls, config: StubEngineConfig) -> StubEngine:
        if config.load_s:
            await asyncio.sleep(config.load_s)
        failure = config.load_error
        if failure is not None and failure.applies_here():
            raise _LOAD_ERRORS[failure.kind](failure.message)
        return cls(config)

    def prompt_token_ids(self, group: GroupRequest) -> list[int]:
        if group.prompt_token_ids is not None:
            ids = list(group.prompt_token_ids)
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise EngineInputError(f"prompt_token_ids: {len(bad)} token id(s) outside the vocabulary "
                                       f"[0, {self.config.vocab_size}), first {bad[0]}")
        else:
            text = group.prompt if group.prompt is not None else " ".join(m.content or "" for m in group.messages or ())
            ids = [1 + len(word) % (self.config.vocab_size - 1) for word in text.split()] or [1]
        if len(ids) >= self.config.max_model_len:
            raise EngineInputError(f"prompt is {len(ids)} tokens; the context holds {self.config.max_model_len} "
                                   f"and at least one output token must fit")
        outside = [t for t in group.sampling.stop_token_ids if not 0 <= t < self.config.vocab_size]
        if outside:
            raise EngineInputError(f"sampling.stop_token_ids: {outside[0]} is outside the vocabulary "
                                   f"[0, {self.config.vocab_size})")
        if len(ids) + group.sampling.max_tokens > self.config.max_model_len:
            raise EngineInputError(context_error(len(ids), group.sampling.max_tokens, self.config.max_model_len))
        return ids

    async def generate(self, group: GroupRequest,
                       on_progress: Callable[[SampleProgress], None] | None = None) -> AsyncIterator[SampleResult]:
        """As `Engine.generate`: `on_progress` hears of every token but each sample's last; a resumed sample
        (group.prefix_token_ids) continues from its prefix, at the positions after it."""
        prompt = self.prompt_token_ids(group)
        if group.sampling.seed is None:  # as Engine.generate, with a fixed seed: the stub is deterministic
            (group,) = seeded_groups([group], 0)
        length = min(self.config.tokens, group.sampling.max_tokens)
        if self._gate.mode in ("abort", "wait") and self.config.pause_behavior == "reject":
            for index in range(group.n):
                yield SampleResult(problem_id=group.problem_id, sample_index=index, token_ids=[], logprobs=[],
                                   finish_reason="error", policy_version=self.policy_version, prompt_token_ids=prompt,
                                   error=f"the engine is paused ({self._gate.mode}) and rejects new requests")
            return
        epoch = await self._gate.admit()
        if group.problem_id == self.config.exit_on_problem:
            os._exit(1)
        if group.trace_parents is not None:  # checked once a group: a batch's groups all start in one turn of the loop
            for index in range(group.n):  # all n requests made now, as a vLLM engine makes them
                if (headers := group.trace_headers(index)) is not None:
                    self.trace_headers.append((group.problem_id, index, headers))
        start = time.perf_counter()
        earliest = asyncio.get_running_loop().time() + self.config.first_sample_s
        self.tally.running += group.n  # the group's samples, until the group ends
        self._groups += 1
        self._unfinished += group.n
        yielded = 0
        try:
            for index in range(group.n):
                await self._turn(earliest, epoch)
                sample = await self._draw(group, prompt, index, length, epoch, start, on_progress)
                self._unfinished -= 1
                yielded += 1
                yield sample
                # Not referenced while the next turn is awaited (under per-sample pacing a whole round of the
                # groups in flight): a sample kept that long outlives the garbage collector's young generation, and
                # its collections then scan every group's latest sample (milliseconds each, in the event loop of a
                # load test's gateway).
                del sample
        finally:
            self.tally.running -= group.n
            self._groups -= 1
            self._unfinished -= group.n - yielded
            self._gate.notify()

    async def _draw(self, group: GroupRequest, prompt: list[int], index: int, length: int, epoch: int, start: float,
                    on_progress: Callable[[SampleProgress], None] | None) -> SampleResult:
        """Sample `index` of `group` (seeded; its prompt's token ids `prompt`), `length` tokens long unless aborted
        (epoch `epoch` ended); `start`: the group's start (time.perf_counter)."""
        # the sample's tokens are a function of its key, as under keyed sampling: a re-drawn sample repeats
        key = group.sample_key(index)
        assert key is not None  # seeded by generate
        tokens = list(group.prefix_token_ids[index]) if group.prefix_token_ids is not None else []
        resumed = len(tokens)
        first: float | None = None  # seconds from the group's start to this sample's first new token
        spans: list[tuple[int, int]] = []
        pace = self.config.token_s / group.n  # the group's samples share the engine's steps
        while len(tokens) < length and self._gate.abort_epoch == epoch:
            await self._gate.unfrozen(epoch)
            version = self.policy_version  # the weights of this token's step
            if pace:
                await asyncio.sleep(pace)
            if self._gate.abort_epoch != epoch:
                break
            if not spans or spans[-1][0] != version:
                spans.append((version, len(tokens)))
            # paced, a token a step; unpaced, the rest at once (no await between tokens: nothing could happen
            # between them)
            at = len(tokens)
            tokens += stub_tokens(key, at, at + 1 if pace else length, self.config.vocab_size)
            if first is None:
                first = time.perf_counter() - start
            self.tokens_made[group.problem_id] += len(tokens) - at
            if on_progress is not None and at < length - 1:
                shown = tokens[at:length - 1]  # the new tokens but the sample's last
                on_progress(SampleProgress(index, at, shown, [STUB_LOGPROB] * len(shown), "", version))
        if len(tokens) < length:
            finish: Literal["stop", "length", "abort"] = "abort"
        else:
            finish = "length" if length == group.sampling.max_tokens else "stop"
        return self._sample(group, prompt, index, tokens, resumed, finish, spans, first,
                            time.perf_counter() - start)

    async def _turn(self, earliest: float, epoch: int) -> None:
        """Waits for a sample's turn to be made: not before `earliest` (loop time) and `sample_s` after the previous
        turn, turns given in the order they are asked for (by the schedule, not the wake-up: late timers are caught
        up with, in a burst, as at a fixed throughput); an abort ends the wait at once. Unpaced, lets the loop run
        once (the other groups' samples, the sockets) before the sample, as an engine's steps would."""
        if not (self.config.sample_s or self.config.first_sample_s):
            await asyncio.sleep(0)
            return
        if self._gate.abort_epoch != epoch:
            return
        loop = asyncio.get_running_loop()
        turn = max(earliest, self._next_turn)
        self._next_turn = turn + self.config.sample_s
        wake = loop.create_future()
        timer = loop.call_at(turn, _wake, wake)
        self._waiting.add(wake)
        try:
            await wake
        finally:
            timer.cancel()
            self._waiting.discard(wake)

    def _end_waits(self) -> None:
        """An abort: the samples waiting for their turn go at once (to end "abort"), and the turns start afresh."""
        for wake in self._waiting:
            _wake(wake)
        self._next_turn = 0.0

    def _sample(self, group: GroupRequest, prompt: list[int], index: int, tokens: list[int], resumed: int,
                finish: Literal["stop", "length", "abort"], spans: list[tuple[int, int]], first: float | None,
                total_s: float) -> SampleResult:
        """The finished sample, a copy of the engine's `_blank` (its group's samples share the `prompt` list):
        `tokens` after `resumed` are new; `spans` as in the module's docstring."""
        new = len(tokens) - resumed
        accepted = new // 4 if self.config.draft_figures else 0
        update: dict[str, Any] = {
            "problem_id": group.problem_id, "prompt_token_ids": prompt, "text": self.config.text,
            "sample_index": index, "token_ids": tokens, "logprobs": [STUB_LOGPROB] * new, "finish_reason": finish,
            "policy_version": spans[0][0] if spans else self.policy_version,
            "policy_spans": spans if len(spans) > 1 or (resumed and spans) else None,
            "draft_tokens": new // 2 if self.config.draft_figures else 0, "accepted_tokens": accepted,
            "decode_steps": new - accepted, "first_token_s": first, "total_s": total_s}
        if group.tool_parser is not None and self.tool_parsing is not None and self.config.text is not None:
            update["content"], update["tool_calls"] = self.tool_parsing(group, self.config.text, tokens)
        return self._blank.model_copy(update=update)

    # ---- pause (vLLM's RL control plane) ----

    async def pause(self, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        """As `Engine.pause`; `clear_cache` has nothing to clear here."""
        self._gate.pause(mode)
        if mode == "abort":
            self._end_waits()
        if mode == "wait":
            await self._gate.until(lambda: not self._groups)

    async def resume(self) -> None:
        self._gate.resume()

    async def is_paused(self) -> bool:
        return self._gate.mode is not None

    async def abort_samples(self) -> int:
        """Ends the samples in flight (held groups included) with finish_reason "abort"; returns how many of the
        groups in flight were unfinished (held groups' samples are not counted)."""
        aborted = self._unfinished
        self._gate.abort()
        self._end_waits()
        return aborted

    async def reload_weights(self, checkpoint: str | os.PathLike[str], version: int | None = None) -> int:
        new = self.policy_version + 1 if version is None else version
        if new <= self.policy_version:
            raise EngineInputError(f"version: must be newer than the served version {self.policy_version}, "
                                   f"got {new}")
        self.policy_version = new
        return new

    # ---- no weight transfer (the service answers vLLM's transfer routes with 501 over stub engines) ----

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        raise EngineInputError("a stub engine has no weight transfer")

    async def start_weight_update(self) -> None:
        raise EngineInputError("a stub engine has no weight transfer")

    async def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        raise EngineInputError("a stub engine has no weight transfer")

    async def finish_weight_update(self, version: int | None = None, keep: bool = False) -> int:
        raise EngineInputError("a stub engine has no weight transfer")

    async def save_weight_update(self, root: str, version: int) -> str:
        raise EngineInputError("a stub engine has no weight transfer")

    async def abort_weight_update(self) -> None:
        return None

    async def shutdown_weight_transfer(self) -> None:
        return None

    async def add_history(self, rollouts: list[dict[str, Any]]) -> int:
        # the checks walk every token: off the event loop, which an in-process stub shares with the gateway
        await asyncio.to_thread(validate_rollouts, rollouts)
        self.history_records += len(rollouts)
        return len(rollouts)

    async def drafter_stats(self) -> dict[str, Any]:
        return {"history_records": self.history_records}

    async def read_step_parts(self) -> StepPartTotals:
        """No model runner to time: always the empty totals."""
        return StepPartTotals()

    async def close(self) -> None:
        return None
