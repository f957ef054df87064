"""Where the proposer asks how many draft tokens each running request gets this step.

The policies themselves live in `das.scheduler.budget` (uniform K, the three length classes, the length-aware
optimum); this module turns the proposer's view of its batch into their `BatchState` and back, with the engine's
step costs as it measures them (`observe`: an online fit, `OnlineCostModel`) and a guard that backs off when
drafted steps lose (`SpeculationGuard`). The scheduler tunes a hook by its configuration (a budget of the one
grammar, `das.scheduler.policies`, as plain data in `additional_config["das"]["budget"]`) and informs it per
request through `RequestTags.length_curve` (the scheduler's forecast, re-read every step as the sample grows) or
`RequestTags.predicted_tokens` (one number, fixed at submission).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from das.scheduler.budget import (
    BatchState,
    BudgetPolicy,
    DrafterParams,
    DraftPlan,
    geometric_acceptance,
)
from das.scheduler.cost_model import CostModel, OnlineCostModel
from das.scheduler.exploration import Exploration
from das.scheduler.policies import BudgetBase, budget_from_config


@dataclass(frozen=True)
class BatchView:
    """The running requests as the budget hook sees them, one entry per request (tokens).

    generated: output tokens so far (int64); predicted_tokens: predicted total output length (float64, NaN where
    unknown); max_tokens: each request's output cap (int64); curve_final: the request's length curve read at its
    `generated` (scheduler.length `LengthCurve.at`: its predicted total output length given that it got this far;
    float64, NaN where it has no curve).
    """

    generated: np.ndarray
    predicted_tokens: np.ndarray
    max_tokens: np.ndarray
    curve_final: np.ndarray

    def __len__(self) -> int:
        return len(self.generated)

    def remaining(self) -> np.ndarray:
        """Predicted remaining output tokens per request (float64, >= 1): from the curve where there is one (a
        sample that outlives its problem's usual length is predicted to run on), else from predicted_tokens, else
        the cap. Vectorised."""
        total = np.where(np.isnan(self.predicted_tokens), self.max_tokens, self.predicted_tokens)
        total = np.where(np.isnan(self.curve_final), total, self.curve_final)
        return np.maximum(1.0, np.minimum(total, self.max_tokens) - self.generated)


@dataclass(frozen=True, slots=True)
class StepSample:
    """One engine step as the proposer measured it: `step_s` seconds from the previous step's proposal to this one's
    (the whole step: forward pass, sampling, the engine core's bookkeeping, the proposer); `tokens` scheduled (running
    requests plus the draft tokens they verified); `requests` running; `accepted` draft tokens accepted; `probe`: the
    drafts include the cost warm-up's junk ones (`RequestTags.cost_probe`), which price a drafted step for the cost fit
    but say nothing about what drafts buy; `explored_accepted`: accepted tokens of exploration's drafts
    (`DraftPlan.explored`)."""

    step_s: float
    tokens: int
    requests: int
    drafted: int
    accepted: int
    probe: bool = False
    explored_accepted: int = 0


class BudgetHook(Protocol):
    name: str
    # whether `plan` reads the drafter's measured acceptance; where it does not, the caller passes None and need
    # not estimate it (a per-step cost, O(requests x K_max))
    reads_acceptance: bool

    def plan(self, batch: BatchView, drafter: DrafterParams | None = None) -> DraftPlan:
        """Per request, K_i >= 0 (int32; the proposer clips to its room and K_max) and the least estimated acceptance
        probability a draft token must have. `drafter`: measured per-position acceptance per request (the
        hook's geometric prior where None)."""
        ...

    def observe(self, step: StepSample) -> None:
        """A measured step (decode only: prefill steps and idle gaps are not passed)."""
        ...

    def refund(self, explored_accepted: int, requests: int) -> None:
        """Exploration's accepted draft tokens of a step `observe` is not given (a prefill in it, or after an idle
        gap: not a decode step of its shape, but its accepted tokens did a plain token's work all the same)."""
        ...

    def stats(self) -> dict[str, Any]:
        """The live cost fit and the guard's state, plain data."""
        ...


# The guard's extra price on a drafted step, least to most demanding, as a share of a plain step of the batch's size.
GUARD_PRICES = (0.0, 0.1, 0.25, 0.5, 1.0)


class SpeculationGuard:
    """Never a loss: watches what drafted steps buy and raises the price the budget sees on them while they lose.

    A drafted step of r requests that got `accepted` draft tokens in `step_s` produced (r + accepted) / step_s tokens
    per second; without drafts the same requests would have produced r / (c_base + c_tok r) by the live cost fit. Their
    ratio, averaged over recent drafted steps (weight 1/16 each), is what speculation buys. Below `lose` (after
    `patience` drafted steps at this level) the price goes one level up, above `win` (after `recover` drafted steps) one
    level down. The price acts inside the budget model (an extra c_spec): the optimum then drafts only where it predicts
    a gain that pays the price too, i.e. fewer drafted steps, for the requests and draft lengths whose measured
    acceptance promises most. It prices drafted steps rather than flooring the drafter's per-token probabilities: those
    are counts, not calibrated, so a floor raised on one batch can keep the next, whose drafts hold, from drafting at
    all (docs/design "The online cost model"). A raised price may still leave nothing worth drafting, and then nothing
    is measured: so after `relax` steps in a row without a drafted one the price also goes one level down.
    """

    def __init__(self, lose: float = 0.98, win: float = 1.05, patience: int = 16, recover: int = 4,
                 relax: int = 64) -> None:
        self.lose, self.win, self.patience, self.recover, self.relax = lose, win, patience, recover, relax
        self.level = 0
        self.gain: float | None = None
        self._since_change = 0
        self._plain_steps = 0  # steps in a row without a drafted one
        self.raised = 0

    @property
    def price(self) -> float:
        """The extra price of a drafted step, as a share of a plain step of the same batch."""
        return GUARD_PRICES[self.level]

    def observe(self, step: StepSample, cost: CostModel) -> None:
        if step.requests == 0:
            return
        if not step.drafted:
            self._plain_steps += 1
            if self.level and self._plain_steps >= self.relax:
                self._change(-1)
            return
        self._plain_steps = 0
        plain_s = cost.step_time(step.requests)
        ratio = ((step.requests + step.accepted) / step.step_s) / (step.requests / plain_s)
        self.gain = ratio if self.gain is None else 0.9375 * self.gain + 0.0625 * ratio
        self._since_change += 1
        if self.gain > self.win and self.level > 0 and self._since_change >= self.recover:
            self._change(-1)
        elif self.gain < self.lose and self.level < len(GUARD_PRICES) - 1 and self._since_change >= self.patience:
            self.raised += 1
            self._change(+1)

    def _change(self, levels: int) -> None:
        self.level += levels
        self._since_change = self._plain_steps = 0
        self.gain = None


class PolicyBudget:
    """A `scheduler.budget` policy fed from the proposer's batch and the engine's live step costs.

    acceptance: the ratio of the geometric per-position acceptance (q_j = acceptance^j) assumed for requests
    without measured acceptance (the proposer passes measured ones, `das.scheduler.acceptance`). The step cost model is
    `cost`, fitted online from the engine's own steps (`observe`) unless `online` is False, and read every step.
    `guard`: the never-a-loss guard (`SpeculationGuard`), which only ever raises the price of a drafted step the
    policy sees.
    Requests with unmeasured acceptance get exploration tokens on a credit of ~0.5% of the engine's time
    (`Exploration`; the fixed baselines draft everyone anyway).
    Cost per step: one BatchState (two small numpy arrays), the policy's solve (`OptimalPolicy`: O(m log m) in its
    thresholds), the fit's O(1) update and exploration's vectorised pass over the requests.
    """

    def __init__(self, policy: BudgetPolicy, k_max: int, cost: CostModel, *, online: bool = True,
                 guard: bool = True, acceptance: float = 0.6) -> None:
        self.policy = policy
        self.name = policy.name
        self.k_max = k_max
        self.fit = OnlineCostModel(cost) if online else None
        self.cost = cost
        self.guard = SpeculationGuard() if guard else None
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"budget acceptance must be a probability in [0, 1], got {acceptance}")
        self.acceptance = acceptance
        self.exploration = Exploration()

    @property
    def reads_acceptance(self) -> bool:
        """As the policy (and exploration, which measures acceptance for the plans that read it)."""
        return self.policy.reads_acceptance

    def plan(self, batch: BatchView, drafter: DrafterParams | None = None) -> DraftPlan:
        n = len(batch)
        acceptance = (drafter.acceptance if drafter is not None
                      else geometric_acceptance(self.acceptance, n, max(self.k_max, 1)))
        cost = self.cost
        state = BatchState(batch.remaining(), acceptance, cost.c_base_s,
                           cost.c_tok_s, self.k_max, c_spec_s=cost.spec_price(n))
        if self.guard is not None and self.guard.level:
            priced = dataclasses.replace(state, c_spec_s=state.c_spec_s + self.guard.price * cost.step_time(n))
            plan = self.policy.plan(priced)
        else:
            plan = self.policy.plan(state)
        # exploration pays the step's real price, not the guard's: its tokens are measurements, and they are what
        # tells a raised guard that drafts pay again
        if self.reads_acceptance:
            plan = self.exploration.apply(plan, state, drafter.unmeasured if drafter is not None else None,
                                          drafter.measured if drafter is not None else np.inf)
        return plan

    def observe(self, step: StepSample) -> None:
        if self.fit is not None:
            self.fit.observe(step.tokens, step.drafted > 0, step.step_s, step.requests)
            self.cost = self.fit.current()
        if self.guard is not None and not step.probe:
            self.guard.observe(step, self.cost)
        self.refund(step.explored_accepted, step.requests)

    def refund(self, explored_accepted: int, requests: int) -> None:
        self.exploration.refund(explored_accepted, self.cost, requests)

    def stats(self) -> dict[str, Any]:
        cost = self.cost
        out: dict[str, Any] = {"c_base_s": cost.c_base_s, "c_tok_s": cost.c_tok_s, "c_spec_s": cost.c_spec_s,
                               "c_spec_req_s": cost.c_spec_req_s, "c_prefill_s": cost.c_prefill_s,
                               "prior": self.fit.prior.name if self.fit is not None else cost.name}
        if self.fit is not None:
            out.update(dataclasses.asdict(self.fit.stats()))
        if self.guard is not None:
            out.update(guard_price=self.guard.price, guard_gain=self.guard.gain, guard_raised=self.guard.raised)
        out["explore_tokens"] = self.exploration.tokens
        return out


def budget_hook_from_config(config: BudgetBase | Mapping[str, Any] | str, k_max: int) -> BudgetHook:
    """The budget hook `config` describes (a `das.scheduler.policies` budget, its fields as plain data: what crosses
    into vLLM's engine core, or its name), for drafts of at most `k_max` tokens. Bad settings raise ValueError
    (pydantic's ValidationError)."""
    budget = budget_from_config(config)
    return PolicyBudget(budget.budget_policy(k_max), k_max, budget.cost_prior(), online=budget.online,
                        guard=budget.guard, acceptance=budget.acceptance)
