"""The DAS drafter as a vLLM speculative method (`method="custom_class"`), without forking vLLM.

vLLM builds one `DasProposer(vllm_config)` per worker and calls `propose(...)` once per decode step, after the
step's tokens are sampled and written into the runner's token table. The proposer does not get request ids from
that call, so `DasWorkerExtension.das_attach()` (service/engine/vllm/worker.py) hands it the model runner; until then it
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
  4. a request the plan gives no draft gets a shadow draft of up to K_max tokens (`HistoryBank.draft_step`), which
     vLLM never sees: the tokens it commits over the next steps settle it, and its outcome is recorded with the
     verified drafts' (step 2), so acceptance is measured where the budget drafts nothing, at no cost to the
     engine. One at a time per request, and the next only `DrafterConfig.shadow_gap` tokens after one settles.
Drafts are plain token ids inside the vocabulary, never padded: vLLM's CPU rejection kernel has no guard for
the `-1` placeholder.

Cost per step: two native calls for the whole batch (`HistoryBank.commit_step`, `draft_step`): O(max_depth) per
committed token in the live segment, and per request with a draft (or starting a shadow draft) one `choose` over its
sources (O(max_depth) per source for the match, O(K) for the walk); around them the budget (scheduler/) and
vectorised gathers from the per-request columns (request_columns.py), length curves included (one `searchsorted`
for the batch); Python work per request only where the batch changed (a request arrived or left: the batch's
slots are looked up again, a new request's curve is decoded and checked once, ~70 us at 321 steps). Measured per
step in `stats()["step_us"]`; its cost at batches of 1-240 is in docs/design.md#not-done-yet
(the proposer's host time).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from das.drafter.config import DrafterConfig
from das.drafter.history import HistoryBank
from das.drafter.oracle import OracleDrafts
from das.scheduler.acceptance import AcceptanceCounts
from das.scheduler.budget_hook import BatchView, BudgetHook, StepSample, budget_hook_from_config
from das.scheduler.draft_step import DraftStep
from das.scheduler.request_columns import RequestColumns
from das.service.engine.vllm.extra_args import SAMPLE_KEY, RequestTags

log = logging.getLogger(__name__)

_MAX_UNCLAIMED = 65536
_STATS_WINDOW = 10000  # decode steps the cost figures of stats() cover
IDLE_GAP_S = 1.0  # a gap between two proposals longer than this is the engine idle between batches, not a step

CONFIG_KEY = "das"
"""`VllmConfig.additional_config[CONFIG_KEY]` carries `{"drafter": {...DrafterConfig fields set}, "budget": {...a budget of scheduler/policies.py}}`
as plain data (validated where the service started: service/engine/config.py `EngineConfig`)."""


@dataclass
class DraftCounts:
    """Draft tokens one request proposed (that were verified) and had accepted, and the steps it decoded."""

    proposed: int = 0
    accepted: int = 0
    steps: int = 0


@dataclass(frozen=True)
class _Running:
    tags: RequestTags
    slot: int  # its row in the proposer's AcceptanceCounts and RequestColumns


class DasProposer:
    """vLLM `custom_class` proposer over a `HistoryBank`. One instance per worker; called from the worker's
    thread only (the engine core loop), so no locking."""

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        self.k_max = int(spec.num_speculative_tokens)
        self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        extra = (vllm_config.additional_config or {}).get(CONFIG_KEY, {})
        self.bank = HistoryBank(DrafterConfig.model_validate(extra.get("drafter", {})).sized_for(self.k_max))
        self.budget: BudgetHook = budget_hook_from_config(extra.get("budget", {}), self.k_max)
        self.acceptance = AcceptanceCounts(self.k_max)
        self.step = DraftStep(self.bank, self.budget, self.acceptance, self.k_max)  # the simulator's step too
        self.policy_version = 0
        self._runner: Any = None
        self._running: dict[str, _Running] = {}
        self._finished: dict[str, DraftCounts] = {}
        # the last _STATS_WINDOW steps only: a server runs for millions of steps
        self._step_us: deque[float] = deque(maxlen=_STATS_WINDOW)
        self._step_batch: deque[int] = deque(maxlen=_STATS_WINDOW)
        kinds = len(self.bank.chooser.kinds)
        self._source_proposed = np.zeros(kinds, np.int64)  # verified draft tokens since start, by source kind
        self._source_accepted = np.zeros(kinds, np.int64)
        self.shadow = DraftCounts()  # tokens of the shadow drafts settled since start (steps unused)
        self.shadow_drafts = 0  # shadow drafts settled since start
        self.failures = 0
        self._last_propose: float | None = None
        # the engine step's clock (seconds), read once a proposal: the cost fit and the guard price steps by it
        self.clock: Callable[[], float] = time.perf_counter
        self._probe_turn = False  # whether this step's cost probe drafts (every other step with probes)
        self._probes = 0  # running cost probes (RequestTags.cost_probe)
        self._columns = RequestColumns()
        self._batch_ids: list[str] | None = None  # the last step's input batch, and its requests' slots
        self._batch_slots = np.zeros(0, np.int64)
        self._oracle = OracleDrafts()  # requests with a recorded continuation (RequestTags.oracle); empty otherwise
        self.oracle_counts = DraftCounts()  # verified oracle draft tokens since start (steps unused)

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
        t0 = time.perf_counter()
        slots, prefill = self._batch()
        n = slots.size
        cols = self._columns
        table = token_ids_cpu[:n]  # row i is the input batch's request i
        ends = np.asarray(num_tokens_no_spec[:n], np.int64)
        starts = cols.fed[slots]
        bank_slots = cols.bank_slot[slots]
        settled = self.step.settle(slots, bank_slots, table, starts, ends, explored=cols.explored[slots])
        oracle_rows = np.flatnonzero(self._oracle.active[slots]) if len(self._oracle) else None
        oracle_drafted = oracle_accepted = oracle_explored = 0
        if oracle_rows is not None and oracle_rows.size:
            oracle_drafted, oracle_accepted, oracle_explored = self._settle_oracle(
                slots[oracle_rows], table[oracle_rows], starts[oracle_rows], ends[oracle_rows])
        advanced = slots[ends > starts]
        cols.fed[slots] = np.maximum(starts, ends)
        cols.steps[advanced] += 1
        probe_drafted = 0  # the cost warm-up's junk draft tokens verified this step
        if self._probes:
            probe_drafted = int(cols.probe_drafted[advanced].sum())
            cols.probe_drafted[advanced] = 0
        commit, verified = settled.commit, settled.verified
        verified_slots = slots[verified]  # distinct, so += on fancy indices counts each once
        cols.proposed[verified_slots] += commit.drafted[verified]
        cols.accepted[verified_slots] += commit.accepted[verified]
        np.add.at(self._source_proposed, commit.source[verified], commit.drafted[verified])
        np.add.at(self._source_accepted, commit.source[verified], commit.accepted[verified])
        self.shadow.proposed += settled.shadow_drafted
        self.shadow.accepted += settled.shadow_accepted
        self.shadow_drafts += settled.shadows
        self._observe_step(self.clock(), prefill, n, settled.drafted + probe_drafted + oracle_drafted,
                           settled.accepted + oracle_accepted, probe_drafted > 0,
                           settled.explored_accepted + oracle_explored)
        if not n:
            self._step_us.append((time.perf_counter() - t0) * 1e6)
            self._step_batch.append(0)
            return []
        generated = ends - cols.prompt_len[slots]
        max_tokens = cols.max_tokens[slots]
        room = np.maximum(0, np.minimum(max_tokens - generated, self.max_model_len - ends) - 1)
        view = BatchView(generated, cols.predicted[slots], max_tokens, cols.curves.at(slots, generated))
        draft_room = np.where(cols.may_draft[slots], room, 0)  # the warm-up's plain probes get no draft
        bank_room = draft_room
        if oracle_rows is not None and oracle_rows.size:
            bank_room = draft_room.copy()
            bank_room[oracle_rows] = 0  # no bank draft (nor shadow) where the oracle drafts
        step_drafts, plan = self.step.draft(slots, bank_slots, view, table, ends, bank_room, self.vocab_size)
        drafts = step_drafts.lists()
        if oracle_rows is not None and oracle_rows.size:
            # the same plan's K_i, capped as the bank's drafts are; an oracle token's probability is 1, so only a
            # floor above 1 (the plan verifying nothing) cuts it
            k = np.minimum(np.minimum(plan.lengths[oracle_rows], draft_room[oracle_rows]), self.k_max)
            k = np.where(np.asarray(plan.min_prob)[oracle_rows] > 1.0, 0, k)
            for row, draft in zip(oracle_rows.tolist(),
                                  self._oracle.draft(slots[oracle_rows], generated[oracle_rows], k)):
                drafts[row] = draft
        cols.explored[slots] = plan.explored if plan.explored is not None else False
        if self._probes:
            self._probe_draft(slots, room, table, drafts)
        self._step_us.append((time.perf_counter() - t0) * 1e6)
        self._step_batch.append(n)
        return drafts

    def _batch(self) -> tuple[np.ndarray, bool]:
        """The slots of the runner's input batch, in its order, and whether a request in it is new (its prompt is
        prefilled in this step). Where the batch changed, requests that left the runner are finished (a preempted
        one that is aborted while out of the batch, at the next change or when its counts are claimed) and new
        ones started; an unchanged batch (most steps) costs one list comparison."""
        req_ids = self._runner.input_batch.req_ids
        if req_ids == self._batch_ids:
            return self._batch_slots, False
        self._retire(set(req_ids))
        runs = [self._running.get(rid) for rid in req_ids]
        prefill = any(run is None for run in runs)
        if prefill:
            runs = [run or self._start(rid, self._runner.requests[rid]) for rid, run in zip(req_ids, runs)]
        self._batch_ids = list(req_ids)
        self._batch_slots = np.fromiter((run.slot for run in runs), np.int64, len(runs))
        return self._batch_slots, prefill

    def _settle_oracle(self, slots: np.ndarray, table: np.ndarray, starts: np.ndarray,
                       ends: np.ndarray) -> tuple[int, int, int]:
        """Scores the oracle drafts of the requests in `slots` (rows of their committed tokens in `table`) as
        `DraftStep.settle` scores the bank's: into the acceptance counts the budget plans from and the requests'
        counts. Returns the draft tokens verified, the accepted ones, and those of them from exploration's drafts."""
        drafted, accepted = self._oracle.settle(slots, table, starts, ends)
        verified = np.flatnonzero(drafted)
        if not verified.size:
            return 0, 0, 0
        cols = self._columns
        done = slots[verified]
        self.acceptance.record(done, drafted[verified], accepted[verified])
        cols.proposed[done] += drafted[verified]
        cols.accepted[done] += accepted[verified]
        total_drafted, total_accepted = int(drafted.sum()), int(accepted.sum())
        self.oracle_counts.proposed += total_drafted
        self.oracle_counts.accepted += total_accepted
        return total_drafted, total_accepted, int(accepted[verified][cols.explored[done]].sum())

    def _probe_draft(self, slots: np.ndarray, room: np.ndarray, table: np.ndarray, drafts: list[list[int]]) -> None:
        """On every other step with a cost probe in the batch, the first probe with room for a draft token
        drafts its last token again (`RequestTags.cost_probe`): one drafted step per plain one at each batch size
        of the warm-up. `slots`, `room`: each row's slot and draft room."""
        self._probe_turn = not self._probe_turn
        if not self._probe_turn:
            return
        cols = self._columns
        rows = np.flatnonzero(cols.cost_probe[slots] & (room >= 1))
        if rows.size:
            i, slot = int(rows[0]), int(slots[rows[0]])
            fed = int(cols.fed[slot])
            drafts[i] = table[i, fed - 1:fed].tolist()
            cols.probe_drafted[slot] = 1

    def _observe_step(self, now: float, prefill: bool, requests: int, drafted: int, accepted: int,
                      probe: bool = False, explored_accepted: int = 0) -> None:
        """Hands the budget the step that just ran (`drafted` draft tokens verified in it, `accepted` of them,
        `explored_accepted` of those from exploration's drafts; `probe`: cost-probe drafts among them): from the
        previous proposal to this one is one whole engine step. A step with a prefill in it (a request seen for the
        first time) or after an idle gap is not a decode step of this shape: the cost fit and the guard skip it,
        exploration still gets its accepted tokens back."""
        last, self._last_propose = self._last_propose, now
        if last is None or prefill or not requests or now - last > IDLE_GAP_S:
            self.budget.refund(explored_accepted, requests)
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
                prompt = np.asarray(state.prompt_token_ids or [], np.int32)[:self._columns.prompt_len[run.slot]]
                # Without its sample key: the rest of its output alone is not the key's sample to keep.
                self._columns.bank_slot[run.slot] = self.bank.start_request(rid, run.tags.problem_id, prompt,
                                                                            version, run.tags.session_id)
            self._columns.probe_drafted[run.slot] = 0  # its draft was dropped by the preemption, never verified

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
            "oracle": {"proposed": self.oracle_counts.proposed, "accepted": self.oracle_counts.accepted},
        }

    @property
    def by_source(self) -> dict[str, DraftCounts]:
        """Verified draft tokens and their accepted ones since start, by source kind: live, prompt, global or
        sealed-age-<a> (a <= the history window, so a bounded metric label); steps unused."""
        kinds = self.bank.chooser.kinds
        return {kinds[i]: DraftCounts(int(self._source_proposed[i]), int(self._source_accepted[i]))
                for i in np.flatnonzero(self._source_proposed)}

    # ---- internals ----

    def _start(self, rid: str, state: Any) -> _Running:
        prompt = list(state.prompt_token_ids or [])
        params = state.sampling_params
        tags = RequestTags.from_extra_args(getattr(params, "extra_args", None), prompt)
        # A resumed sample's delivered tokens end its prompt: the prompt proper is what comes before them, and
        # they are fed to the live segment at the first step (`fed` starts at prompt_len), as its own output.
        resumed = min(max(tags.resumed_tokens, 0), len(prompt) - 1)
        prompt_len = len(prompt) - resumed
        extra = getattr(params, "extra_args", None) or {}
        bank_slot = self.bank.start_request(rid, tags.problem_id, np.asarray(prompt[:prompt_len], np.int32),
                                            self.policy_version, tags.session_id, extra.get(SAMPLE_KEY))
        max_tokens = int(params.max_tokens) if params is not None and params.max_tokens else self.max_model_len
        run = _Running(tags, self.acceptance.start(rid))
        self._columns.start(run.slot, prompt_len=prompt_len, max_tokens=max_tokens + resumed, bank_slot=bank_slot,
                            predicted=tags.predicted_tokens, curve=tags.length_curve, may_draft=tags.draft,
                            cost_probe=tags.cost_probe)
        self._oracle.set(run.slot, tags.oracle)
        self._probes += tags.cost_probe
        self._running[rid] = run
        return run

    def _retire(self, live: set[str]) -> None:
        """Finishes requests that left the runner (finished or aborted), keeping preempted ones."""
        for rid in [r for r in self._running if r not in live and r not in self._runner.requests]:
            self._finish(rid)

    @staticmethod
    def _key(rid: str, run: _Running) -> str:
        return run.tags.key if run.tags.key is not None else rid

    def _finish(self, rid: str) -> None:
        run = self._running.pop(rid)
        self._batch_ids = None  # the slot may be reused: the next step looks its batch up again
        self._probes -= run.tags.cost_probe
        self.bank.finish_request(rid)
        self.acceptance.finish(rid)
        cols = self._columns
        self._finished[self._key(rid, run)] = DraftCounts(int(cols.proposed[run.slot]), int(cols.accepted[run.slot]),
                                                          int(cols.steps[run.slot]))
        cols.curves.clear(run.slot)
        if len(self._oracle):
            self._oracle.clear(run.slot)
        while len(self._finished) > _MAX_UNCLAIMED:  # nobody asked (plain vLLM use): drop the oldest
            self._finished.pop(next(iter(self._finished)))
