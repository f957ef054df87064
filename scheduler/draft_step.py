"""One engine step's drafting, as one piece of code for the engine and for the simulator: the DAS proposer runs it
inside vLLM and `das bench simulate` runs it per simulated engine (`das.scheduler.simulator`), so what the
simulator measures is the engine's own step, not a copy of it.

A step is two calls around the forward pass that verifies the drafts:
  * `settle`: the tokens the requests committed since their last drafts are fed into the history bank, which
    scores those drafts (and any shadow draft they settle); the outcomes go into the acceptance counts;
  * `draft`: the budget hook plans K_i and a probability floor per request from its predicted remaining length and
    its measured acceptance (`BudgetHook.plan`); K_i is capped by the request's draft room and K_max; the bank
    drafts at most K_i tokens per request, and a shadow draft of up to K_max (at most the room) where the plan
    gives none. Where the plan prices the step (`DraftPlan.pays`) and the drafts do not pay its fixed price, the
    step verifies none: the bank drafts again with every K_i = 0 (shadow drafts only; the first candidates are
    still scored for the source chooser), which costs a second draft call on such steps.
The budget hook's `observe` / `refund` are the caller's to call once it knows what the step cost (the engine
times it, the simulator prices it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from das.drafter.history import HistoryBank, StepCommit, StepDrafts
from das.scheduler.acceptance import AcceptanceCounts
from das.scheduler.budget import DraftPlan
from das.scheduler.budget_hook import BatchView, BudgetHook


@dataclass(frozen=True, slots=True)
class Settled:
    """What one step's committed tokens settled: `commit`, the bank's per-row outcome; `verified`, the rows whose
    draft was verified; their draft tokens (`drafted`), the accepted ones (`accepted`) and of those the ones of
    exploration's drafts (`explored_accepted`); `shadows` shadow drafts settled, with `shadow_drafted` tokens of which
    `shadow_accepted` held (tokens)."""

    commit: StepCommit
    verified: np.ndarray
    drafted: int
    accepted: int
    explored_accepted: int
    shadows: int
    shadow_drafted: int
    shadow_accepted: int


class DraftStep:
    """One engine's drafting over `bank`, planned by `budget`, with acceptance measured in `acceptance` (request
    slots are its slots), drafts of at most `k_max` tokens. Holds no state of its own: the three objects do."""

    def __init__(self, bank: HistoryBank, budget: BudgetHook, acceptance: AcceptanceCounts, k_max: int) -> None:
        self.bank = bank
        self.budget = budget
        self.acceptance = acceptance
        self.k_max = k_max

    def settle(self, slots: np.ndarray, bank_slots: np.ndarray, table: np.ndarray, starts: np.ndarray,
               ends: np.ndarray, explored: np.ndarray | None = None, rows: np.ndarray | None = None,
               verified_accepted: np.ndarray | None = None) -> Settled:
        """Request r (acceptance slot slots[r], distinct; bank slot bank_slots[r]) committed
        table[rows[r], starts[r]:ends[r]] since its last draft (rows: None for row r). `explored`: per request,
        whether its last draft was exploration's (None: none was).

        `verified_accepted`: per request, the draft tokens the verifier accepted, where the caller knows them (the
        simulator's verifier); None: the bank's count from the committed tokens, which is all the engine has (vLLM
        reports no per-request count), and which is one short where a draft ran up to the sample's last token
        (the bank takes the last committed token for the verifier's own)."""
        commit = self.bank.commit_step(bank_slots, table, starts, ends, rows=rows)
        verified = np.flatnonzero(commit.drafted)
        accepted_by_row = commit.accepted if verified_accepted is None else verified_accepted
        drafted, accepted = self._record(slots[verified], commit.drafted[verified], accepted_by_row[verified])
        explored_accepted = (int(accepted_by_row[verified][explored[verified]].sum()) if explored is not None
                             else 0)
        shadowed = np.flatnonzero(commit.shadow_drafted)  # at most one a request
        shadow_drafted, shadow_accepted = self._record(slots[shadowed], commit.shadow_drafted[shadowed],
                                                       commit.shadow_accepted[shadowed])
        return Settled(commit, verified, drafted, accepted, explored_accepted, int(shadowed.size), shadow_drafted,
                       shadow_accepted)

    def draft(self, slots: np.ndarray, bank_slots: np.ndarray, view: BatchView, table: np.ndarray,
              ends: np.ndarray, draft_room: np.ndarray, vocab_size: int = 0,
              rows: np.ndarray | None = None) -> tuple[StepDrafts, DraftPlan]:
        """The drafts of request r (as in `settle`), whose text so far is table[rows[r], :ends[r]], with `view` its
        budget view and draft_room[r] >= 0 the most draft tokens it may verify (its room before its output cap or
        the context; 0: no draft, no shadow draft). Drafts are cut before their first token >= vocab_size (0: no
        cut). Returns the drafts and the plan they came from (K_i before the caps)."""
        plan = self.budget.plan(view, self.acceptance.params(slots) if self.budget.reads_acceptance else None)
        k = np.minimum(np.minimum(plan.lengths, draft_room), self.k_max).astype(np.int32)
        shadow_room = np.where(k == 0, np.minimum(draft_room, self.k_max), 0).astype(np.int32)
        floors = np.asarray(plan.min_prob, np.float64)
        drafts = self.bank.draft_step(bank_slots, table, ends, k, floors, shadow_room, vocab_size, rows=rows)
        if plan.pays(drafts.probs, drafts.offsets):
            return drafts, plan
        none = np.zeros_like(k)
        shadow_room = np.minimum(draft_room, self.k_max).astype(np.int32)
        drafts = self.bank.draft_step(bank_slots, table, ends, none, floors, shadow_room, vocab_size, rows=rows)
        return drafts, DraftPlan(none, np.full(len(k), np.inf))

    def _record(self, slots: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> tuple[int, int]:
        """Records the outcomes of distinct requests' drafts (request slots[j] drafted `drafted[j]` tokens, of
        which `accepted[j]` were accepted); returns the draft and accepted tokens they sum to."""
        if not slots.size:
            return 0, 0
        self.acceptance.record(slots, drafted.astype(np.int64), accepted.astype(np.int64))
        return int(drafted.sum()), int(accepted.sum())
