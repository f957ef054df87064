"""Draft budget policies: every decode step, a draft length K_i in [0, K_max] for every running request.

The model (docs/design "The length-aware budget")
-------------------------------------------------
A forward pass costs t = c_base + c_tok * n_tokens seconds (n_tokens: tokens verified in the pass, drafts
included), plus c_spec when it verifies drafts. Request i has l_i predicted remaining tokens and measured
per-position acceptance q_ij: the probability that draft positions 1..j are all accepted when at least j are
proposed (`das.scheduler.acceptance`), nonincreasing in j. Drafting K tokens a step, a step commits on average

    f_i(K) = 1 + q_i1 + ... + q_iK        tokens (the accepted prefix plus the token the pass samples itself),

so at a draft length K kept for the rest of its life, request i needs T_iK = l_i / f_i(K) passes and proposes
K T_iK draft tokens. With K_i per request (re-planned every step) the batch needs N = max_i T_iK_i passes and costs

    F = (c_base + c_spec [some K_i > 0]) N + c_tok sum_i (l_i + K_i T_iK_i)       seconds.

The token term charges every proposed draft token in full, though an accepted one replaces a token its request would
have fed in a later pass: it errs towards drafting less. This is the usual speculative-decoding expectation with
each request's own measured acceptance per position: drafts that always hold give f(K) = K + 1, and nothing in the
model bends them down (a saturating curve under-predicts drafts that hold and buys too short ones: docs/design
"The exact optimum").

The exact optimum over K in {0, ..., K_max}^n. For a given N, request i's cheapest draft length is the smallest K
with T_iK <= N: its drafts over the rest of its life, K l_i / f_i(K), grow with K (f_i(K + 1) / (K + 1) <=
f_i(K) / K because K q_i,K+1 <= f_i(K) when q is nonincreasing). So K_i(N) = #{K < K_max : T_iK > N}, defined for
N >= N_min = max_i T_i,K_max (below it some request cannot keep up even at K_max). Between two consecutive values
of the T_iK every K_i(N) is constant and F grows with N, so the optimum is N = one of the T_iK at or above N_min
(K = 0 included: N = l_j, where request j stops needing drafts), or N = max_i l_i with no drafts at all (no
c_spec, no draft tokens). The solver evaluates F at all of them at once: request i moves from K - 1 to K once
N < T_i,K-1, so with those thresholds sorted, the draft tokens of every candidate are a suffix sum found by binary
search. Ties (equal lengths and acceptance) are handled by the strict comparison on both sides. With c_tok = 0
(drafts free) the optimum is N_min with the fewest drafts reaching it; with c_base = 0, K_max = 0, an empty batch
or all l_i = 0, nobody drafts.

Per step: K_i is the draft length of the optimum; re-solving every step with the updated l_i (receding horizon) is
what moves drafts to everyone when few requests remain.

Cost of `OptimalPolicy("lengths").draft_lengths`: O(m log m) for the m = n K_max thresholds of the requests that
can draft (l_i > N_min), in ~40 vectorised numpy calls whose call overhead, not arithmetic, dominates (timings:
docs/design "The exact optimum"). A native solver is the lever if that ever shows in a step's profile.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import index
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from das.scheduler.policies import DasPlan


@dataclass(frozen=True)
class BatchState:
    """What the budget policies see of one engine's running batch at one decode step.

    remaining: predicted remaining output tokens per request (float, >= 0), shape (n,).
    acceptance: q_ij, the probability that draft positions 1..j of request i are all accepted when at least j are
        proposed, shape (n, J) with J >= 1, values in [0, 1]; stored nonincreasing along j (a running minimum: a
        longer prefix cannot hold more often than a shorter one). Positions past J are never drafted.
    c_base_s, c_tok_s: the engine's step cost t = c_base_s + c_tok_s * n_tokens, seconds and seconds per token;
        both >= 0 and not both 0.
    c_spec_s: the fixed price of a step that verifies drafts (seconds, >= 0; 0: drafted steps cost no more).
    k_max: the most draft tokens one request may get in one step (>= 0).
    The arrays are copied to read-only float64 arrays; invalid input raises ValueError.
    """

    remaining: np.ndarray
    acceptance: np.ndarray
    c_base_s: float
    c_tok_s: float
    k_max: int
    c_spec_s: float = 0.0

    def __post_init__(self) -> None:
        arrays = {}
        for name in ("remaining", "acceptance"):
            try:
                arrays[name] = np.array(getattr(self, name), dtype=np.float64)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"BatchState.{name} must be numeric: {exc}") from None
        rem, acc = arrays["remaining"], arrays["acceptance"]
        if rem.ndim != 1:
            raise ValueError(f"BatchState.remaining must be 1-D, got shape {rem.shape}")
        if acc.ndim != 2 or acc.shape[0] != rem.shape[0] or acc.shape[1] == 0:
            raise ValueError(f"BatchState.acceptance must have shape (n, J) with n = {rem.shape[0]} requests and "
                             f"J >= 1, got {acc.shape}")
        # min/max per array: a NaN makes min() NaN and fails every comparison, so this also rejects NaN
        if rem.size and not (rem.min() >= 0 and rem.max() < np.inf):
            raise ValueError("BatchState.remaining must be finite and >= 0 (tokens)")
        if acc.size and not (acc.min() >= 0 and acc.max() <= 1):
            raise ValueError("BatchState.acceptance must be probabilities in [0, 1]")
        np.minimum.accumulate(acc, axis=1, out=acc)
        c_base, c_tok = _cost_scalar("c_base_s", self.c_base_s), _cost_scalar("c_tok_s", self.c_tok_s)
        c_spec = _cost_scalar("c_spec_s", self.c_spec_s)
        if c_base == 0 and c_tok == 0:
            raise ValueError("BatchState: c_base_s and c_tok_s cannot both be 0")
        if isinstance(self.k_max, bool):
            raise ValueError("BatchState.k_max must be an integer >= 0, got a bool")
        try:
            k_max = index(self.k_max)
        except TypeError:
            raise ValueError(f"BatchState.k_max must be an integer >= 0, got {self.k_max!r}") from None
        if k_max < 0:
            raise ValueError(f"BatchState.k_max must be >= 0, got {k_max}")
        for arr in (rem, acc):
            arr.setflags(write=False)
        for name, value in (("remaining", rem), ("acceptance", acc), ("c_base_s", c_base), ("c_tok_s", c_tok),
                            ("c_spec_s", c_spec), ("k_max", k_max)):
            object.__setattr__(self, name, value)

    def __len__(self) -> int:
        return int(self.remaining.shape[0])


def geometric_acceptance(ratio: float, n: int, positions: int) -> np.ndarray:
    """q_ij = ratio^j for n requests and `positions` draft positions: a drafter whose every token holds with
    probability `ratio` (in [0, 1]) given the ones before it."""
    return np.tile(float(ratio) ** np.arange(1.0, positions + 1.0), (n, 1))

def _cost_scalar(name: str, value: object) -> float:
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"BatchState.{name} must be a number, got {value!r}") from None
    if not (np.isfinite(v) and v >= 0):
        raise ValueError(f"BatchState.{name} must be finite and >= 0 (seconds), got {v}")
    return v


@dataclass(frozen=True)
class DraftPlan:
    """What a request may verify this step. lengths: int32 K_i in [0, K_max], the most draft tokens; min_prob:
    float64, the least probability (the drafter's estimate that every draft token up to this one is accepted) a
    draft token must have to be verified: 0 verifies whatever the drafter proposes, inf nothing. explored: None, or
    a bool per request: its length is exploration's token (`Exploration`), whose accepted tokens are
    refunded to the exploration credit.

    The step's price, where the plan prices its drafts (`confidence_plan`; None elsewhere): `value`, float64 per
    request, the seconds an accepted draft token of it saves; `token_s`, what a draft token costs to verify;
    `step_s`, what a step pays for verifying any draft at all (the drafted step's fixed price, the guard's
    included). `pays` weighs a step's drafts against them."""

    lengths: np.ndarray
    min_prob: np.ndarray
    explored: np.ndarray | None = None
    value: np.ndarray | None = None
    token_s: float = 0.0
    step_s: float = 0.0

    def pays(self, probs: np.ndarray, offsets: np.ndarray) -> bool:
        """Whether a step's drafts (request r's tokens at probs[offsets[r]:offsets[r + 1]], each the drafter's
        estimate that it and the ones before it are accepted) are worth their drafted step: the expected seconds
        they save, sum over tokens of p value_r - (1 - p) token_s (an accepted token is one its request would have
        computed later, a rejected one is paid for nothing), at least the step's fixed price `step_s`. True where
        the plan has no price or there are no drafts. O(draft tokens), vectorised."""
        if self.value is None or self.step_s <= 0.0 or probs.size == 0:
            return True
        owner = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
        p = probs.astype(np.float64)
        return float((p * (self.value[owner] + self.token_s)).sum() - self.token_s * p.size) >= self.step_s


@runtime_checkable
class BudgetPolicy(Protocol):
    """A draft budget policy: `draft_lengths(batch)` is an int32 array of K_i in [0, batch.k_max], one per request;
    `plan(batch)` the same with a per-request probability floor for the drafter's tokens; `reads_acceptance`: whether
    either reads BatchState.acceptance (where it does not, nobody need estimate it)."""

    name: str
    reads_acceptance: bool

    def draft_lengths(self, batch: BatchState) -> np.ndarray: ...

    def plan(self, batch: BatchState) -> DraftPlan: ...


def _plan_without_floor(policy: BudgetPolicy, batch: BatchState) -> DraftPlan:
    return DraftPlan(policy.draft_lengths(batch), np.zeros(len(batch)))


class UniformPolicy:
    """The same K for every request (clipped to the engine's K_max): the fixed-K baseline."""

    reads_acceptance = False

    def __init__(self, k: int) -> None:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise ValueError(f"UniformPolicy: k must be an integer >= 0, got {k!r}")
        self.k = int(k)
        self.name = f"uniform-{self.k}"

    def draft_lengths(self, batch: BatchState) -> np.ndarray:
        return np.full(len(batch), min(self.k, batch.k_max), dtype=np.int32)

    def plan(self, batch: BatchState) -> DraftPlan:
        return _plan_without_floor(self, batch)


class ClassPolicy:
    """The original code's three length classes: long / medium / short get 16 / 8 / 4 draft tokens (short=0 is the
    other variant), clipped to K_max.

    Classes come from the predicted remaining length. With `thresholds=None` they are the batch's terciles:
    long if remaining >= its 2/3 quantile, medium if >= its 1/3 quantile, else short; `>=` so that a batch of
    equal lengths, or a single request, is all long (few requests left is when drafts pay). With
    `thresholds=(medium_from, long_from)` (tokens) the classes are fixed instead.
    The name is `classes` for the defaults, `classes-{long}-{medium}-{short}` otherwise.
    """

    reads_acceptance = False

    def __init__(self, long: int = 16, medium: int = 8, short: int = 4,
                 thresholds: tuple[float, float] | None = None) -> None:
        for label, v in (("long", long), ("medium", medium), ("short", short)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"ClassPolicy: {label} must be an integer >= 0, got {v!r}")
        if thresholds is not None:
            try:
                lo, hi = (float(t) for t in thresholds)
            except (TypeError, ValueError):
                raise ValueError(f"ClassPolicy: thresholds must be two numbers, got {thresholds!r}") from None
            if not (np.isfinite(lo) and np.isfinite(hi) and 0 <= lo <= hi):
                raise ValueError(f"ClassPolicy: thresholds must be 0 <= medium_from <= long_from, got {thresholds}")
            thresholds = (lo, hi)
        self.levels = np.array([short, medium, long], dtype=np.int32)
        self.thresholds = thresholds
        default = (long, medium, short) == (16, 8, 4) and thresholds is None
        self.name = "classes" if default else f"classes-{long}-{medium}-{short}"

    def draft_lengths(self, batch: BatchState) -> np.ndarray:
        rem = batch.remaining
        if rem.size == 0:
            return np.zeros(0, dtype=np.int32)
        if self.thresholds is None:
            lo, hi = np.quantile(rem, (1 / 3, 2 / 3))
        else:
            lo, hi = self.thresholds
        cls = (rem >= lo).astype(np.intp) + (rem >= hi)
        return np.minimum(self.levels[cls], batch.k_max).astype(np.int32)

    def plan(self, batch: BatchState) -> DraftPlan:
        return _plan_without_floor(self, batch)


@dataclass(frozen=True)
class BudgetSolution:
    """The optimum of the budget model for one batch.

    n_forward: N, the forward passes the batch needs (the makespan in passes; float).
    proposed: K_i T_iK_i, draft tokens request i proposes over its remaining life at its draft length (float).
    draft_lengths: K_i in [0, min(K_max, J)], int32: what to propose this step.
    marginal: q_iK_i, the modeled probability that request i's last draft token (and every one before it) is
        accepted; inf where K_i = 0, 0 when drafts are free (c_tok = 0). A draft token the drafter itself
        estimates at least this likely is as good as the least the optimum pays for (`OptimalPolicy.plan`).
    """

    n_forward: float
    proposed: np.ndarray
    draft_lengths: np.ndarray
    marginal: np.ndarray


class OptimalPolicy:
    """The length-aware budget (`das`); see the module docstring for the model and the solver. Its `plan`
    (`das.scheduler.policies.DasPlan`):

    - "lengths" (`das-lengths`): `draft_lengths` and `plan` are the optimum's K_i, from acceptance counts.
    - "token" (`das-token`): `plan` uses the same optimum per draft token instead: a request with K_i > 0 may
      verify up to K_max tokens, each only while the drafter's own estimate of its acceptance stays at least the
      request's marginal (BudgetSolution.marginal): the model decides who drafts and how likely a token must be,
      the drafter's per-token estimate which tokens clear that bar. It depends on those estimates being
      calibrated; on the bundled traces they run low and the floor cuts good drafts (docs/design "From the
      optimum to a step"), so it is not the default.
    - "confidence" (`das`, the default): the plan prices each draft token by the drafter's own estimate instead of
      planning K_i from counts (`confidence_plan`): every request may verify up to K_max tokens, each only while
      its estimated acceptance pays for its verification; it reads no acceptance counts (`reads_acceptance`).

    With `exact_tokens=True` (lengths and token only: `-exact`) the optimum's token term charges a request only the
    draft tokens it is expected to have rejected, T_iK (K - q_i1 - ... - q_iK), instead of every one it proposes
    (`solve_budget`).
    """

    PLANS = ("confidence", "lengths", "token")  # the plans it implements: policies.DasPlan

    def __init__(self, plan: DasPlan = "confidence", exact_tokens: bool = False) -> None:
        if plan not in self.PLANS:
            raise ValueError(f"OptimalPolicy: plan must be one of {self.PLANS}, got {plan!r}")
        if plan == "confidence" and exact_tokens:
            raise ValueError("the das budget's confidence plan takes no exact_tokens")
        self.variant = plan  # not `plan`: that is the method
        self.exact_tokens = exact_tokens
        self.confidence = plan == "confidence"
        self.per_token = plan == "token"
        self.name = ("das" if self.confidence else f"das-{plan}") + ("-exact" if exact_tokens else "")

    @property
    def reads_acceptance(self) -> bool:
        """Whether the plan reads BatchState.acceptance (the confidence plan does not)."""
        return not self.confidence

    def draft_lengths(self, batch: BatchState) -> np.ndarray:
        if self.confidence:
            return confidence_plan(batch).lengths
        return solve_budget(batch, self.exact_tokens).draft_lengths

    def plan(self, batch: BatchState) -> DraftPlan:
        if self.confidence:
            return confidence_plan(batch)
        solution = solve_budget(batch, self.exact_tokens)
        if not self.per_token:
            return DraftPlan(solution.draft_lengths, np.zeros(len(batch)))
        lengths = np.where(solution.draft_lengths > 0, batch.k_max, 0).astype(np.int32)
        return DraftPlan(lengths, solution.marginal)


def solve_budget(batch: BatchState, exact_tokens: bool = False) -> BudgetSolution:
    """N, K_i and their draft tokens for one batch (module docstring). Vectorised over requests and positions.
    `exact_tokens`: charge the token term for the draft tokens expected to be rejected, T_iK (K + 1 - f_i(K)), not
    all K T_iK proposed (an accepted one does work its request would have fed later); it still grows with K, so the
    solver is the same."""
    rem = batch.remaining
    n = rem.size
    depth = min(batch.k_max, batch.acceptance.shape[1])
    l_max = float(rem[rem.argmax()]) if n else 0.0
    if n == 0 or l_max == 0.0 or depth == 0 or batch.c_base_s == 0.0:
        return _without_drafts(n, l_max)  # nothing to speed up, drafts impossible, or forward passes free
    q = batch.acceptance[:, :depth]
    passes = q.cumsum(axis=1)
    passes += 1.0
    np.divide(rem[:, None], passes, out=passes)     # T_iK for K = 1..depth
    n_min = float(passes[:, -1].max())
    live = rem > n_min                                # only these can draft at any feasible N
    if not live.any():
        return _without_drafts(n, l_max)
    t = passes[live]
    threshold = np.empty_like(t)                      # request moves from K - 1 to K once N < threshold[:, K - 1]
    threshold[:, 0] = rem[live]
    threshold[:, 1:] = t[:, :-1]
    tokens = t * np.arange(1.0, depth + 1.0)          # K T_iK: its draft tokens over the rest of its life
    if exact_tokens:
        tokens -= t * q[live].cumsum(axis=1)          # less the accepted ones: T_iK (K - q_i1 - ... - q_iK)
    step_up = tokens.copy()
    step_up[:, 1:] -= tokens[:, :-1]                  # draft tokens each move adds
    flat = threshold.ravel()
    order = flat.argsort()
    sorted_thresholds = flat[order]
    suffix = np.zeros(flat.size + 1)                  # suffix[m]: tokens of the moves at sorted positions >= m
    suffix[:-1] = step_up.ravel()[order][::-1].cumsum()[::-1]
    candidates = np.concatenate((flat, t[:, -1]))     # every T_iK, K = 0..depth
    total = (batch.c_base_s + batch.c_spec_s) * candidates
    total += batch.c_tok_s * suffix[sorted_thresholds.searchsorted(candidates, "right")]
    total[candidates < n_min] = np.inf
    best = int(total.argmin())
    if not total[best] < batch.c_base_s * l_max:
        return _without_drafts(n, l_max)  # drafting does not beat running every pass plain
    x = float(candidates[best])
    k = np.zeros(n, dtype=np.int32)
    k[live] = (threshold > x).sum(axis=1)
    rows = np.flatnonzero(k)
    proposed = np.zeros(n)
    proposed[rows] = k[rows] * passes[rows, k[rows] - 1]
    marginal = np.full(n, np.inf)
    marginal[rows] = q[rows, k[rows] - 1] if batch.c_tok_s > 0.0 else 0.0
    return BudgetSolution(x, proposed, k, marginal)


# Length forecasts of samples at T > 0 are off by tens of percent; `confidence_plan` treats requests predicted within
# a factor of two of each other as equally likely to be the batch's straggler.
FORECAST_SPREAD = 0.5


def confidence_plan(batch: BatchState) -> DraftPlan:
    """Every request may verify up to K_max draft tokens, each while the drafter's estimate p that it (and every one
    before it) is accepted is at least the request's price

        floor_i = c_draft / (c_draft + value_i),   value_i = c_base / (2 m_i - 1),   c_draft = c_tok + c_spec / K_max,

    where m_i = #{j : l_j >= FORECAST_SPREAD l_i} counts the requests that may run at least as long as i (forecasts
    within a factor 1 / FORECAST_SPREAD of each other do not tell which one ends last). A draft token costs its
    verification, c_draft (the token plus its share of a full draft's fixed price, the guard's included), when it
    is rejected; an accepted one is a token its request would have computed in a later pass anyway. What an
    accepted token buys is a pass less for its request, which shortens the batch only if that request is the one
    that ends last. The longest request alone (m_i = 1) is: its accepted tokens are the batch's, c_base each. Of m
    tied ones each would end last with chance 1/m if they advanced alike, but the last is the one whose drafts held
    least, and a request whose draft token is accepted is by that token pulling ahead of its peers, so its chance
    is lower: 1 / (2m - 1) halves the tied value and keeps the lone straggler's whole. That factor is measured, not
    derived (docs/results "One budget for both regimes", "The tied requests' value"). Only the fixed part of a pass
    is saved: the other requests' tokens are computed all the same, in whichever pass, so a step's per-token work
    (c_tok n) is no part of the value. That is what reads the regime: where a step is mostly fixed cost (a GPU: c_tok
    ~1/250 of c_base) nearly every draft pays; where it is mostly per-token work (a CPU at tens of requests) only
    likely ones do. The draft pays where p (c_draft + value_i) >= c_draft, i.e. p >= floor_i: the batch's longest
    request drafts down to c_draft / (c_draft + c_base), a batch of many equally long ones only what is likely to
    hold. This asks the drafter's probabilities to be calibrated and spends nothing from the request's acceptance
    counts: a new request whose context repeats itself drafts at its first step. The length forecast acts through
    the ranks alone. Per token the price shares the drafted step's fixed price as if a full draft did; the step as a
    whole pays it only where its drafts' expected saving covers it (`DraftPlan.pays`, applied by the draft step), so a
    step with a few middling drafts verifies none. Vectorised: a sort and a few numpy calls over n."""
    n = len(batch)
    rem = batch.remaining
    if n == 0 or batch.k_max == 0 or batch.c_base_s == 0.0:
        return DraftPlan(np.zeros(n, dtype=np.int32), np.full(n, np.inf))
    c_draft = batch.c_tok_s + batch.c_spec_s / batch.k_max
    at_least_as_long = n - np.sort(rem).searchsorted(rem * FORECAST_SPREAD, "left")
    value = batch.c_base_s / (2.0 * at_least_as_long - 1.0)
    live = rem > 0.0
    floor = np.where(live, c_draft / (c_draft + value), np.inf)
    return DraftPlan(np.where(live, batch.k_max, 0).astype(np.int32), floor, value=value, token_s=batch.c_tok_s,
                     step_s=batch.c_spec_s)


def _without_drafts(n: int, l_max: float) -> BudgetSolution:
    """The solution for n requests none of which drafts: the batch takes its longest request's l_max passes."""
    return BudgetSolution(l_max, np.zeros(n), np.zeros(n, dtype=np.int32), np.full(n, np.inf))


@dataclass(frozen=True)
class DrafterParams:
    """Per-request drafter parameters for the budget model: `acceptance` q_ij (BatchState.acceptance, one row per
    request, or one row of J for a single request); `unmeasured` (None, or a bool each): requests whose estimate
    rests on too few drafts of their own, which bounded exploration may give a draft token the optimum did not
    (`das.scheduler.exploration`); `measured`: first-position drafts the engine has verified (pooled; inf: not
    tracked)."""

    acceptance: np.ndarray
    unmeasured: np.ndarray | None = None
    measured: float = np.inf

    @property
    def tokens_per_step(self) -> np.ndarray:
        """f(J) = 1 + sum_j q_j: the tokens a step commits on average drafting all J positions, per request."""
        return 1.0 + self.acceptance.sum(axis=-1)


def estimate_drafter_params(proposed: np.ndarray, accepted: np.ndarray, *, prior_ratio: float = 0.5,
                            prior_steps: float = 4.0, prior_q: np.ndarray | None = None) -> DrafterParams:
    """Per-position acceptance q_ij from counts, shrunk towards a prior.

    proposed[i, j]: verification steps of request i in which draft position j+1 was proposed; accepted[i, j]:
    steps in which position j+1 was accepted (so were positions 1..j). 1-D input is one request. J (the number of
    positions) should be the K_max the estimate is used with.

    q_ij = (accepted_ij + prior_steps prior_j) / (proposed_ij + prior_steps): the measured share with the weight of
    prior_steps steps on a prior, the geometric prior_ratio^j unless `prior_q` (values in (0, 1], J of them or one
    row of J per request) gives one, e.g. the engine's pooled acceptance. A position never proposed gets the prior.
    """
    prop = np.asarray(proposed, dtype=np.float64)
    acc = np.asarray(accepted, dtype=np.float64)
    if prop.shape != acc.shape or prop.ndim not in (1, 2) or prop.shape[-1] == 0:
        raise ValueError(f"proposed and accepted must share a shape (J,) or (n, J) with J >= 1, "
                         f"got {prop.shape} and {acc.shape}")
    if not (np.all(np.isfinite(prop)) and np.all(np.isfinite(acc)) and np.all(acc >= 0)
            and np.all(acc <= prop)):
        raise ValueError("acceptance counts must be finite with 0 <= accepted <= proposed")
    if not (0 < prior_ratio < 1 and np.isfinite(prior_steps) and prior_steps > 0):
        raise ValueError("prior_ratio must be in (0, 1) and prior_steps > 0")
    if prior_q is None:
        prior = prior_ratio ** np.arange(1, prop.shape[-1] + 1)
    else:
        prior = np.asarray(prior_q, dtype=np.float64)
        if prior.shape not in ((prop.shape[-1],), prop.shape) or not (np.all(prior > 0) and np.all(prior <= 1)):
            raise ValueError(f"prior_q must be {prop.shape[-1]} values in (0, 1] (or one row per request), got "
                             f"{prior_q!r}")
    return DrafterParams((acc + prior_steps * prior) / (prop + prior_steps))
