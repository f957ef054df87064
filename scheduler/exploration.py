"""Bounded exploration: draft tokens the budget would not give, spent to keep measuring acceptance.

The length-aware optimum (`das.scheduler.budget`) trusts each request's measured acceptance, and a budget that stops
drafting stops measuring: an estimate that collapsed early (a batch's first drafts all rejected, say) would keep
drafting off for good. So requests whose acceptance rests on too few drafts of their own
(`DrafterParams.unmeasured`) get a draft the plan left them without, verified whatever its estimate: K_max tokens,
so that one measurement covers every draft position the optimum's choice of K turns on.

Exploring is not free where a verified token costs a real share of a step (a compute-bound CPU engine), so
exploration runs on a credit: every step adds `share` of the step's estimated time; a grant costs K_max c_tok, and
a step the plan left plain also the drafted-step price c_spec; unspent credit is capped at `burst` steps' worth (but
always enough for one grant on a plain step, so exploration never stops for good; with refunds, for a grant for
every unmeasured request). An explored token that is accepted did the work of a token decoded plainly, and that
work's price (a plain step of the batch's size over its requests) is refunded (`refund`): the share bounds what
exploration loses on rejected tokens, not how fast it measures requests whose drafts hold. Invariant: exploration
loses at most `share` of the engine's time, a pure loss where drafting cannot win (no sample repeats its text), hence
the small default. The longest-remaining unmeasured requests go first: their acceptance is what the makespan turns
on, and once measured they leave the pool, so the others follow. Only an engine's first 64 measured drafts are
explored unrationed (`EXPLORE_UNRATIONED_DRAFTS`), one token each: a cheap first measurement of the engine's pooled
acceptance. What each of these choices fixed (one-token grants, no refund, a larger share): docs/design "From the
optimum to a step".

Cost per step: O(requests), a few vectorised numpy calls on the batch's arrays; a partial sort only on steps with
credit for some but not all of the unmeasured requests.
"""

from __future__ import annotations

import numpy as np

from das.scheduler.budget import BatchState, DraftPlan
from das.scheduler.cost_model import CostModel

# Share of the engine's estimated time that exploration may spend.
EXPLORE_SHARE = 0.005
# Unspent credit is capped at this many steps' worth of share.
EXPLORE_BURST = 4.0
# Until the engine has verified this many first-position drafts (pooled), exploration is not rationed: with
# nothing measured, the optimum's prior (acceptance 0.5^j) keeps short or cheap samples from ever drafting, and a
# rationed credit would take a whole short batch to buy one token (a tiny model's greedy repeats then drafted nothing).
# Once per engine: ~64 draft tokens.
EXPLORE_UNRATIONED_DRAFTS = 64


class Exploration:
    """The exploration credit of one engine (seconds); `apply` once per planned step."""

    def __init__(self, share: float = EXPLORE_SHARE, burst: float = EXPLORE_BURST) -> None:
        if not (0.0 <= share < 1.0 and burst >= 1.0):
            raise ValueError(f"exploration share must be in [0, 1) and burst >= 1, got {share}, {burst}")
        self.share, self.burst = share, burst
        self.credit_s = 0.0
        self.tokens = 0  # exploration tokens granted so far (a grant the drafter has no match for drafts nothing)

    def apply(self, plan: DraftPlan, batch: BatchState, unmeasured: np.ndarray | None,
              measured_drafts: float = np.inf) -> DraftPlan:
        """`plan` with a draft of K_max tokens (probability floor 0) for as many of the `unmeasured` requests it
        left without drafts as the credit pays for; with one token each for all of them while the engine has
        verified fewer than EXPLORE_UNRATIONED_DRAFTS first-position drafts (`measured_drafts`, pooled: a cheap
        first measurement of the pool). `unmeasured`: one bool per request, or None (nothing to explore)."""
        if unmeasured is None or batch.k_max == 0 or self.share == 0.0:
            return plan
        lengths = plan.lengths
        if measured_drafts < EXPLORE_UNRATIONED_DRAFTS:
            idle = np.asarray(unmeasured, dtype=bool) & (lengths < 1)
            if not idle.any():
                return plan
            self.tokens += int(idle.sum())
            return DraftPlan(np.where(idle, 1, lengths).astype(np.int32), np.where(idle, 0.0, plan.min_prob), idle)
        drafting = bool(lengths.any())
        c_tok = batch.c_tok_s
        entry = 0.0 if drafting else batch.c_spec_s  # a plain step that explores becomes a drafted one
        step_s = batch.c_base_s + c_tok * (len(batch) + float(lengths.sum())) + (batch.c_spec_s if drafting else 0.0)
        idle = np.flatnonzero(np.asarray(unmeasured, dtype=bool) & (lengths < 1))
        # a draft as long as a step allows: it measures every position the optimum's choice turns on at once (one
        # token would measure the first only); charged in full, refunded per accepted token
        grant = c_tok * batch.k_max
        # the share alone never holds more than one grant's price (it is spent as soon as it can pay one); refunds
        # may hold up to a grant for every request waiting to be measured
        cap = max(self.burst * self.share * step_s, entry + grant * max(idle.size, 1))
        self.credit_s = min(self.credit_s + self.share * step_s, cap)
        if not idle.size or self.credit_s < entry + grant:
            return plan
        if grant > 0.0:
            count = min(idle.size, int((self.credit_s - entry) / grant))
            if count < idle.size:  # the longest remaining first
                idle = idle[np.argpartition(-batch.remaining[idle], count - 1)[:count]]
        self.credit_s -= entry + grant * idle.size
        self.tokens += int(idle.size) * batch.k_max
        explored_lengths = lengths.copy()
        explored_lengths[idle] = batch.k_max
        floors = plan.min_prob.copy()
        floors[idle] = 0.0
        explored = np.zeros(len(lengths), dtype=bool)
        explored[idle] = True
        return DraftPlan(explored_lengths.astype(np.int32), floors, explored)

    def refund(self, accepted: int, cost: CostModel, requests: int) -> None:
        """Credits back `accepted` explored tokens accepted in a step of `requests` running requests: each did a
        plainly decoded token's work, priced as a plain step of that size over its requests (the cap applies at
        the next `apply`)."""
        if accepted > 0 and requests > 0:
            self.credit_s += accepted * cost.step_time(requests) / requests
