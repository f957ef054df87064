"""`das bench agent`: a multi-turn code-repair agent as the workload, per speculation arm.

The agent (one trajectory per bundled code task, all running at once): the model writes the function; a tool runs
the task's tests in a fresh interpreter with a timeout (the client's code checks) and, if they fail, the failures
go back to the model as the next user turn; up to `turns` turns; reward 1 when the tests pass. Every turn is a
session turn on `/v1/completions`: the whole context as token ids (`session_id`, `problem_id`, `return_token_ids`
in the body), extended by exactly the tokens returned and the tool turn's tokens, so nothing is re-tokenized and
the engine holding the session's prefix prefills only the new tokens.

Arms: a fresh `das serve --speculation ARM` each (`user_run.ServeProcess`), epochs run back to back on
it, so epoch e+1 drafts from epoch e's trajectories. Turn k of task i in epoch e has the seed
derive(derive(derive(seed, e), i), k) in every arm: under keyed sampling in float32 (`--serve-args "--dtype
float32"`) the arms produce identical trajectories (checked: `trajectories_identical`) and differ in speed alone;
in bfloat16 only in distribution. Per arm and epoch: makespan (first turn sent to last trajectory ended),
output tokens/s, the prefix-cache hit rate of the prompt tokens (from /metrics), turns, rewards, and draft tokens
proposed and accepted by source (from /metrics: `das_source_*` for our drafter; vLLM's own drafters report no
source).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
from rich.console import Console
from rich.table import Table

from das.bench.user_run import ServeProcess, UserRunConfig
from das.service.client.code_checks import CodeCheck, check_code
from das.service.client.code_tasks import CODE_SYSTEM_PROMPT, CODE_TASKS
from das.service.wire.sample_keys import derive


@dataclass(frozen=True)
class AgentBenchConfig:
    """One benchmark. `arms`: `das serve --speculation` values; `tasks`: the first N bundled code tasks (one
    trajectory each per epoch); `turns`: the most model turns of a trajectory; `max_tokens`: per turn;
    `tool_timeout_s`: wall-clock limit of one test run; `serve_args`: more `das serve` flags for every arm."""

    arms: tuple[str, ...] = ("none", "das", "suffix")
    model: str = "smollm2"
    tasks: int = 12
    epochs: int = 3
    turns: int = 4
    max_tokens: int = 512
    temperature: float = 0.7
    seed: int = 0
    port: int = 8124
    serve_args: tuple[str, ...] = ()
    tool_timeout_s: float = 10.0
    ready_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if not self.arms:
            raise ValueError("at least one arm is needed")
        if not 1 <= self.tasks <= len(CODE_TASKS):
            raise ValueError(f"tasks must be 1..{len(CODE_TASKS)}, got {self.tasks}")
        if self.epochs < 1 or self.turns < 1 or self.max_tokens < 1:
            raise ValueError("epochs, turns and max_tokens must be at least 1")


@dataclass(frozen=True)
class TurnOutput:
    """One model turn: the prompt the server saw and exactly the tokens to append."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str


class AgentModel(Protocol):
    """The served model as the agent sees it (one session turn)."""

    async def turn(self, context: list[int], session_id: str, problem_id: str, seed: int,
                   max_tokens: int) -> TurnOutput: ...


class ChatRenderer(Protocol):
    """Token ids of the conversation's pieces, in the served model's chat format."""

    def first(self, system: str, user: str) -> list[int]: ...

    def tool_turn(self, reply_token_ids: list[int], feedback: str) -> list[int]: ...


Checker = Callable[[str, str], Awaitable[CodeCheck]]


@dataclass
class Trajectory:
    """One task's trajectory in one epoch. `tokens`: the whole context at its end (prompt, replies, tool turns);
    `output_tokens`: model tokens over all turns; `duration_s`: its first turn's start to its end."""

    task: str
    turns: int = 0
    output_tokens: int = 0
    reward: float = 0.0
    duration_s: float = 0.0
    tokens: list[int] = field(default_factory=list)


async def run_trajectory(model: AgentModel, renderer: ChatRenderer, check: Checker, task_index: int,
                         epoch: int, config: AgentBenchConfig) -> Trajectory:
    """The code-repair loop for task `task_index` in `epoch` (see the module docstring)."""
    name, signature = CODE_TASKS[task_index]
    trajectory = Trajectory(name)
    context = renderer.first(CODE_SYSTEM_PROMPT, signature)
    session_id = f"agent-e{epoch}-{name}"
    epoch_seed = derive(derive(config.seed, epoch), task_index)
    started = time.monotonic()
    for turn in range(config.turns):
        out = await model.turn(context, session_id, f"code/{name}", derive(epoch_seed, turn), config.max_tokens)
        trajectory.turns += 1
        trajectory.output_tokens += len(out.token_ids)
        context = [*out.prompt_token_ids, *out.token_ids]
        result = await check(name, out.text)
        if result.passed:
            trajectory.reward = 1.0
            break
        if turn + 1 < config.turns:
            context = [*context, *renderer.tool_turn(out.token_ids, result.feedback)]
    trajectory.duration_s = time.monotonic() - started
    trajectory.tokens = context
    return trajectory


