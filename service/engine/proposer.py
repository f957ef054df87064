"""The DAS drafter as a vLLM speculative method (`method="custom_class"`), without forking vLLM.

vLLM builds one `DasProposer(vllm_config)` per worker and calls `propose(...)` once per decode step, after the
step's tokens are sampled and written into the runner's token table. The proposer does not get request ids from
that call, so `DasWorkerExtension.das_attach()` (service/engine/worker.py) hands it the model runner; until then it
proposes nothing.

Each step, for every request in the batch (row i of the runner's input batch):
  1. a request seen for the first time is registered with the history bank under its problem id (from
     `SamplingParams.extra_args["das"]`, else a hash of the prompt, so samples of one prompt still share);
  2. the tokens committed since the last step (`token_ids_cpu[i, fed:num_tokens_no_spec[i]]`) are scored against
     the request's last draft (accepted = common prefix, at most all but the last committed token, since the
     last one is the bonus or the recovered token, which the rejection sampler never takes from the draft) and
     fed into the live segment of its problem;
  3. the budget hook plans K_i and a probability floor per request from the predicted remaining lengths (the
     request's length curve read at its current length, else its fixed predicted length) and each
     request's measured acceptance by draft position (scheduler/acceptance.py: its own, shrunk towards the
     engine's recent pooled acceptance); K_i is capped so that no draft runs past `max_tokens` or the context,
     the bank proposes at most K_i tokens, and the draft is cut before its first token whose estimated
     probability (that it and every token before it are accepted) is under the floor;
  4. a request the plan gives no draft gets a shadow draft of up to K_max tokens (`HistoryBank.shadow`), which
     vLLM never sees: the tokens it commits over the next steps settle it, and its outcome is recorded with the
     verified drafts' (step 2), so acceptance is measured where the budget drafts nothing, at no cost to the
     engine. One at a time per request, and the next only `DrafterConfig.shadow_gap` tokens after one settles.
Drafts are plain token ids inside the vocabulary, never padded: vLLM's CPU rejection kernel has no guard for
the `-1` placeholder.

Cost per step: O(batch) Python bookkeeping (including a binary search of each request's length curve, a few
hundred steps at most, ~0.5 us; a new request's curve is decoded and checked once, ~70 us at 321 steps) plus, per
request, one native `choose` over its sources (O(max_depth) per source for the match, O(K) for the walk; for a
request without a draft, only on steps that start a shadow draft) and O(max_depth) per committed token in the live
segment. Measured per step in `stats()["step_us"]`.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from das.drafter.history import DrafterConfig, HistoryBank, ShadowOutcome
from das.scheduler.acceptance import AcceptanceCounts
from das.scheduler.budget import DraftPlan
from das.scheduler.length import LengthCurve
from das.service.engine.budget_hook import BudgetHook, RequestView, StepSample, budget_hook_from_config

log = logging.getLogger(__name__)

EXTRA_ARGS_KEY = "das"
"""`SamplingParams.extra_args[EXTRA_ARGS_KEY]` carries a request's `RequestTags` as a dict."""

_MAX_UNCLAIMED = 65536
_STATS_WINDOW = 10000  # decode steps the cost figures of stats() cover
IDLE_GAP_S = 1.0  # a gap between two proposals longer than this is the engine idle between batches, not a step

