"""What the service and an engine (vLLM's `Engine`, or the stub engine) agree on beyond the wire types, without
vLLM: the error for a group an engine refuses before scheduling anything, an engine's counters, and the check of
history-format rollouts an engine is handed. The gateway and the coordinator import these from here, so that
neither loads vLLM, torch or the drafter's native index (a forbidden contract in pyproject.toml keeps it so)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from das.drafter.records import RecordError, RolloutRecord
from das.service.wire.api import wire_problem


class EngineConfigError(ValueError):
    """A configuration the engine cannot run on its platform: no restart mends it (the message says what to
    change)."""


class EngineInputError(ValueError):
    """A group the engine refuses before scheduling anything; the message says which field and why."""


@dataclass
class EngineTally:
    """One engine's counters from vLLM's own per-step scheduler stats, summed over its steps. Speculative
    decoding (any method, so peer arms are counted the same way as ours): drafts, verification steps with a draft;
    draft_tokens and accepted_tokens. Prefix caching: prompt_tokens, the prompt tokens of the requests it scheduled,
    of which cached_prompt_tokens were found in the prefix cache (not computed). `running` and `waiting`: the
    scheduler's request queues at its latest step (gauges, not sums). `steps`: the engine's steps (one scheduler
    report each); `busy_s`: the seconds between consecutive reports, gaps over `IDLE_GAP_S` (the engine waiting
    for work) left out, so busy_s / steps is the mean step time as the engine's client sees it."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    running: int = 0
    waiting: int = 0
    steps: int = 0
    busy_s: float = 0.0


IDLE_GAP_S = 1.0  # a gap between two engine steps longer than this is the engine waiting for work, not a step's time
# the parts of a step that add up to its time (service/engine/vllm/step_profile.py); model_s lies inside forward_s and
# budget_s inside propose_s
STEP_PARTS = ("forward_s", "sample_s", "propose_s", "rest_s", "gap_s")


@dataclass(frozen=True)
class StepPartTotals:
    """Seconds summed over an engine's profiled steps by part (STEP_PARTS, model_s and budget_s: step_profile.py),
    and the step count: what `das serve --profile-steps` exports as das_engine_step_part_seconds_total."""

    steps: int = 0
    seconds: tuple[tuple[str, float], ...] = ()

    def add(self, columns: dict[str, list[float]]) -> StepPartTotals:
        """These totals plus the steps of one `RunnerStepTimer.take()`."""
        mine = dict(self.seconds)
        for name in (*STEP_PARTS, "model_s", "budget_s"):
            mine[name] = mine.get(name, 0.0) + float(sum(columns.get(name, ())))
        return StepPartTotals(self.steps + len(columns.get("tokens", ())), tuple(mine.items()))

    def host_ms_per_step(self) -> float | None:
        """Mean host time a step (all parts but the forward pass), ms; None before any step."""
        if not self.steps:
            return None
        parts = dict(self.seconds)
        return (sum(parts.get(p, 0.0) for p in STEP_PARTS) - parts.get("model_s", 0.0)) / self.steps * 1e3


def context_error(prompt_tokens: int, max_tokens: int, max_model_len: int) -> str:
    """The refusal of a group whose prompt and max_tokens together exceed the model's context, in vLLM's server's
    words (its OpenAI routes answer it with 400), naming the limit."""
    return (f"sampling.max_tokens: this model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} in the "
            f"completion). Please reduce the length of the prompt or max_tokens.")


def unstorable(record: RolloutRecord, where: str = "record") -> str | None:
    """Why a valid history record cannot be stored (the format bounds its token ids and reward, not its other
    fields, and a snapshot's msgpack holds no integer beyond int64 and no lone surrogate), or None."""
    return wire_problem({"problem_id": record.problem_id, "policy_version": record.policy_version,
                         "sample_index": record.sample_index, "finish_reason": record.finish_reason}, where)


def validate_rollouts(rollouts: list[dict[str, Any]]) -> list[RolloutRecord]:
    """Checks history-format dicts, and that the history store could hold them; returns them as records, in order.
    EngineInputError names the first bad one by index and field. Pure Python over every token (about 0.1 us a
    token): a large import's caller runs it in a worker thread, where it lets the event loop's thread in between."""
    records = []
    for i, rollout in enumerate(rollouts):
        try:
            record = RolloutRecord.from_dict(rollout)
        except RecordError as exc:
            raise EngineInputError(f"rollout {i}: {exc}") from None
        problem = unstorable(record, f"rollout {i}")
        if problem:
            raise EngineInputError(problem)
        records.append(record)
    return records
