"""Length prediction: the distribution of a request's final output length, given its problem's history and the
number of tokens it has generated so far.

Model. For problem p with held lengths x_1..x_n (``DifficultyBook.lengths``, the last few policy versions) the
predicted length L is drawn from a weighted empirical distribution: each x_i has weight 1, and the global prior
(all lengths held in the book, compressed to at most ``PRIOR_ATOMS`` quantile atoms) carries ``prior_weight``
pseudo-observations in total. A problem never seen is predicted from the prior alone; one with many rollouts
mostly from its own. After g tokens, L is conditioned on L > g: the atoms <= g are dropped and the rest
renormalised (the request is known to be longer than g).

Quantiles interpolate linearly between atoms at Weibull plotting positions: with unit weights the j-th of n
remaining lengths sits at quantile j/(n+1), which keeps [p10, p90] from being too narrow when n is small (at
n = 8 the Hazen positions (j-1/2)/n would cover 0.71 of the mass on average, Weibull's 0.78). For weighted atoms
the "+1" is one effective observation, sum(w^2)/sum(w) over the remaining atoms (Kish), so a prior-only forecast
is not distorted by it.

Tail model. When no atom lies above g (the request has run past every length the book holds), the remaining
length is extrapolated as proportional to g: L = g * (1 + r), with r's quantiles and mean taken from the relative
overshoots y / m - 1 of the global lengths y above the global median m. The overshoot is measured at m because
nothing is known above g, and it is assumed scale-free (a Pareto-like tail, where a request that ran long
is expected to run proportionally longer). With no such lengths, r = 1 (L = 2g: as long again as it ran so far).

All lengths are output tokens. Every predicted final length is >= generated + 1.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from das.drafter.records import RolloutRecord
from das.scheduler.difficulty import DifficultyBook

# The prior is a few pseudo-observations: 64 atoms (ranks 1/63 apart) resolve it far beyond its weight, and every
# distinct problem of a batch carries a copy of them.
PRIOR_ATOMS = 64
PRIOR_REFRESH = 0.01  # rebuild the prior after this fraction of its lengths changed (see _current_prior)
DEFAULT_PRIOR_WEIGHT = 2.0
_QUANTILES = (0.1, 0.5, 0.9)


@dataclass(frozen=True, slots=True, eq=False)  # eq=False: == on numpy fields would raise, not compare
class LengthForecast:
    """Predicted FINAL output length (tokens, float64, one entry per request, read-only arrays).

    Invariants: ``generated + 1 <= p10 <= p50 <= p90``; ``mean >= generated + 1``;
    ``remaining_mean = mean - generated``; ``extrapolated`` marks requests predicted by the tail model.
    """

    p10: np.ndarray
    p50: np.ndarray
    p90: np.ndarray
    mean: np.ndarray
    remaining_mean: np.ndarray
    extrapolated: np.ndarray

    def __len__(self) -> int:
        return len(self.p50)


@dataclass(frozen=True, slots=True)
class LengthCurve:
    """One problem's forecast of a sample's FINAL output length (tokens; the forecast's p90, what the budget plans
    with) as a function of the tokens the sample has generated so far, g: exactly `LengthPredictor.predict`'s p90
    at every g, in a form an engine evaluates per decode step without the difficulty book.

    Conditioning on L > g only changes the forecast where g passes a held length, so below `tail_from` it is a
    step function: ``ends[j]`` for the last j with ``starts[j] <= g``. From `tail_from` (the longest held length)
    on, the tail model: ``g * (1 + tail_ratio)``. Never below g + 1.

    Invariants (ValueError otherwise): `starts` are strictly increasing ints from 0, one finite end per start with
    ``ends[j] > starts[j]``; `tail_from` is 0 when there are no starts, else an int above the last start;
    `tail_ratio` is finite and >= 0.
    """

    starts: tuple[int, ...]
    ends: tuple[float, ...]
    tail_from: int
    tail_ratio: float

    def __post_init__(self) -> None:
        # Vectorised: an engine builds a curve for every request it starts (siblings each carry a copy).
        starts, ends = np.asarray(self.starts, np.int64), np.asarray(self.ends, np.float64)
        if starts.shape != ends.shape or starts.ndim != 1:
            raise ValueError(f"LengthCurve needs one end per start, got {starts.size} starts and {ends.size} ends")
        if starts.size and (starts[0] != 0 or bool((np.diff(starts) <= 0).any())):
            raise ValueError("LengthCurve.starts must be strictly increasing from 0")
        if not (np.isfinite(ends).all() and (ends > starts).all()):
            raise ValueError("LengthCurve.ends must be finite and above their starts")
        if (self.tail_from != 0) if not starts.size else self.tail_from <= starts[-1]:
            raise ValueError(f"LengthCurve.tail_from must be above the last start (0 without starts), "
                             f"got {self.tail_from}")
        if not (math.isfinite(self.tail_ratio) and self.tail_ratio >= 0):
            raise ValueError(f"LengthCurve.tail_ratio must be finite and >= 0, got {self.tail_ratio}")

    def at(self, generated: int) -> float:
        """Predicted final length of a sample with `generated` >= 0 output tokens so far. O(log len(starts))."""
        if generated >= self.tail_from:
            final = generated * (1.0 + self.tail_ratio)
        else:
            final = self.ends[bisect_right(self.starts, generated) - 1]
        return max(final, generated + 1.0)

    def to_dict(self) -> dict[str, Any]:
        return {"starts": list(self.starts), "ends": list(self.ends), "tail_from": self.tail_from,
                "tail_ratio": self.tail_ratio}

    @staticmethod
    def from_dict(raw: dict[str, Any]) -> LengthCurve:
        """Inverse of `to_dict`; ValueError for anything else."""
        try:
            return LengthCurve(tuple(map(int, raw["starts"])), tuple(map(float, raw["ends"])), int(raw["tail_from"]),
                               float(raw["tail_ratio"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a length curve: {exc!r}") from None


class LengthCurveTable:
    """The length curves of an engine's running requests, by slot (a small int per request), evaluated for a whole
    batch at once: `at(slots, generated)[r]` is `curve.at(generated[r])` for the curve of slots[r] (NaN where the
    slot has none). The budget reads one per request every decode step.

    Every curve's starts sit in one sorted pool of keys block * KEY_STRIDE + start (a block per curve, numbered in
    the order curves came), so one `searchsorted` finds every request's segment. Cost: O(n log pool) vectorised per
    call; `set` appends O(len(curve)); blocks of removed curves are dropped once they fill half the pool (O(pool)).
    """

    KEY_STRIDE = 1 << 32  # above any token count; block numbers stay far below 2**31

    def __init__(self) -> None:
        self._keys = np.zeros(0, np.int64)      # block * KEY_STRIDE + start, sorted
        self._ends = np.zeros(0, np.float64)    # the curve's end for each key
        self._block = np.full(16, -1, np.int64)  # by slot: its curve's block (-1: none)
        self._tail_from = np.zeros(16, np.int64)
        self._tail_ratio = np.zeros(16, np.float64)
        self._next_block = 0
        self._live_keys = 0

    def set(self, slot: int, curve: LengthCurve | None) -> None:
        """Gives `slot` this curve (None: no curve), replacing whatever it had."""
        self.clear(slot)
        if slot >= self._block.size:
            grow = max(slot + 1, 2 * self._block.size) - self._block.size
            self._block = np.concatenate([self._block, np.full(grow, -1, np.int64)])
            self._tail_from = np.concatenate([self._tail_from, np.zeros(grow, np.int64)])
            self._tail_ratio = np.concatenate([self._tail_ratio, np.zeros(grow)])
        if curve is None:
            return
        block = self._next_block
        self._next_block += 1
        # A curve without starts is all tail (tail_from 0); one key at 0 keeps every lookup inside its block.
        starts = np.asarray(curve.starts or (0,), np.int64)
        ends = np.asarray(curve.ends or (1.0,), np.float64)
        self._keys = np.concatenate([self._keys, block * self.KEY_STRIDE + starts])
        self._ends = np.concatenate([self._ends, ends])
        self._block[slot] = block
        self._tail_from[slot] = curve.tail_from
        self._tail_ratio[slot] = curve.tail_ratio
        self._live_keys += starts.size

    def clear(self, slot: int) -> None:
        """Forgets `slot`'s curve (if any)."""
        if slot < self._block.size and self._block[slot] >= 0:
            block = self._block[slot]
            lo, hi = np.searchsorted(self._keys, [block * self.KEY_STRIDE, (block + 1) * self.KEY_STRIDE])
            self._live_keys -= int(hi - lo)
            self._block[slot] = -1
            if 2 * self._live_keys < self._keys.size:
                self._compact()

    def at(self, slots: np.ndarray, generated: np.ndarray) -> np.ndarray:
        """float64 [n]: each slot's (>= 0) predicted final length at its `generated` (>= 0) output tokens; NaN
        where the slot has no curve."""
        slots = np.asarray(slots, np.int64)
        g = np.asarray(generated, np.int64)
        block = np.full(slots.size, -1, np.int64)
        inside = slots < self._block.size
        block[inside] = self._block[slots[inside]]
        has = block >= 0
        out = np.full(slots.size, np.nan)
        if not has.any():
            return out
        b, gen, s = block[has], g[has], slots[has]
        # a start is <= g for every g >= 0 (each block begins at 0), so the match stays in the slot's block
        found = self._ends[np.searchsorted(self._keys, b * self.KEY_STRIDE + gen, "right") - 1]
        tail = gen >= self._tail_from[s]
        final = np.where(tail, gen * (1.0 + self._tail_ratio[s]), found)
        out[has] = np.maximum(final, gen + 1.0)
        return out

    def _compact(self) -> None:
        """Drops the keys of removed curves and renumbers the live blocks 0.. in their order."""
        live = np.isin(self._keys // self.KEY_STRIDE, self._block[self._block >= 0])
        self._keys, self._ends = self._keys[live], self._ends[live]
        old = self._keys // self.KEY_STRIDE
        renumbered = np.cumsum(np.concatenate([[True], old[1:] != old[:-1]])) - 1 if old.size else old
        self._keys = renumbered * self.KEY_STRIDE + self._keys % self.KEY_STRIDE
        used = self._block >= 0
        self._block[used] = renumbered[np.searchsorted(old, self._block[used])] if old.size else -1
        self._next_block = int(renumbered[-1]) + 1 if old.size else 0


@dataclass(frozen=True, slots=True, eq=False)
class _Prior:
    atoms: np.ndarray  # sorted int64 lengths (tokens), each of weight prior_weight / len(atoms)
    tail: np.ndarray  # relative overshoot r at p10, p50, p90 and its mean (tail model)


class LengthPredictor:
    """Predicts final lengths from a ``DifficultyBook`` (see the module docstring for the model).

    The book is read at every call, so a problem's new rollouts count at once; the compressed global prior is
    rebuilt once the book has changed by ``PRIOR_REFRESH`` of its size (at every change for a small book).
    """

    def __init__(self, book: DifficultyBook, prior_weight: float = DEFAULT_PRIOR_WEIGHT) -> None:
        if not np.isfinite(prior_weight) or prior_weight < 0:
            raise ValueError(f"prior_weight must be a finite number >= 0, got {prior_weight!r}")
        self.book = book
        self.prior_weight = float(prior_weight)
        self._prior: _Prior | None = None
        self._prior_key = 0  # book.revision and number of lengths when the prior was built
        self._prior_size = 0

    def predict(self, problem_ids: Sequence[str], generated: np.ndarray | Sequence[int]) -> LengthForecast:
        """Forecast the final length of each request i of problem ``problem_ids[i]`` that has generated
        ``generated[i]`` >= 0 tokens so far (and has not finished). ``generated`` holds ints (or integer-valued
        floats).

        Cost: for B requests over P distinct problems with n_p held lengths each, O(B log B + N log N) numpy
        work with N = sum_p (n_p + K), K = min(PRIOR_ATOMS, M) (every problem's support is its own lengths plus
        the prior atoms, all sorted in one pass); plus O(M log M) when the prior is rebuilt, M = all lengths held
        (amortized O(log M / PRIOR_REFRESH) per change of the book). The only Python loop gathers the lengths of
        the P distinct problems.
        """
        ids = np.asarray(problem_ids, dtype=str)
        g = np.asarray(generated)
        if ids.ndim != 1 or g.ndim != 1 or len(ids) != len(g):
            raise ValueError(f"need two 1-D sequences of equal length, got shapes {ids.shape} and {g.shape}")
        # Integer-valued floats are accepted (np.zeros(n) is a natural "nothing generated yet"); 1.5 tokens is not.
        integral = g.dtype.kind in "iu" or (g.dtype.kind == "f" and bool(np.all(np.isfinite(g) & (g == np.round(g)))))
        if g.size and (not integral or g.min() < 0):
            raise ValueError("generated must hold integer token counts >= 0")
        g = g.astype(np.int64)
        prior = self._current_prior()
        uniq, block = np.unique(ids, return_inverse=True)
        own = [self.book.lengths(str(pid)) for pid in uniq]
        n_own = np.array([len(o) for o in own], dtype=np.int64)
        n_prior = len(prior.atoms) if self.prior_weight > 0 else 0
        # One flat support for all problems: block b holds problem uniq[b]'s lengths and a copy of the prior atoms,
        # sorted by the exact int64 key b * span + length, so one argsort and one searchsorted serve every problem.
        # The sort is stable and own lengths are laid out first: on equal lengths they precede the prior's atoms,
        # which fixes where a run of ties starts (its first atom's weight) and so the interpolation next to it.
        values = np.concatenate([*own, np.tile(prior.atoms, len(uniq)) if n_prior else np.zeros(0, np.int64)])
        owner = np.concatenate([np.repeat(np.arange(len(uniq)), n_own), np.repeat(np.arange(len(uniq)), n_prior)])
        weights = np.concatenate([np.ones(n_own.sum()),
                                  np.full(n_prior * len(uniq), self.prior_weight / max(n_prior, 1))])
        span = int(values.max(initial=0)) + 1
        keys = owner * span + values
        order = np.argsort(keys, kind="stable")
        keys, v, w = keys[order], values[order].astype(np.float64), weights[order]
        zero = np.zeros(1)
        cw = np.concatenate([zero, np.cumsum(w)])  # cw[j] = weight of the first j atoms of the flat support
        cw2 = np.concatenate([zero, np.cumsum(w * w)])
        cvw = np.concatenate([zero, np.cumsum(v * w)])
        block_end = np.cumsum(n_own + n_prior)[block]  # flat index past each request's block
        # First atom > g in the request's block (g is capped at span - 1 so the search cannot leave the block).
        first = np.searchsorted(keys, block * span + np.minimum(g, span - 1), side="right")
        tail = first == block_end
        out = np.empty((4, len(g)))  # p10, p50, p90, mean
        out[:, tail] = g[tail] * (1 + prior.tail[:, None])
        if not tail.all():  # (np.interp refuses an empty support even for no points)
            f, e = first[~tail], block_end[~tail]
            remaining = cw[e] - cw[f]
            extra = (cw2[e] - cw2[f]) / remaining  # one effective observation (Kish) of the remaining atoms
            for row, q in enumerate(_QUANTILES):
                # Atom j sits at cumulative weight cw[j + 1]. Clipping to the first and last remaining atoms keeps
                # the interpolation inside the block: beyond them it would reach dropped atoms or the next problem.
                target = np.clip(cw[f] + q * (remaining + extra), cw[f + 1], cw[e])
                out[row, ~tail] = np.interp(target, cw[1:], v)
            out[3, ~tail] = (cvw[e] - cvw[f]) / remaining
        # Atoms above g are integers > g and the tail model gives >= g; the clamp enforces the invariant in both.
        out = np.maximum(out, g + 1)
        arrays = [*out, out[3] - g, tail]
        for arr in arrays:
            arr.flags.writeable = False
        return LengthForecast(*arrays)

    def curves(self, problem_ids: Sequence[str]) -> list[LengthCurve]:
        """`predict(...).p90` at every g for each entry of `problem_ids`, as curves (one object per distinct
        problem; see LengthCurve). Cost: one `predict` over the distinct lengths of each problem's support."""
        prior = self._current_prior()
        uniq = list(dict.fromkeys(problem_ids))
        prior_atoms = prior.atoms if self.prior_weight > 0 else np.zeros(0, np.int64)
        # The support predict() conditions on: the problem's own lengths and the prior's atoms. The forecast
        # changes only where g reaches one of them, and from the largest on the tail model takes over.
        tops, starts = [], []
        for pid in uniq:
            support = np.unique(np.concatenate([self.book.lengths(pid), prior_atoms]))
            top = int(support[-1]) if len(support) else 0
            tops.append(top)
            starts.append(np.unique(np.concatenate([[0], support[support < top]])) if top > 0
                          else np.zeros(0, np.int64))
        sizes = [len(st) for st in starts]
        p90 = (self.predict(np.repeat(np.asarray(uniq, dtype=str), sizes), np.concatenate(starts)).p90
               if sum(sizes) else np.zeros(0))
        tail_ratio = float(prior.tail[_QUANTILES.index(0.9)])
        by_id = {pid: LengthCurve(tuple(int(g) for g in st), tuple(float(e) for e in ends), top, tail_ratio)
                 for pid, st, ends, top in zip(uniq, starts, np.split(p90, np.cumsum(sizes)[:-1]), tops)}
        return [by_id[pid] for pid in problem_ids]

    def _current_prior(self) -> _Prior:
        # Rebuilding costs O(M log M), and rollouts finish all the time: a big book would pay it at every call. The
        # prior is a smoothing term of a few pseudo-observations, so it is refreshed once the book has changed by
        # PRIOR_REFRESH of its size (at every change while it holds fewer than 1 / PRIOR_REFRESH lengths).
        changes = self.book.revision - self._prior_key
        if self._prior is None or changes > PRIOR_REFRESH * self._prior_size:
            lengths = self.book.all_lengths()
            self._prior = _build_prior(lengths)
            self._prior_key, self._prior_size = self.book.revision, len(lengths)
        return self._prior


def _build_prior(lengths: np.ndarray) -> _Prior:
    y = np.sort(lengths)
    # Observed lengths at evenly spaced ranks, min and max included: integers, so the flat keys stay exact.
    atoms = y if len(y) <= PRIOR_ATOMS else y[np.round(np.linspace(0, len(y) - 1, PRIOR_ATOMS)).astype(np.int64)]
    tail = np.ones(4)
    if len(y):
        m = float(np.median(y))
        over = y[y > m] / m - 1 if m > 0 else np.zeros(0)
        if len(over):
            tail = np.array([*np.quantile(over, _QUANTILES), over.mean()])
    return _Prior(atoms, tail)


def calibration_report(records: Iterable[RolloutRecord], warm_versions: int = 1, *,
                       prior_weight: float = DEFAULT_PRIOR_WEIGHT, step_stride: int = 16,
                       **book_bounds: Any) -> dict[str, Any]:
    """Replay history version by version and score the predictor on each unseen version.

    For each policy version v after the first ``warm_versions`` (in increasing order), a book fitted on all
    versions < v (bounded by its window) predicts the rollouts of version v, in three settings:

    - ``g0``: at g = 0, before a rollout starts;
    - ``g_half``: at g = its true length L // 2. Beware: g is chosen from L, so even a perfect predictor is not
      at 0.8 coverage here (e.g. a heavy tail puts 2g = L under the conditional p90 almost always);
    - ``g_steps``: at every g in 0, step_stride, 2 * step_stride, ... < L, each (rollout, g) pair counted once.
      This is what a scheduler asks during decoding, and the setting where a perfect predictor is calibrated:
      among the pairs with a given g, L follows the length distribution conditioned on L > g.

    Per setting: ``pairs`` scored, ``coverage`` (fraction of true lengths in [p10, p90]; ideal 0.8),
    ``below_p10`` and ``above_p90`` (ideal 0.1 each), and ``median_abs_rel_error`` of p50,
    |p50 - L| / max(L, 1). Lengths in tokens; ``book_bounds`` go to ``DifficultyBook`` (window, max_per_version).
    """
    if not isinstance(step_stride, int) or step_stride < 1:
        raise ValueError(f"step_stride must be an int >= 1, got {step_stride!r}")
    by_version: dict[int, list[RolloutRecord]] = {}
    for rec in records:
        by_version.setdefault(rec.policy_version, []).append(rec)
    versions = sorted(by_version)
    if not 1 <= warm_versions < len(versions):
        raise ValueError(f"need warm_versions in [1, {len(versions) - 1}] for {len(versions)} policy versions, "
                         f"got {warm_versions}")
    book = DifficultyBook(**book_bounds)
    predictor = LengthPredictor(book, prior_weight)
    scored: dict[str, list[tuple[np.ndarray, LengthForecast]]] = {"g0": [], "g_half": [], "g_steps": []}
    for i, v in enumerate(versions):
        recs = by_version[v]
        if i >= warm_versions:
            ids = np.array([r.problem_id for r in recs])
            true = np.array([len(r.output_token_ids) for r in recs], dtype=np.int64)
            scored["g0"].append((true, predictor.predict(ids, np.zeros_like(true))))
            scored["g_half"].append((true, predictor.predict(ids, true // 2)))
            steps = -(-true // step_stride)  # ceil: the g values 0, stride, ... below L
            offsets = np.arange(steps.sum()) - np.repeat(np.cumsum(steps) - steps, steps)
            scored["g_steps"].append((np.repeat(true, steps),
                                      predictor.predict(np.repeat(ids, steps), offsets * step_stride)))
        book.add_records(recs)
    report: dict[str, Any] = {"versions_evaluated": versions[warm_versions:], "warm_versions": warm_versions,
                              "prior_weight": prior_weight, "step_stride": step_stride}
    for name, parts in scored.items():
        true = np.concatenate([t for t, _ in parts]).astype(np.float64)
        p10, p50, p90 = (np.concatenate([getattr(f, a) for _, f in parts]) for a in ("p10", "p50", "p90"))
        report[name] = {
            "pairs": len(true),
            "coverage": float(np.mean((p10 <= true) & (true <= p90))),
            "below_p10": float(np.mean(true < p10)),
            "above_p90": float(np.mean(true > p90)),
            "median_abs_rel_error": float(np.median(np.abs(p50 - true) / np.maximum(true, 1))),
        }
    return report
