"""Two-sample tests for `das bench e2e`: does an arm change what the model outputs?

Speculative decoding with exact verification must leave the output distribution alone, so every arm's rewards and
output lengths are compared with the baseline arm's. The samples are not independent draws from one distribution:
the same problem's samples share its difficulty, and epochs (with policy drift) and repeats differ. So both tests
are **stratified permutation tests**: under the null hypothesis (the arm does not change the distribution) the
arm labels are exchangeable among the samples of one stratum (repeat, epoch, problem), and the p-value is the
share of within-stratum relabellings whose statistic is at least as extreme as the observed one ((count + 1) /
(permutations + 1), so never 0). This needs no distributional assumption, holds with the ties that the
max-tokens cap puts at the top of the length distribution, and respects the clustering by problem.

- rewards: statistic = difference of mean rewards (arm - baseline); plus a stratified bootstrap 95% interval of it
  (each arm's samples resampled with replacement within each stratum).
- lengths: statistic = the two-sample Kolmogorov-Smirnov distance D = max |F_arm - F_baseline| of the output
  lengths' empirical distribution functions (sensitive to a changed tail as well as a shifted middle).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

PERMUTATIONS = 2000
BOOTSTRAPS = 2000


@dataclass(frozen=True)
class RewardTest:
    """Mean reward of the arm minus the baseline's, its 95% bootstrap interval, and the permutation p-value."""

    difference: float
    ci_low: float
    ci_high: float
    p_value: float


@dataclass(frozen=True)
class LengthTest:
    """Kolmogorov-Smirnov distance of the output-length distributions (0..1) and its permutation p-value."""

    ks_distance: float
    p_value: float


class _Design:
    """Two samples pooled and sorted by stratum, with the mask of the positions that belong to the first sample
    when every stratum keeps its own counts (so a within-stratum shuffle of the pooled values is a relabelling)."""

    def __init__(self, a: Sequence[float], a_strata: Sequence[Hashable], b: Sequence[float],
                 b_strata: Sequence[Hashable]) -> None:
        if len(a) != len(a_strata) or len(b) != len(b_strata):
            raise ValueError("each value needs its stratum")
        if not len(a) or not len(b):
            raise ValueError("both samples need at least one value")
        codes: dict[Hashable, int] = {}
        strata = np.array([codes.setdefault(s, len(codes)) for s in (*a_strata, *b_strata)], np.int64)
        values = np.asarray([*a, *b], np.float64)
        is_a = np.zeros(len(values), bool)
        is_a[:len(a)] = True
        order = np.argsort(strata, kind="stable")  # within a stratum, a's values come first
        self.values, self.strata, self.is_a = values[order], strata[order], is_a[order]

    def shuffled(self, rng: np.random.Generator) -> np.ndarray:
        """The pooled values shuffled within each stratum (the strata stay in place)."""
        return self.values[np.lexsort((rng.random(len(self.values)), self.strata))]

    def p_value(self, statistic: Callable[[np.ndarray, np.ndarray], float], permutations: int,
                rng: np.random.Generator) -> tuple[float, float]:
        """(observed statistic, two-sided permutation p-value of |statistic|)."""
        observed = statistic(self.values[self.is_a], self.values[~self.is_a])
        extreme = 0
        for _ in range(permutations):
            v = self.shuffled(rng)
            # a tolerance, so that relabellings equal to the observed value up to rounding count as extreme
            extreme += abs(statistic(v[self.is_a], v[~self.is_a])) >= abs(observed) - 1e-12
        return observed, (extreme + 1) / (permutations + 1)


def ks_distance(a: np.ndarray, b: np.ndarray) -> float:
    """max over x of |F_a(x) - F_b(x)|, the empirical distribution functions of a and b."""
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    fa = np.searchsorted(a, grid, side="right") / len(a)
    fb = np.searchsorted(b, grid, side="right") / len(b)
    return float(np.max(np.abs(fa - fb)))


def _mean_difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(b.mean() - a.mean())


def reward_test(baseline: Sequence[float], baseline_strata: Sequence[Hashable], arm: Sequence[float],
                arm_strata: Sequence[Hashable], *, permutations: int = PERMUTATIONS, bootstraps: int = BOOTSTRAPS,
                seed: int = 0) -> RewardTest:
    """Is the arm's mean reward different from the baseline's? Strata name each sample's (repeat, epoch,
    problem)."""
    rng = np.random.default_rng(seed)
    design = _Design(baseline, baseline_strata, arm, arm_strata)
    difference, p = design.p_value(_mean_difference, permutations, rng)
    low, high = _bootstrap_interval(design, bootstraps, rng)
    return RewardTest(round(difference, 5), round(low, 5), round(high, 5), round(p, 5))


def length_test(baseline: Sequence[float], baseline_strata: Sequence[Hashable], arm: Sequence[float],
                arm_strata: Sequence[Hashable], *, permutations: int = PERMUTATIONS, seed: int = 0) -> LengthTest:
    """Does the arm's output-length distribution differ from the baseline's (two-sample Kolmogorov-Smirnov)?"""
    rng = np.random.default_rng(seed)
    d, p = _Design(baseline, baseline_strata, arm, arm_strata).p_value(ks_distance, permutations, rng)
    return LengthTest(round(d, 5), round(p, 5))


def _bootstrap_interval(design: _Design, bootstraps: int, rng: np.random.Generator) -> tuple[float, float]:
    """95% percentile interval of mean(arm) - mean(baseline), resampling each arm within each stratum."""
    means = []
    for mask in (design.is_a, ~design.is_a):
        values, strata = design.values[mask], design.strata[mask]
        # values are sorted by stratum: each stratum is the slice [start, start + count)
        _, start, count = np.unique(strata, return_index=True, return_counts=True)
        starts, counts = np.repeat(start, count), np.repeat(count, count)
        picks = starts + np.floor(rng.random((bootstraps, len(values))) * counts).astype(np.int64)
        means.append(values[picks].mean(axis=1))
    low, high = np.percentile(means[1] - means[0], [2.5, 97.5])
    return float(low), float(high)