CONFIG_KEY = "das"
"""`VllmConfig.additional_config[CONFIG_KEY]` carries `{"drafter": {...DrafterConfig}, "budget": {...}}`."""


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
    draft: False for a probe that must decode plainly (the cost warm-up, service/engine/cost_warmup.py): nothing
    is drafted for it, so it moves no draft count, while its steps are timed like any other.
    cost_probe: a warm-up probe whose steps also time drafted steps: on every other step the first such request of
    the batch verifies one junk draft token (its last token again), so the online cost fit sees a drafted step's
    price at every batch size of the warm-up. Those drafts feed no acceptance estimate, draft count or guard.
    """

    problem_id: str
    key: str | None = None
    sample_index: int = 0
    predicted_tokens: float | None = None
    length_curve: LengthCurve | None = None
    draft: bool = True
    cost_probe: bool = False

    def to_extra_args(self) -> dict[str, Any]:
        curve = self.length_curve.to_dict() if self.length_curve is not None else None
        return {EXTRA_ARGS_KEY: {"problem_id": self.problem_id, "key": self.key, "sample_index": self.sample_index,
                                 "predicted_tokens": self.predicted_tokens, "length_curve": curve,
                                 "draft": self.draft, "cost_probe": self.cost_probe}}

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
        return RequestTags(str(raw["problem_id"]), None if key is None else str(key), int(raw.get("sample_index", 0)),
                           None if predicted is None else float(predicted), curve, bool(raw.get("draft", True)),
                           bool(raw.get("cost_probe", False)))


@dataclass
class DraftCounts:
    """Draft tokens one request proposed (that were verified) and had accepted, and the steps it decoded."""

    proposed: int = 0
    accepted: int = 0
    steps: int = 0


@dataclass
class _Running:
    tags: RequestTags
    prompt_len: int
    max_tokens: int
    fed: int                                   # tokens of prompt + output already fed to the bank
    slot: int                                  # its row in the proposer's AcceptanceCounts
    draft: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    draft_source: str = ""                     # source of `draft` (HistoryBank's `Proposal.source`)
    explored: bool = False                     # `draft` is exploration's token (`DraftPlan.explored`)
    counts: DraftCounts = field(default_factory=DraftCounts)


class DasProposer:
    """vLLM `custom_class` proposer over a `HistoryBank`. One instance per worker; called from the worker's
    thread only (the engine core loop), so no locking."""

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        self.k_max = int(spec.num_speculative_tokens)
        self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        extra = (vllm_config.additional_config or {}).get(CONFIG_KEY, {})
        self.bank = HistoryBank(DrafterConfig(**extra.get("drafter", {})))
        self._context = self.bank.config.max_depth
        self.budget: BudgetHook = budget_hook_from_config(extra.get("budget", {}), self.k_max)
        self.acceptance = AcceptanceCounts(self.k_max)
        self.policy_version = 0
        self._runner: Any = None
        self._running: dict[str, _Running] = {}
        self._finished: dict[str, DraftCounts] = {}
        # the last _STATS_WINDOW steps only: a server runs for millions of steps
        self._step_us: deque[float] = deque(maxlen=_STATS_WINDOW)
        self._step_batch: deque[int] = deque(maxlen=_STATS_WINDOW)
        self.by_source: dict[str, DraftCounts] = {}  # since start, by source kind (steps unused)
        self.shadow = DraftCounts()  # tokens of the shadow drafts settled since start (steps unused)
        self.shadow_drafts = 0  # shadow drafts settled since start
        self.failures = 0
        self._last_propose: float | None = None
        self._probe_turn = False  # whether this step's cost probe drafts (every other step with probes)

    def attach(self, runner: Any) -> None:
        self._runner = runner

    # ---- vLLM's hooks ----

    def load_model(self, model: Any) -> None:
        """vLLM hands a draft model its weights here; the DAS drafter has none."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None) -> list[list[int]]:
        """One draft (possibly empty) per row of the runner's input batch. Drafts only ever speed decoding up,
        so a drafter failure is logged and the step goes on without drafts instead of killing the engine."""
        if self._runner is None:
            return [[] for _ in sampled_token_ids]
        try:
            return self._propose(num_tokens_no_spec, token_ids_cpu)
        except Exception:
            log.exception("DAS proposer failed; this step runs without drafts")
            self.failures += 1
            return [[] for _ in sampled_token_ids]

    def _propose(self, num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray) -> list[list[int]]:
        runner = self._runner
        t0 = time.perf_counter()
        req_ids = runner.input_batch.req_ids
        self._retire(set(req_ids))
        views: list[RequestView] = []
        rows: list[_Running] = []
        verified: list[tuple[int, int, int]] = []  # (slot, drafted, accepted) of the drafts this step verified
        shadowed: list[tuple[int, int, int]] = []  # (slot, drafted, accepted) of the shadow drafts settled
        prefill = False
        probe_drafted = 0  # the cost warm-up's junk draft tokens verified this step
        explored_accepted = 0  # accepted tokens of exploration's drafts verified this step
        probe_rooms: list[tuple[int, int]] = []  # (row, draft room) of the batch's cost probes
        for i, rid in enumerate(req_ids):
            run = self._running.get(rid)
            if run is None:
                run = self._start(rid, runner.requests[rid])
                prefill = True
            n = int(num_tokens_no_spec[i])
            if n > run.fed:
                drafted = int(run.draft.size)
                accepted, shadow = self._commit(rid, run, token_ids_cpu[i, run.fed:n])
                if shadow is not None:
                    shadowed.append((run.slot, shadow.drafted, shadow.accepted))
                if drafted and run.tags.cost_probe:
                    probe_drafted += drafted
                elif drafted:
                    verified.append((run.slot, drafted, accepted))
                    explored_accepted += accepted if run.explored else 0
                run.fed = n
            generated = n - run.prompt_len
            room = max(0, min(run.max_tokens - generated, self.max_model_len - n) - 1)
            if run.tags.cost_probe:
                probe_rooms.append((i, room))
            views.append(RequestView(generated, run.tags.predicted_tokens, run.max_tokens,
                                     room if run.tags.draft else 0, run.tags.length_curve))
            rows.append(run)
        drafted, accepted = self._record(verified)
        if shadowed:  # a request settles at most one shadow draft a step: distinct slots
            shadow_drafted, shadow_accepted = self._record(shadowed)
            self.shadow.proposed += shadow_drafted
            self.shadow.accepted += shadow_accepted
            self.shadow_drafts += len(shadowed)
        self._observe_step(t0, prefill, len(rows), drafted + probe_drafted, accepted, probe_drafted > 0,
                           explored_accepted)
        if views:
            slots = np.fromiter((run.slot for run in rows), np.int64, len(rows))
            plan = self.budget.plan(views, self.acceptance.params(slots))
        else:
            plan = DraftPlan(np.zeros(0, np.int32), np.zeros(0))
        drafts: list[list[int]] = []
        for i, (rid, run, view) in enumerate(zip(req_ids, rows, views)):
            k = min(int(plan.lengths[i]), view.room, self.k_max)
            # the index matches at most max_depth tokens of context: copy no more than that
            context = token_ids_cpu[i, max(0, run.fed - self._context):run.fed]
            run.draft, run.draft_source = self._draft(rid, context, k, float(plan.min_prob[i]))
            if k == 0 and view.room:  # room is 0 for requests tagged not to draft (the warm-up's probes)
                self.bank.shadow(rid, context, min(view.room, self.k_max))
            run.explored = plan.explored is not None and bool(plan.explored[i])
            drafts.append(run.draft.tolist())
        if probe_rooms:
            self._probe_draft(rows, probe_rooms, token_ids_cpu, drafts)
        self._step_us.append((time.perf_counter() - t0) * 1e6)
        self._step_batch.append(len(req_ids))
        return drafts

    def _record(self, outcomes: list[tuple[int, int, int]]) -> tuple[int, int]:
        """Records (slot, drafted, accepted) outcomes of distinct requests in the acceptance counts; returns the
        draft tokens and accepted tokens they sum to."""
        if not outcomes:
            return 0, 0
        slots, drafted, accepted = (np.array(col, np.int64) for col in zip(*outcomes))
        self.acceptance.record(slots, drafted, accepted)
        return int(drafted.sum()), int(accepted.sum())

    def _probe_draft(self, rows: list[_Running], probe_rooms: list[tuple[int, int]], token_ids_cpu: np.ndarray,
                     drafts: list[list[int]]) -> None:
        """On every other step with a cost probe in the batch, the first probe with room for a draft token
        drafts its last token again (`RequestTags.cost_probe`): one drafted step per plain one at each batch size
        of the warm-up. `probe_rooms`: (row, draft room) of the batch's probes."""
        self._probe_turn = not self._probe_turn
        for i, room in probe_rooms if self._probe_turn else ():
            if room >= 1:
                run = rows[i]
                run.draft, run.draft_source = token_ids_cpu[i, run.fed - 1:run.fed].astype(np.int32), ""
                drafts[i] = run.draft.tolist()
                return

    def _observe_step(self, now: float, prefill: bool, requests: int, drafted: int, accepted: int,
                      probe: bool = False, explored_accepted: int = 0) -> None:
        """Hands the budget the step that just ran (`drafted` draft tokens verified in it, `accepted` of them,
        `explored_accepted` of those from exploration's drafts; `probe`: cost-probe drafts among them): from the
        previous proposal to this one is one whole engine step. A step with a prefill in it (a request seen for the
        first time) or after an idle gap is not a decode step of this shape and is skipped (with the exploration
        refund it carried: a few tokens a batch)."""
        last, self._last_propose = self._last_propose, now
        if last is None or prefill or not requests or now - last > IDLE_GAP_S:
            return
        self.budget.observe(StepSample(now - last, requests + drafted, requests, drafted, accepted, probe,
                                       explored_accepted))

    # ---- worker-extension API ----

    def set_policy_version(self, version: int) -> None:
        """Seals every live segment older than `version`; new requests feed `version`, and so do the requests
        still running (held by a pause across a weight update): the rest of their output feeds the new version's
        live segment, what came before stays sealed with the old one."""
        if version < self.policy_version:
            raise ValueError(f"policy version {version} is older than the current {self.policy_version}")
        changed = version != self.policy_version
        if version > 0:
            self.bank.seal(version - 1)
        self.policy_version = version
        if not changed or self._runner is None:
            return
        for rid, run in self._running.items():
            # Sealing dropped the request from the bank: registered again, it feeds the new live segment.
            self.bank.finish_request(rid)
            state = self._runner.requests.get(rid)
            if state is not None:  # else it finished and leaves at the next step
                prompt = np.asarray(state.prompt_token_ids or [], np.int32)
                self.bank.start_request(rid, run.tags.problem_id, prompt, version)
            run.draft, run.draft_source = np.zeros(0, np.int32), ""  # dropped by the preemption, never verified

    def pop_counts(self, keys: list[str]) -> dict[str, DraftCounts]:
        """Draft counts of finished requests by their tag key (forgotten once returned). A request still
        registered is finished here: the engine asks only after vLLM reported it finished."""
        wanted = set(keys)
        for rid in [rid for rid, run in self._running.items() if self._key(rid, run) in wanted]:
            self._finish(rid)
        return {key: self._finished.pop(key) for key in keys if key in self._finished}

    def stats(self) -> dict[str, Any]:
        """Per-step proposer cost (microseconds, wall) and mean batch over the last _STATS_WINDOW steps, and the
        history size."""
        us = np.asarray(self._step_us, np.float64)
        return {
            "steps": int(us.size),
            "step_us_p50": float(np.percentile(us, 50)) if us.size else 0.0,
            "step_us_p99": float(np.percentile(us, 99)) if us.size else 0.0,
            "mean_batch": float(np.mean(self._step_batch)) if self._step_batch else 0.0,
            "failures": self.failures,
            "stored_tokens": self.bank.stored_tokens(),
            "memory_bytes": self.bank.memory_bytes(),
            "by_source": {kind: {"proposed": c.proposed, "accepted": c.accepted}
                          for kind, c in sorted(self.by_source.items())},
            "shadow": {"drafts": self.shadow_drafts, "proposed": self.shadow.proposed,
                       "accepted": self.shadow.accepted},
            "cost": self.budget.stats(),
        }

    # ---- internals ----

    def _start(self, rid: str, state: Any) -> _Running:
        prompt = list(state.prompt_token_ids or [])
        params = state.sampling_params
        tags = RequestTags.from_extra_args(getattr(params, "extra_args", None), prompt)
        self.bank.start_request(rid, tags.problem_id, np.asarray(prompt, np.int32), self.policy_version)
        max_tokens = int(params.max_tokens) if params is not None and params.max_tokens else self.max_model_len
        run = _Running(tags, len(prompt), max_tokens, fed=len(prompt), slot=self.acceptance.start(rid))
        self._running[rid] = run
        return run

    def _commit(self, rid: str, run: _Running, tokens: np.ndarray) -> tuple[int, ShadowOutcome | None]:
        """Feeds the committed tokens; returns how many of the last draft's tokens were accepted (0 if none) and
        the outcome of the request's shadow draft where these tokens settled it."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        accepted = 0
        if run.draft.size and not run.tags.cost_probe:
            m = min(run.draft.size, tokens.size - 1)
            same = run.draft[:m] == tokens[:m]
            accepted = int(m if same.all() else np.argmin(same))
            run.counts.accepted += accepted
            run.counts.proposed += int(run.draft.size)
            source = self.by_source.setdefault(run.draft_source, DraftCounts())
            source.accepted += accepted
            source.proposed += int(run.draft.size)
        run.counts.steps += 1
        return accepted, self.bank.extend(rid, tokens)

    def _draft(self, rid: str, context: np.ndarray, k: int, min_prob: float) -> tuple[np.ndarray, str]:
        """Up to k draft tokens, cut before the first whose estimated probability is under min_prob, and their
        source: live, prompt, global or sealed-age-<a> (a <= the history window, so a bounded metric label)."""
        if k <= 0:
            return np.zeros(0, np.int32), ""
        proposal = self.bank.propose(rid, np.ascontiguousarray(context, np.int32), k, min_prob)
        tokens = proposal.tokens
        if tokens.size and tokens.max() >= self.vocab_size:
            tokens = tokens[: np.argmax(tokens >= self.vocab_size)]
        return tokens, proposal.source

    def _retire(self, live: set[str]) -> None:
        """Finishes requests that left the runner (finished or aborted), keeping preempted ones."""
        for rid in [r for r in self._running if r not in live and r not in self._runner.requests]:
            self._finish(rid)

    @staticmethod
    def _key(rid: str, run: _Running) -> str:
        return run.tags.key if run.tags.key is not None else rid

    def _finish(self, rid: str) -> None:
        run = self._running.pop(rid)
        self.bank.finish_request(rid)
        self.acceptance.finish(rid)
        self._finished[self._key(rid, run)] = run.counts
        while len(self._finished) > _MAX_UNCLAIMED:  # nobody asked (plain vLLM use): drop the oldest
            self._finished.pop(next(iter(self._finished)))
