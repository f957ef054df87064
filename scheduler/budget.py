"""Draft budget policies: every decode step, a draft length K_i in [0, K_max] for every running request.

The model (docs/design.md, "The length-aware budget")
-----------------------------------------------
A forward pass costs t = c_base + c_tok * n_tokens seconds (n_tokens: tokens verified in the pass, drafts
included). Request i has l_i predicted remaining tokens, drafter capacity k_i in (0, 1] and acceptance efficiency
a_i > 0: proposing p_i draft tokens over its remaining life gets A_i = k_i l_i (1 - exp(-a_i p_i / l_i)) of them
accepted, so it needs l_i - A_i forward passes. The batch takes N = max_i (l_i - A_i) passes and, summed over its
passes, costs c_base N + c_tok (sum_i l_i + sum_i p_i) seconds; sum_i l_i is fixed, hence

    minimise  c_base N + c_tok sum_i p_i   over N, p >= 0,   s.t.  l_i (1 - k_i + k_i exp(-a_i p_i / l_i)) <= N.

Derivation. Write b_i = l_i (1 - k_i) (the passes request i needs however much it drafts) and w_i = l_i / a_i.
The constraints are convex in (N, p) (exp is convex) and the objective is linear, so the KKT conditions are
sufficient. Lagrangian L = c_base N + c_tok sum p_i + sum_i lambda_i (l_i (1 - k_i + k_i e^{-a_i p_i / l_i}) - N):
  * dL/dp_i = c_tok - lambda_i k_i a_i e^{-a_i p_i / l_i} = 0 when p_i > 0, so lambda_i > 0 and constraint i is
    tight: e^{-a_i p_i / l_i} = (N - b_i) / (k_i l_i), i.e.
        p_i(N) = w_i ln(k_i l_i / (N - b_i)) = -(l_i / a_i) ln(1 - (1 - N / l_i) / k_i)   for b_i < N < l_i,
    and p_i = 0 when l_i <= N (the request finishes within N passes without drafts). N > max_i b_i is needed
    for every p_i to be finite. k_i = 1 is the case b_i = 0: p_i = w_i ln(l_i / N).
  * then lambda_i = c_tok / (k_i a_i e^{-a_i p_i / l_i}) = c_tok w_i / (N - b_i), and dL/dN = c_base - sum lambda_i
    = 0 gives
        c_base = c_tok g(N),   g(N) = sum_{l_i > N} w_i / (N - b_i) = sum_{l_i > N} 1 / (a_i (k_i - 1 + N / l_i)).
The paper's printed p_i = -(l_i / a_i) ln(1 - k_i (1 - N / l_i)) would give sum k_i / (a_i (1 - k_i + k_i N / l_i))
here instead; it does not satisfy the model's own constraint, and the two agree only at k_i = 1 (docs/design.md,
"Derivation of the closed form").

Solving for N. Divide by c_tok: g(N) = r with r = c_base / c_tok (tokens; the step's fixed cost counted in
tokens). Every term w_i / (N - b_i) decreases in N and drops out when N reaches l_i, so g is decreasing on
(max_i b_i, max_i l_i], +inf at the left end and 0 at the right end, with a downward jump at every l_i. The
objective F(N) = c_base N + c_tok sum_i p_i(N) is convex with right derivative c_base - c_tok g(N), so the
optimum is N* = inf {N : g(N) <= r}: a root of g = r, or a kink at some l_j where g jumps over r (request j then
needs exactly its own l_j passes and no drafts). The solver works on the candidates that can be active and:
  * starts from lo = max_i min(l_i, b_i + w_i / r) <= N* (below it one term alone exceeds r) and hi = max_i l_i;
  * takes Newton steps on 1 / g, which is concave in N for a fixed set of active terms (a weighted harmonic sum
    of affine functions), so a step from the left never passes the root of the active terms and a step from
    the right (using the terms still active there) lands on a point that is still <= N*; one term alone is
    solved in one step;
  * a step from the left that would cross the next breakpoint is only a trial (terms drop there), and when it
    reaches the next breakpoint and that breakpoint is the upper end of the bracket, the optimum is that kink;
  * when two evaluations have not halved the bracket (Newton steps zigzag while many terms drop inside it), it
    bisects on the rank of the breakpoints inside the bracket, which halves them;
  * after _MAX_ITER evaluations it returns the upper end of the bracket (feasible: g <= r there).
Evaluations of g on 256 requests (3,000 random batches per kind, r from 1 to 1e4 tokens): median 3 and at most 14
for long-tailed lengths, median 7 and at most 14 for 256 distinct lengths within 10%, at most 8 for groups of 16
equal lengths.

The per-step cap. The model has no K_max, but a request proposing at most K_max tokens per pass over N passes
proposes at most K_max N: adding p_i <= K_max N keeps the problem convex, and the new optimum is
max(N*, N_cap), N_cap = the smallest N with max_i p_i(N) <= K_max N (max_i p_i(N) - K_max N is convex and
decreasing, so Newton from the left converges to it monotonically). Only computed when the cap binds at N*.

From p_i to a per-step draft length. Request i with l_i > N finishes in exactly N passes (its constraint is
tight), so it is in the batch for steps_i = min(N, l_i) = N passes and proposing p_i evenly means
K_i = p_i / N per pass; a request with l_i <= N has p_i = 0 whatever steps_i is. So
K_i = clip(round(p_i / N), 0, K_max). Re-solving every step with the updated l_i (receding horizon) is what
moves drafts to everyone when few requests remain.

Edge cases: c_tok = 0 (drafts free): any p >= p*(N) is optimal; the solution is the limit c_tok -> 0+, i.e. the
shortest makespan reachable under K_max with the fewest drafts (N = N_cap). c_base = 0: forwards are free, no
drafts, N = max l_i. K_max = 0, an empty batch, or all l_i = 0: no drafts; l_i = 0 alone gets K_i = 0. N is kept
at least _OFFSET max_i l_i above max_i b_i, which only matters when c_base / c_tok > 1e12 / a_i tokens.

Cost of `OptimalPolicy().draft_lengths` on this 2-core VM (median of 40 blocks x 500 calls timed with
time.perf_counter, interleaved with a reference): 256 requests, lengths lognormal(7, 1) (median 1100 tokens),
k_i ~ U(0.2, 0.95), a_i ~ U(0.3, 3), K_max = 16:
    r = c_base / c_tok = 199 (the h100-7b cost model)    33 us
    r = 20 / 2000                                        38 / 29 us
    groups of 16 equal lengths                           42 us
    256 distinct lengths within 10% (10 evaluations)     80 us
    8 requests                                           31 us
    c_tok = 0 (the K_max-capped path)                    27 us
with the reference, one 256-element numpy add, at 0.7 us. In runs where another CPU-bound process shared the
machine, the same r = 199 case measured 47-67 us. The cost is numpy call overhead, not arithmetic: about 30 calls
outside the solver loop plus 6 per evaluation of g, 0.7-1 us each. The 50 us target holds for long-tailed
batches on an uncontended core; near-equal lengths and a contended core miss it.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import index
from typing import Protocol, runtime_checkable

import numpy as np

# Evaluations of g before the solver settles for its feasible bracket end; 14 is the most seen on 256 requests.
_MAX_ITER = 64
# Relative accuracy of N in passes. K_i is an integer; 1e-9 costs one extra Newton step at most (quadratic
# convergence) and keeps the KKT residuals far below anything a test or a decision can see.
_TOL = 1e-9

# N - b_i is kept >= _OFFSET l_i: far above double rounding (2.2e-16 relative) and far below anything that
# changes a draft length; it only matters when drafts are nearly free (c_base / c_tok > 1e12 / a_i tokens).
_OFFSET = 1e-12


@dataclass(frozen=True)
class BatchState:
    """What the budget policies see of one engine's running batch at one decode step.

    remaining: predicted remaining output tokens per request (float, >= 0).
    capacity: drafter capacity k_i in (0, 1]: the share of the remaining tokens drafts can cover at best.
    efficiency: acceptance efficiency a_i > 0: k_i a_i is the acceptance of a draft token while budgets are small
        (so physically k_i a_i <= 1; not enforced, the model is defined for any a_i > 0).
    c_base_s, c_tok_s: the engine's step cost t = c_base_s + c_tok_s * n_tokens, seconds and seconds per token;
        both >= 0 and not both 0.
    c_spec_s: the fixed price of a step that verifies drafts (seconds, >= 0; 0: drafted steps cost no more).
    k_max: the most draft tokens one request may get in one step (>= 0).
    The arrays are copied to read-only float64 arrays of one shape (1-D); invalid input raises ValueError.
    """

    remaining: np.ndarray
    capacity: np.ndarray
    efficiency: np.ndarray
    c_base_s: float
    c_tok_s: float
    k_max: int
    c_spec_s: float = 0.0

    def __post_init__(self) -> None:
        arrays = {}
        for name in ("remaining", "capacity", "efficiency"):
            try:
                arr = np.array(getattr(self, name), dtype=np.float64)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"BatchState.{name} must be numeric: {exc}") from None
            if arr.ndim != 1:
                raise ValueError(f"BatchState.{name} must be 1-D, got shape {arr.shape}")
            arr.setflags(write=False)
            arrays[name] = arr
        shapes = {name: arr.shape for name, arr in arrays.items()}
        if len(set(shapes.values())) != 1:
            raise ValueError(f"BatchState arrays must have one shape, got {shapes}")
        rem, cap, eff = arrays["remaining"], arrays["capacity"], arrays["efficiency"]
        # min/max per array: a NaN makes min() NaN and fails every comparison, so this also rejects NaN
        if rem.size and not (rem.min() >= 0 and rem.max() < np.inf):
            raise ValueError("BatchState.remaining must be finite and >= 0 (tokens)")
        if cap.size and not (cap.min() > 0 and cap.max() <= 1):
            raise ValueError("BatchState.capacity must be in (0, 1]")
        if eff.size and not (eff.min() > 0 and eff.max() < np.inf):
            raise ValueError("BatchState.efficiency must be finite and > 0")
        if rem.size and not float(rem.max()) / float(eff.min()) < np.inf:
            raise ValueError("BatchState: remaining / efficiency overflows; efficiency is too small")
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
        for name, value in (*arrays.items(), ("c_base_s", c_base), ("c_tok_s", c_tok), ("c_spec_s", c_spec),
                            ("k_max", k_max)):
            object.__setattr__(self, name, value)

    def __len__(self) -> int:
        return int(self.remaining.shape[0])


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
    a bool per request: its length is exploration's token (scheduler/exploration.py), whose accepted tokens are
    refunded to the exploration credit."""

    lengths: np.ndarray
    min_prob: np.ndarray
    explored: np.ndarray | None = None