@dataclass(frozen=True)
class ServerCounters:
    """Cumulative /metrics counters (summed over engines): prompt tokens, of them prefix-cache hits, and draft
    tokens proposed / accepted per source (our drafter's); the engines' steps, their seconds, and the draft tokens
    they verified / accepted (vLLM's counts, for any speculative method)."""

    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0
    proposed: dict[str, float] = field(default_factory=dict)
    accepted: dict[str, float] = field(default_factory=dict)
    steps: float = 0.0
    busy_s: float = 0.0
    verified: float = 0.0
    verified_accepted: float = 0.0
    step_cost: dict[str, float] = field(default_factory=dict)  # the first engine's live cost fit (gauges)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$", re.MULTILINE)
_SOURCE = re.compile(r'source="([^"]+)"')
_ENGINE_TOTALS = {f"das_engine_{metric}_total": name for metric, name in (
    ("prompt_tokens", "prompt_tokens"), ("prompt_tokens_cached", "cached_tokens"), ("steps", "steps"),
    ("busy_seconds", "busy_s"), ("draft_tokens", "verified"), ("draft_tokens_accepted", "verified_accepted"))}
_COST_GAUGES = {"das_engine_step_base_seconds": "c_base_s", "das_engine_step_token_seconds": "c_tok_s",
                "das_engine_step_spec_seconds": "c_spec_s", "das_engine_step_spec_request_seconds": "c_spec_req_s",
                "das_engine_guard_price_ratio": "guard_price"}


def parse_counters(text: str) -> ServerCounters:
    """The counters of a /metrics text (Prometheus exposition)."""
    engine = dict.fromkeys(_ENGINE_TOTALS.values(), 0.0)
    proposed: dict[str, float] = {}
    accepted: dict[str, float] = {}
    step_cost: dict[str, float] = {}
    for name, labels, value in _SAMPLE.findall(text):
        if name in _ENGINE_TOTALS:
            engine[_ENGINE_TOTALS[name]] += float(value)
        elif name in _COST_GAUGES:
            step_cost.setdefault(_COST_GAUGES[name], float(value))
        elif name in ("das_source_draft_tokens_proposed_total", "das_source_draft_tokens_accepted_total"):
            match = _SOURCE.search(labels or "")
            source = match.group(1) if match else "all"
            into = proposed if "proposed" in name else accepted
            into[source] = into.get(source, 0.0) + float(value)
    return ServerCounters(proposed=proposed, accepted=accepted, step_cost=step_cost, **engine)


