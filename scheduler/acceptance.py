"""Measured draft acceptance, per request and pooled, turned into the budget model's drafter parameters.

Every verification step tells, for each request that carried a draft of d tokens, how many (a) were accepted:
positions 1..d were proposed, positions 1..a accepted. A request the budget gave no draft reports the same for its
shadow drafts (`HistoryBank.shadow`: never verified, settled by the tokens it commits), which
have the outcome distribution of verified ones, so acceptance is measured where nothing is drafted.
`AcceptanceCounts` keeps those counts per draft position for every running request (a slot each) and pooled over
the engine's recent steps; `params` gives each request's per-position acceptance q_ij (`estimate_drafter_params`),
its own counts shrunk towards the pooled per-position acceptance, so a new request starts from what this engine's
drafts have recently achieved rather than from a constant.

Cost: `record` and `params` are O(requests x K_max) per step, a few numpy calls on (requests x K_max) arrays (no
per-request Python work); `start`/`finish` are dict operations per request.
"""

from __future__ import annotations

import numpy as np

from das.scheduler.budget import DrafterParams, estimate_drafter_params

POOL_WINDOW = 4096.0  # pooled counts are halved when more first-position drafts than this were counted
# A request is "unmeasured" (DrafterParams.unmeasured) until this many of its drafts were verified. At most this many
# draft tokens per request, and it keeps every request measuring: a batch's pooled first-position acceptance can
# collapse, and without it every new request would inherit the collapse and draft nothing, so nothing could correct
# it (docs/results "Simulated makespan").
EXPLORE_DRAFTS = 8


class AcceptanceCounts:
    """Per-position proposed / accepted counts by request key, and pooled. k_max: draft positions counted."""

    def __init__(self, k_max: int, pool_window: float = POOL_WINDOW) -> None:
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}")
        self.k_max = k_max
        self._window = pool_window
        self._slots: dict[str, int] = {}
        self._free: list[int] = list(range(15, -1, -1))
        self._proposed = np.zeros((16, k_max))
        self._accepted = np.zeros((16, k_max))
        self.pool_proposed = np.zeros(k_max)
        self.pool_accepted = np.zeros(k_max)
        self._positions = np.arange(k_max)

    def start(self, key: str) -> int:
        """A new request: zero counts (a key already present is reset); returns its slot."""
        slot = self._slots.get(key)
        if slot is None:
            if not self._free:
                self._grow()
            slot = self._free.pop()
            self._slots[key] = slot
        self._proposed[slot] = 0.0
        self._accepted[slot] = 0.0
        return slot

    def finish(self, key: str) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def slots(self, keys: list[str]) -> np.ndarray:
        """Slot indices of started keys (KeyError for one that was not started)."""
        return np.fromiter((self._slots[k] for k in keys), np.int64, len(keys))

    def record(self, slots: np.ndarray, proposed: np.ndarray, accepted: np.ndarray) -> None:
        """One verification step: request slots[j] (distinct) proposed `proposed[j]` tokens, of which
        `accepted[j]` were accepted (0 <= accepted <= proposed; positions beyond k_max are not counted)."""
        if not len(slots):
            return
        drafted = self._positions < np.asarray(proposed)[:, None]
        hits = self._positions < np.asarray(accepted)[:, None]
        self._proposed[slots] += drafted
        self._accepted[slots] += hits
        self.pool_proposed += drafted.sum(axis=0)
        self.pool_accepted += hits.sum(axis=0)
        if self.pool_proposed[0] > self._window:  # a moving window: old steps weigh less and less
            self.pool_proposed *= 0.5
            self.pool_accepted *= 0.5

    def pooled_acceptance(self, prior_ratio: float = 0.5, prior_steps: float = 4.0) -> np.ndarray:
        """q_j, the pooled probability that draft position j is accepted, shrunk towards a geometric prior a^j whose
        ratio a is the pooled first-position acceptance where that is above prior_ratio, else prior_ratio.

        Positions the budget has not drafted yet are expected to hold up at least as the first one does: a fixed
        prior (prior_ratio^j) caps what high measured acceptance can buy (with q_1 near 1, undrafted positions
        would still count 0.5^j, so long drafts look worthless and are never measured). Below prior_ratio the first
        position is no guide: a suffix draft that survives its first token is likelier to go on. Measured effects
        of both choices: docs/results "The repeated greedy epoch"."""
        first = (self.pool_accepted[0] + prior_steps * prior_ratio) / (self.pool_proposed[0] + prior_steps)
        prior = max(first, prior_ratio) ** (self._positions + 1.0)
        return (self.pool_accepted + prior_steps * prior) / (self.pool_proposed + prior_steps)

    def params(self, slots: np.ndarray, prior_steps: float = 4.0) -> DrafterParams:
        """Each request's per-position acceptance q_ij from its own counts with the pooled acceptance as prior
        (weight prior_steps), and which requests have had fewer than EXPLORE_DRAFTS drafts verified.

        The prior is the pool's, scaled to the request's own first position: q_ij = min(1, q_j (a_i / q_1)^j), a_i
        its first-position acceptance shrunk towards the pool's q_1. Where the pool is geometric (q_j = q_1^j)
        that is a_i^j: a request whose first tokens hold better than the pool's is expected to hold better
        further out, until its own longer drafts say otherwise (the pool's q_j unscaled would keep it drafting as
        short as the previous batch's requests did). A request with no drafts of its own has a_i = q_1: the pool's
        prior unchanged."""
        proposed, accepted = self._proposed[slots], self._accepted[slots]
        pooled = self.pooled_acceptance()
        first = (accepted[:, :1] + prior_steps * pooled[0]) / (proposed[:, :1] + prior_steps)
        prior = np.minimum(pooled * (first / pooled[0]) ** (self._positions + 1.0), 1.0)
        estimate = estimate_drafter_params(proposed, accepted, prior_steps=prior_steps, prior_q=prior)
        return DrafterParams(estimate.acceptance, proposed[:, 0] < EXPLORE_DRAFTS, float(self.pool_proposed[0]))

    def _grow(self) -> None:
        old = len(self._proposed)
        self._proposed = np.concatenate([self._proposed, np.zeros_like(self._proposed)])
        self._accepted = np.concatenate([self._accepted, np.zeros_like(self._accepted)])
        self._free.extend(range(2 * old - 1, old - 1, -1))