@runtime_checkable
class BudgetPolicy(Protocol):
    """A draft budget policy: `draft_lengths(batch)` is an int32 array of K_i in [0, batch.k_max], one per request;
    `plan(batch)` the same with a per-request probability floor for the drafter's tokens."""

    name: str

    def draft_lengths(self, batch: BatchState) -> np.ndarray: ...

    def plan(self, batch: BatchState) -> DraftPlan: ...


def _plan_without_floor(policy: BudgetPolicy, batch: BatchState) -> DraftPlan:
    return DraftPlan(policy.draft_lengths(batch), np.zeros(len(batch)))


class UniformPolicy:
    """The same K for every request (clipped to the engine's K_max): the fixed-K baseline."""

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
    proposed: p_i, draft tokens request i proposes over its remaining life (float, tokens; 0 if l_i <= N).
    draft_lengths: K_i = clip(round(p_i / N), 0, K_max), int32: what to propose this step.
    cap_binding: True if K_max raised N above the uncapped optimum (some request drafts K_max per step).
    marginal: c_tok / lambda_i, the cost of a draft token over the value of one pass less for request i, at the
        optimum without the K_max cap, where it equals the model's acceptance probability of request i's last
        proposed token, k_i a_i e^{-a_i p_i / l_i} = a_i (N - b_i) / l_i (inf where p_i = 0; 0 when drafts are
        free). A draft token the drafter itself estimates at least this likely to be accepted is worth
        verifying (`OptimalPolicy.plan`). With one request left it is c_tok / c_base whatever the drafter.
    """

    n_forward: float
    proposed: np.ndarray
    draft_lengths: np.ndarray
    cap_binding: bool
    marginal: np.ndarray


class OptimalPolicy:
    """The closed-form length-aware budget (`das`); see the module docstring for the model and the solver.

    `draft_lengths` and, by default, `plan` are the model's K_i. With `per_token=True` (`das-token`) `plan` uses
    the same optimum per draft token instead: a request with p_i > 0 may verify up to K_max tokens, each only
    while the drafter's own estimate of its acceptance stays at least the request's marginal
    (BudgetSolution.marginal): the model's average acceptance curve decides who drafts and how cheap a token must
    be, the drafter's per-token estimate which tokens clear that bar. It depends on those estimates being
    calibrated; on the bundled traces they run low and the floor cuts good drafts
    (docs/results/2026-11-23-simulated-makespan.md), so it is not the default.
    """

    def __init__(self, per_token: bool = False) -> None:
        self.per_token = per_token
        self.name = "das-token" if per_token else "das"

    def draft_lengths(self, batch: BatchState) -> np.ndarray:
        return solve_budget(batch).draft_lengths

    def plan(self, batch: BatchState) -> DraftPlan:
        solution = solve_budget(batch)
        if not self.per_token:
            return DraftPlan(solution.draft_lengths, np.zeros(len(batch)))
        lengths = np.where(solution.proposed > 0.0, batch.k_max, 0).astype(np.int32)
        return DraftPlan(lengths, solution.marginal)


def solve_budget(batch: BatchState) -> BudgetSolution:
    """N, p_i and K_i for one batch. Vectorised over requests; the loops are over solver iterations only.

    With a price per drafted step (c_spec > 0), every pass of a batch that drafts costs c_base + c_spec, so the
    optimum is solved with that fixed cost and kept only if it beats not drafting at all: (c_base + c_spec) N* +
    c_tok sum p_i* < c_base max_i l_i (the c_tok sum l_i both pay is left out). Otherwise no request drafts this
    step: a drafted step that verifies a few cheap tokens can still cost more than it saves."""
    c_spec = batch.c_spec_s
    solution = _solve(batch, batch.c_base_s + c_spec)
    if c_spec > 0.0 and solution.proposed.size and solution.draft_lengths.any():
        l_max = float(batch.remaining[batch.remaining.argmax()])
        drafted = (batch.c_base_s + c_spec) * solution.n_forward + batch.c_tok_s * float(solution.proposed.sum())
        if drafted >= batch.c_base_s * l_max:
            n = len(batch)
            return BudgetSolution(l_max, np.zeros(n), np.zeros(n, dtype=np.int32), False, np.full(n, np.inf))
    return solution


def _solve(batch: BatchState, c_base: float) -> BudgetSolution:
    """`solve_budget` with the step's fixed cost `c_base` (seconds) in place of the batch's."""
    rem = batch.remaining
    n = rem.size
    k_max = batch.k_max
    # maxima as x[x.argmax()] and sums as dot products throughout: numpy's max() and sum() go through
    # ufunc.reduce, about 3x the overhead of argmax() and dot() at these sizes, and overhead is the cost here
    l_max = float(rem[rem.argmax()]) if n else 0.0
    if n == 0 or l_max == 0.0 or k_max == 0 or c_base == 0.0:
        # nothing to speed up, drafts impossible, or forward passes free: the batch runs without drafts
        return BudgetSolution(l_max, np.zeros(n), np.zeros(n, dtype=np.int32), False, np.full(n, np.inf))
    kl = batch.capacity * rem      # k_i l_i: tokens drafts can cover at best
    b = rem - kl                   # b_i: passes request i needs however much it drafts
    w = rem / batch.efficiency     # w_i = l_i / a_i (tokens)
    r = c_base / batch.c_tok_s if batch.c_tok_s > 0.0 else np.inf
    if r == 0.0 or 1.0 / r == np.inf:   # c_base / c_tok underflowed (or nearly): same as c_base = 0
        return BudgetSolution(l_max, np.zeros(n), np.zeros(n, dtype=np.int32), False, np.full(n, np.inf))
    if r == np.inf:                # drafts free: the limit c_tok -> 0+ is the K_max-capped optimum
        x = _cap_forward_count(0.0, batch, b, kl, w)
        p = _proposed(x, rem, b, w)
        capped = True
        marginal = np.where(p > 0.0, 0.0, np.inf)  # drafts free: every token is worth verifying
    else:
        x = _forward_count(rem, b, w, r, l_max)
        p = _proposed(x, rem, b, w)
        # the uncapped optimum's marginal: c_tok / lambda_i with lambda_i the value of one pass less for request
        # i; K_max limits how many tokens one step verifies, not what one token is worth
        marginal = np.full(n, np.inf)
        np.divide(x - b, w, out=marginal, where=p > 0.0)  # p_i > 0 means l_i > x > 0, so w_i > 0
        capped = float(p[p.argmax()]) > k_max * x
        if capped:
            x = _cap_forward_count(x, batch, b, kl, w)
            p = _proposed(x, rem, b, w)
            marginal[p <= 0.0] = np.inf
    k = p * (1.0 / x)
    np.rint(k, out=k)
    np.minimum(k, k_max, out=k)
    return BudgetSolution(x, p, k.astype(np.int32), capped, marginal)


def _proposed(x: float, rem: np.ndarray, b: np.ndarray, w: np.ndarray) -> np.ndarray:
    """p_i(N = x) = w_i ln(k_i l_i / (x - b_i)) = w_i log1p((l_i - x) / (x - b_i)) tokens, and 0 where l_i <= x.
    The log1p form is exactly 0 at l_i = x (k_i l_i / (x - b_i) can round to 1 + ulp) and accurate near it."""
    p = rem - x
    p /= x - b
    np.maximum(p, 0.0, out=p)
    np.log1p(p, out=p)
    p *= w
    return p


def _forward_count(rem: np.ndarray, b: np.ndarray, w: np.ndarray, r: float, l_max: float) -> float:
    """N* = inf {N : g(N) <= r}, g(N) = sum_{l_i > N} w_i / (N - b_i); r > 0 (tokens). Returns passes (float).

    Invariants: every N < lo has g(N) > r, and g(hi) <= r, so lo <= N* <= hi throughout.
    """
    t = w * (1.0 / r)
    t += b
    np.minimum(t, rem, out=t)
    # floored at max_i b_i + _OFFSET max_i l_i so that N - b_i stays > 0 in floating point for every request
    lo = max(float(t[t.argmax()]), float(b[b.argmax()]) + _OFFSET * l_max)
    sel = rem > lo                  # only these can be active at any N >= lo
    lc = rem[sel]
    n = lc.size
    if n == 0:
        return lo
    order = lc.argsort()
    lc = lc[order]                  # ascending, so the active set {l_i > N} is a suffix
    bc = b[sel][order]
    wc = w[sel][order]
    hi = float(lc[-1])
    # bracket widths after the previous two evaluations: Newton steps that do not halve the bracket in two
    # evaluations (they zigzag when many terms drop inside it) give way to a breakpoint bisection step
    width_2, width_1 = np.inf, np.inf
    x = lo
    for _ in range(_MAX_ITER):
        j = int(lc.searchsorted(x, "right"))
        if j < n:
            inv = x - bc[j:]
            np.divide(1.0, inv, out=inv)    # 1 / (N - b_i) over the active terms
            wj = wc[j:]
            g = float(inv.dot(wj))
            inv *= inv
            g1 = float(inv.dot(wj))         # -g'(N) = sum w_i / (N - b_i)^2
        else:
            g = g1 = 0.0
        if g > r:
            lo = x
        else:
            hi = x
            if hi <= lo * (1.0 + _TOL):
                return hi
        stalled = hi - lo > 0.5 * width_2
        width_2, width_1 = width_1, hi - lo
        if g > r:
            # Newton on 1/g with the terms active at x: x + g (g - r) / (r * -g'(x)); never past their root
            xn = x + g * (g - r) / (r * g1)
            nxt = float(lc[j])      # the next breakpoint: g is smooth on [x, nxt)
            if xn < nxt:
                if xn - x <= _TOL * xn:
                    return xn
                x = xn
                continue
            # the step reaches nxt, so g > r on [x, nxt) (tangent argument): N* >= nxt
            if nxt >= hi:
                return hi           # hi == nxt: a kink optimum
            if xn < hi and not stalled:
                x = xn              # trial: terms drop past nxt, g(xn) decides which side it is on
                continue
        elif g > 0.0:
            # Newton on 1/g from the right with the terms active at hi: the step lands at a point where
            # those terms alone (and so g) are >= r, i.e. still <= N*
            xr = x + g * (g - r) / (r * g1)
            if xr >= hi * (1.0 - _TOL):
                return hi
            if xr > lo and not stalled:
                x = xr
                continue
        # breakpoints inside (lo, hi) defeat the Newton steps: bisect on their rank (the median one halves
        # them); with none inside, g is smooth there and plain bisection is the fallback
        jb = int(lc.searchsorted(lo, "right"))
        jh = int(lc.searchsorted(hi, "left"))
        x = float(lc[jb + (jh - jb - 1) // 2]) if jh > jb else 0.5 * (lo + hi)
    return hi


def _cap_forward_count(x: float, batch: BatchState, b: np.ndarray, kl: np.ndarray, w: np.ndarray) -> float:
    """N_cap: the smallest N with max_i p_i(N) <= K_max N, found from x <= N_cap (or from the bound below, if
    larger) by Newton from the left on the convex decreasing phi(N) = max_i p_i(N) - K_max N. Passes (float).

    Start: request i alone needs N_i = b_i + d_i with d_i = T(d_i), T(d) = k_i l_i exp(-K_max a_i (b_i + d) / l_i)
    (p_i = K_max N solved for N - b_i). T is decreasing and d_i >= 0, so T(0) >= d_i and T(T(0)) <= d_i: the
    start max_i (b_i + T(T(0))) <= N_cap is close to it, and Newton needs 2-3 steps from there.
    """
    k_max = batch.k_max
    rem = batch.remaining
    cap = batch.capacity
    ka = k_max * batch.efficiency
    t0 = ka * (1.0 - cap)          # K_max a_i b_i / l_i
    t1 = np.exp(-t0)
    t1 *= cap
    t1 *= ka
    t1 += t0                       # K_max a_i (b_i + T(0)) / l_i
    d = np.exp(-t1)
    d *= kl
    d += b                         # b_i + T(T(0)) <= N_i <= N_cap
    # floored like the main solver's start, so that N - b_i stays > 0 in floating point
    x = max(x, float(d[d.argmax()]), float(b[b.argmax()]) + _OFFSET * float(rem[rem.argmax()]))
    for _ in range(_MAX_ITER):
        p = _proposed(x, rem, b, w)
        i = int(p.argmax())
        phi = float(p[i]) - k_max * x
        if phi <= _TOL * k_max * x:
            break
        x += phi / (float(w[i]) / (x - float(b[i])) + k_max)   # -phi'(x) = w_i / (x - b_i) + K_max
    return x


@dataclass(frozen=True)
class DrafterParams:
    """Per-request drafter parameters for the budget model: capacity k_i in (0, 1), efficiency a_i > 0; and
    `unmeasured` (None, or a bool each): requests whose estimate rests on too few drafts of their own, which
    bounded exploration may give a draft token the optimum did not (scheduler/exploration.py)."""

    capacity: np.ndarray
    efficiency: np.ndarray
    unmeasured: np.ndarray | None = None
    measured: float = np.inf  # first-position drafts the engine has verified (pooled); inf: not tracked


def estimate_drafter_params(proposed: np.ndarray, accepted: np.ndarray, *, prior_capacity: float = 0.5,
                            prior_steps: float = 4.0, prior_q: np.ndarray | None = None) -> DrafterParams:
    """k_i and a_i from per-position acceptance counts.

    proposed[i, j]: verification steps of request i in which draft position j+1 was proposed; accepted[i, j]:
    steps in which position j+1 was accepted (so were positions 1..j). 1-D input is one request. J (the
    number of positions) should be the K_max the estimate is used with.

    The model A = k l (1 - e^{-a p / l}) has two observable features, and each gives one parameter:
      * saturation: drafting J tokens every step, a step advances 1 + E tokens with E = sum_j q_j, q_j the
        probability that position j is accepted; the share of tokens that are accepted drafts is then
        k = E / (1 + E);
      * initial slope: dA/dp at p = 0 is k a, and a lone draft token is accepted with probability q_1, so
        a = q_1 / k (and k a = q_1 <= 1).
    q_j is shrunk towards a geometric prior prior_capacity^j with the weight of prior_steps steps, so a request
    with no observations gets k ~ prior_capacity, a ~ 1, and the results are always valid BatchState inputs.
    `prior_q` (values in (0, 1], J of them or one row of J per request) replaces the geometric prior, e.g. the
    engine's pooled acceptance.
    """
    prop = np.asarray(proposed, dtype=np.float64)
    acc = np.asarray(accepted, dtype=np.float64)
    if prop.shape != acc.shape or prop.ndim not in (1, 2) or prop.shape[-1] == 0:
        raise ValueError(f"proposed and accepted must share a shape (J,) or (n, J) with J >= 1, "
                         f"got {prop.shape} and {acc.shape}")
    if not (np.all(np.isfinite(prop)) and np.all(np.isfinite(acc)) and np.all(acc >= 0)
            and np.all(acc <= prop)):
        raise ValueError("acceptance counts must be finite with 0 <= accepted <= proposed")
    if not (0 < prior_capacity < 1 and np.isfinite(prior_steps) and prior_steps > 0):
        raise ValueError("prior_capacity must be in (0, 1) and prior_steps > 0")
    if prior_q is None:
        prior = prior_capacity ** np.arange(1, prop.shape[-1] + 1)
    else:
        prior = np.asarray(prior_q, dtype=np.float64)
        if prior.shape not in ((prop.shape[-1],), prop.shape) or not (np.all(prior > 0) and np.all(prior <= 1)):
            raise ValueError(f"prior_q must be {prop.shape[-1]} values in (0, 1] (or one row per request), got "
                             f"{prior_q!r}")
    q = (acc + prior_steps * prior) / (prop + prior_steps)
    e = q.sum(axis=-1)
    capacity = e / (1.0 + e)
    return DrafterParams(capacity=capacity, efficiency=q[..., 0] / capacity)