@dataclass(frozen=True)
class AgentEpoch:
    """One epoch of one arm. `prefix_hit_rate`: prefix-cache hits over the prompt tokens the engines saw in the
    epoch (0 when none were counted); `proposed` / `accepted`: draft tokens by source in the epoch."""

    epoch: int
    makespan_s: float
    output_tokens: int
    turns: int
    trajectories: int
    solved: int
    prefix_hit_rate: float
    proposed: dict[str, float]
    accepted: dict[str, float]
    steps: float = 0.0
    busy_s: float = 0.0
    verified: float = 0.0
    verified_accepted: float = 0.0
    step_cost: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def step_ms(self) -> float:
        """Mean engine step, milliseconds."""
        return 1e3 * self.busy_s / self.steps if self.steps else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Output tokens per engine step (all running requests together)."""
        return self.output_tokens / self.steps if self.steps else 0.0


def epoch_figures(epoch: int, trajectories: Sequence[Trajectory], makespan_s: float, before: ServerCounters,
                  after: ServerCounters) -> AgentEpoch:
    """An epoch's figures from its trajectories and the server's counters around it."""
    prompt = after.prompt_tokens - before.prompt_tokens
    sources = sorted(set(after.proposed) | set(after.accepted))
    return AgentEpoch(
        epoch=epoch, makespan_s=makespan_s, output_tokens=sum(t.output_tokens for t in trajectories),
        turns=sum(t.turns for t in trajectories), trajectories=len(trajectories),
        solved=sum(1 for t in trajectories if t.reward > 0),
        prefix_hit_rate=(after.cached_tokens - before.cached_tokens) / prompt if prompt > 0 else 0.0,
        proposed={s: after.proposed.get(s, 0.0) - before.proposed.get(s, 0.0) for s in sources},
        accepted={s: after.accepted.get(s, 0.0) - before.accepted.get(s, 0.0) for s in sources},
        steps=after.steps - before.steps, busy_s=after.busy_s - before.busy_s,
        verified=after.verified - before.verified,
        verified_accepted=after.verified_accepted - before.verified_accepted, step_cost=after.step_cost)


async def settled_counters(counters: Callable[[], Awaitable[ServerCounters]], before: ServerCounters,
                           quiet_s: float = 3.0, limit_s: float = 20.0) -> ServerCounters:
    """The counters once they hold the epoch's work: /metrics refreshes engine figures every couple of seconds
    (the coordinator's stats interval, 2 s by default), so wait until they moved past `before` and then stayed
    unchanged for `quiet_s` (the engines are idle between epochs), at most `limit_s`."""
    deadline = time.monotonic() + limit_s
    after = await counters()
    stable_since = time.monotonic()
    while time.monotonic() < deadline:
        if after.steps > before.steps and time.monotonic() - stable_since >= quiet_s:
            break
        await asyncio.sleep(0.5)
        latest = await counters()
        if latest != after:
            after, stable_since = latest, time.monotonic()
    return after


async def run_epochs(model: AgentModel, renderer: ChatRenderer, check: Checker,
                     counters: Callable[[], Awaitable[ServerCounters]], config: AgentBenchConfig,
                     progress: Callable[[str], None], quiet_s: float = 3.0,
                     ) -> tuple[list[AgentEpoch], list[list[Trajectory]]]:
    """Every epoch: all tasks' trajectories at once; figures per epoch, and the trajectories themselves. The
    counters are read once they held still for `quiet_s` after the epoch (`settled_counters`)."""
    epochs: list[AgentEpoch] = []
    runs: list[list[Trajectory]] = []
    for epoch in range(config.epochs):
        before = await counters()
        started = time.monotonic()
        pending = [asyncio.ensure_future(run_trajectory(model, renderer, check, i, epoch, config))
                   for i in range(config.tasks)]
        done: list[Trajectory] = []
        for finished in asyncio.as_completed(pending):
            done.append(await finished)
            progress(f"epoch {epoch + 1}/{config.epochs}: {len(done)}/{config.tasks} trajectories done")
        makespan = time.monotonic() - started
        after = await settled_counters(counters, before, quiet_s)
        order = {name: i for i, (name, _) in enumerate(CODE_TASKS)}
        done.sort(key=lambda t: order[t.task])
        epochs.append(epoch_figures(epoch + 1, done, makespan, before, after))
        runs.append(done)
    return epochs, runs


class OpenAIAgentModel:
    """`AgentModel` on `/v1/completions` through the official `openai` client (the README's session example)."""

    def __init__(self, base_url: str, temperature: float, api_key: str = "none", timeout_s: float = 600.0) -> None:
        import openai

        self._client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0,
                                          timeout=timeout_s)
        self._temperature = temperature

    async def turn(self, context: list[int], session_id: str, problem_id: str, seed: int,
                   max_tokens: int) -> TurnOutput:
        reply = await self._client.completions.create(
            model="das", prompt=context, max_tokens=max_tokens, temperature=self._temperature, seed=seed,
            extra_body={"session_id": session_id, "problem_id": problem_id, "return_token_ids": True})
        choice = reply.choices[0]
        extra = choice.model_extra or {}
        return TurnOutput(list(extra["prompt_token_ids"]), list(extra["token_ids"]), choice.text)

    async def close(self) -> None:
        await self._client.close()


class TemplateRenderer:
    """`ChatRenderer` from a Hugging Face tokenizer's chat template. A tool turn is the text the template puts
    after an assistant message and before the next generation (end of turn, the user turn, the assistant header),
    tokenized alone; the end-of-turn token is left out when the reply already ends with it."""

    _MARK = "\x00reply\x00"

    def __init__(self, model_path: Path) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(model_path)

    def first(self, system: str, user: str) -> list[int]:
        return list(self._tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": user}],
            add_generation_prompt=True, tokenize=True, return_dict=False))

    def tool_turn(self, reply_token_ids: list[int], feedback: str) -> list[int]:
        text = self._tokenizer.apply_chat_template(
            [{"role": "assistant", "content": self._MARK},
             {"role": "user", "content": f"The tests failed:\n{feedback}\nFix the function; reply with the whole "
                                         "function in one Python code block."}],
            add_generation_prompt=True, tokenize=False)
        tail = text.split(self._MARK, 1)[1]
        end = self._tokenizer.eos_token or ""
        if reply_token_ids and reply_token_ids[-1] == self._tokenizer.eos_token_id and tail.startswith(end):
            tail = tail[len(end):]
        return list(self._tokenizer.encode(tail, add_special_tokens=False))


