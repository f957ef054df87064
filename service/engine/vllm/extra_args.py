"""What `VllmEngine` passes per request, in `SamplingParams.extra_args`, to the code it runs inside vLLM's worker (plain
data: vLLM serializes it to the worker): the service <-> engine-core contract. Free of torch and vLLM, so that the
service's processes that never run an engine (stub engines, the coordinator, a restarted actor) import neither."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from das.scheduler.length import LengthCurve

log = logging.getLogger(__name__)

EXTRA_ARGS_KEY = "das"
"""`SamplingParams.extra_args[EXTRA_ARGS_KEY]` carries a request's `RequestTags` as a dict."""

SAMPLE_KEY = "das_sample_key"
"""The sample's key (an int64) under keyed sampling (keyed_sampler.py); absent: the request samples unkeyed."""

POSITION_OFFSET = "das_position_offset"
"""Tokens of the sample generated before this request (an int; absent: 0): a sample resumed after its engine died
runs as prompt + the tokens it had delivered, and its keyed positions (keyed_sampler.py) count those tokens, so it
draws what the undisturbed sample would have."""


@dataclass(frozen=True)
class RequestTags:
    """What the service tells the proposer about one sample (travels in SamplingParams.extra_args["das"]).

    problem_id: the history the sample reads and feeds (siblings share it).
    key: the caller's id for the sample; draft counts are returned under it (vLLM renames requests inside the
        engine core, so its own ids are not the caller's).
    sample_index: index of the sample in its group (for records only).
    predicted_tokens: the scheduler's predicted total output length (tokens), or None when unknown;
    length_curve: the same forecast as a function of the tokens generated so far, or None. The budget hook uses
    the curve where there is one, else predicted_tokens, to tell long samples from short ones.
    draft: False for a probe that must decode plainly (the cost warm-up, service/engine/vllm/cost_warmup.py): nothing
    is drafted for it, so it moves no draft count, while its steps are timed like any other.
    cost_probe: a warm-up probe whose steps also time drafted steps: on every other step the first such request of
    the batch verifies one junk draft token (its last token again), so the online cost fit sees a drafted step's
    price at every batch size of the warm-up. Those drafts feed no acceptance estimate, draft count or guard.
    resumed_tokens: the last tokens of the request's prompt that are the sample's own output, delivered before its
    engine died (a resumed sample): they count as generated (length forecast, max_tokens) and feed the live
    segment at its first step, so the drafter's state is what it would have been without the death.
    session_id: the agent session the sample is a turn of: the drafter indexes its prompt as the session's
    context, turn by turn (drafter/history.py `SessionContext`), or None.
    oracle: the sample's whole recorded output (token ids) for the oracle benchmark arm (drafter/oracle.py): its
    drafts are this continuation's next tokens instead of the history bank's; None (always, outside that
    benchmark): the bank drafts.
    """

    problem_id: str
    key: str | None = None
    sample_index: int = 0
    predicted_tokens: float | None = None
    length_curve: LengthCurve | None = None
    draft: bool = True
    cost_probe: bool = False
    resumed_tokens: int = 0
    session_id: str | None = None
    oracle: tuple[int, ...] | None = None

    def to_extra_args(self) -> dict[str, Any]:
        curve = self.length_curve.to_dict() if self.length_curve is not None else None
        oracle = {"oracle": list(self.oracle)} if self.oracle is not None else {}
        return {EXTRA_ARGS_KEY: {**oracle,
                                 "problem_id": self.problem_id, "key": self.key, "sample_index": self.sample_index,
                                 "predicted_tokens": self.predicted_tokens, "length_curve": curve,
                                 "draft": self.draft, "cost_probe": self.cost_probe,
                                 "resumed_tokens": self.resumed_tokens,
                                 "session_id": self.session_id}}

    @staticmethod
    def from_extra_args(extra_args: dict[str, Any] | None, prompt: list[int]) -> RequestTags:
        raw = (extra_args or {}).get(EXTRA_ARGS_KEY)
        if not isinstance(raw, dict) or not raw.get("problem_id"):
            digest = hashlib.blake2b(np.asarray(prompt, np.int64).tobytes(), digest_size=8).hexdigest()
            return RequestTags(problem_id=f"prompt-{digest}")
        predicted = raw.get("predicted_tokens")
        key = raw.get("key")
        curve = None
        if raw.get("length_curve") is not None:
            try:
                curve = LengthCurve.from_dict(raw["length_curve"])
            except ValueError as exc:  # the sample still runs; only its budget falls back to predicted_tokens
                log.warning("request of problem %s: length curve ignored: %s", raw["problem_id"], exc)
        session = raw.get("session_id")
        oracle = raw.get("oracle")
        return RequestTags(str(raw["problem_id"]), None if key is None else str(key), int(raw.get("sample_index", 0)),
                           None if predicted is None else float(predicted), curve, bool(raw.get("draft", True)),
                           bool(raw.get("cost_probe", False)), int(raw.get("resumed_tokens", 0)),
                           None if session is None else str(session),
                           None if oracle is None else tuple(int(t) for t in oracle))