async def _server_counters(client: httpx.AsyncClient, url: str) -> ServerCounters:
    response = await client.get(f"{url}/metrics")
    response.raise_for_status()
    return parse_counters(response.text)


@dataclass
class AgentBenchResult:
    config: AgentBenchConfig
    epochs: dict[str, list[AgentEpoch]] = field(default_factory=dict)  # arm -> epochs
    trajectories_identical: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"config": asdict(self.config), "trajectories_identical": self.trajectories_identical,
                "arms": {arm: [asdict(e) | {"tokens_per_s": e.tokens_per_s, "step_ms": e.step_ms,
                                            "tokens_per_step": e.tokens_per_step} for e in epochs]
                         for arm, epochs in self.epochs.items()},
                "ratios": {arm: self.ratios(arm) for arm in self.epochs}}

    def ratios(self, arm: str) -> list[dict[str, float]]:
        """Per epoch, `arm`'s makespan and tokens/s over the first arm's."""
        base = self.epochs[self.config.arms[0]]
        return [{"makespan": m.makespan_s / b.makespan_s if b.makespan_s else 0.0,
                 "tokens_per_s": m.tokens_per_s / b.tokens_per_s if b.tokens_per_s else 0.0}
                for m, b in zip(self.epochs[arm], base)]

    def print(self, console: Console) -> None:
        c = self.config
        table = Table(title=f"code-repair agent: {c.tasks} tasks x up to {c.turns} turns, {c.max_tokens} tokens "
                            f"a turn, T={c.temperature}, {c.model}; ratios to {c.arms[0]}; trajectories identical "
                            f"across arms: {self.trajectories_identical}")
        for column in ("arm", "epoch", "makespan s", "tokens/s", "makespan ratio", "tokens/s ratio",
                       "prefix hits", "turns", "solved", "steps", "ms/step", "tokens/step",
                       "verified: accepted/drafts", "ours by source: accepted/proposed"):
            table.add_column(column, justify="right")
        for arm, epochs in self.epochs.items():
            for e, r in zip(epochs, self.ratios(arm)):
                sources = ", ".join(f"{s} {e.accepted.get(s, 0):.0f}/{e.proposed.get(s, 0):.0f}"
                                    for s in sorted(e.proposed)) or "-"
                table.add_row(arm, str(e.epoch), f"{e.makespan_s:.1f}", f"{e.tokens_per_s:.1f}",
                              f"{r['makespan']:.3f}", f"{r['tokens_per_s']:.3f}", f"{e.prefix_hit_rate:.1%}",
                              str(e.turns), f"{e.solved}/{e.trajectories}", f"{e.steps:.0f}", f"{e.step_ms:.1f}",
                              f"{e.tokens_per_step:.2f}", f"{e.verified_accepted:.0f}/{e.verified:.0f}", sources)
        console.print(table)


def same_trajectories(runs: dict[str, list[list[Trajectory]]]) -> bool:
    """Whether every arm produced the same token ids in every trajectory of every epoch."""
    tokens = [[[t.tokens for t in epoch] for epoch in arm_runs] for arm_runs in runs.values()]
    return all(t == tokens[0] for t in tokens[1:])


def run_agent_bench(config: AgentBenchConfig, model_path: Path, log_dir: Path,
                    progress: Callable[[str], None]) -> AgentBenchResult:
    """Each arm on a fresh `das serve --model MODEL --speculation ARM`, the epochs back to back on it."""
    renderer = TemplateRenderer(model_path)
    result = AgentBenchResult(config)
    runs: dict[str, list[list[Trajectory]]] = {}
    serve = UserRunConfig(port=config.port, serve_args=("--model", config.model, *config.serve_args))
    log_dir.mkdir(parents=True, exist_ok=True)

    async def one_arm(url: str) -> tuple[list[AgentEpoch], list[list[Trajectory]]]:
        model = OpenAIAgentModel(url, config.temperature)
        async with httpx.AsyncClient(timeout=30.0) as http:
            try:
                return await run_epochs(model, renderer,
                                        lambda name, reply: check_code(name, reply, config.tool_timeout_s),
                                        lambda: _server_counters(http, url), config, progress)
            finally:
                await model.close()

    for arm in config.arms:
        progress(f"arm {arm}: starting das serve --speculation {arm}")
        server = ServeProcess(("--speculation", arm), serve, log_dir / f"agent-serve-{arm}.log")
        try:
            server.wait_ready(config.ready_timeout_s, progress)
            result.epochs[arm], runs[arm] = asyncio.run(one_arm(server.url))
        finally:
            server.stop()
        progress(f"arm {arm}: makespans " + ", ".join(f"{e.makespan_s:.1f} s" for e in result.epochs[arm]))
    result.trajectories_identical = same_trajectories(runs)
    return result
