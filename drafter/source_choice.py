"""Online calibration of draft sources: which candidate draft will really get the most tokens accepted.

Every decode step the bank drafts from each source of a request's problem (prompt, live siblings, sealed versions by
age, other problems). Their count-based scores are not comparable: one occurrence continuing deterministically
scores as high as a thousand that agree. So each candidate is described by its source kind, the length of its
matched context, the probability of its first token (with a pseudo-count, so thin evidence scores lower) and how
many sources propose the same first token. When the committed tokens come back, every candidate of that step is
scored against them, and a table learns the mean accepted tokens per cell. That table is also how acceptance by
segment age is measured: an age that stops paying loses the choice on its own.

A second table calibrates every draft token (P(accepted | the tokens before it were)); a draft stops before its
first token whose calibrated cumulative probability is under the request's floor, and the candidate with the most
expected accepted tokens net of that floor is proposed (the native `Calibrator`'s header explains the cells).

The tables and the per-step choice are native (`Calibrator`): O(sources^2 * K) beyond the drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

from das.drafter._suffix_index import Calibrator


class SourceChooser(Calibrator):
    """The native calibrator with names for its source kinds."""

    def __init__(self, kinds: Sequence[str], pseudo_count: float = 5.0, horizon: float = 2000.0) -> None:
        super().__init__(len(kinds), pseudo_count, horizon)
        self.kinds = list(kinds)
        self._kind = {k: i for i, k in enumerate(self.kinds)}

    def kind_index(self, kind: str) -> int:
        return self._kind[kind]

    def table(self) -> dict[str, dict[str, float]]:
        """Observation weight and mean accepted tokens per source kind (for reports)."""
        sums, counts = self.sums.reshape(len(self.kinds), -1), self.counts.reshape(len(self.kinds), -1)
        return {kind: {"observations": float(counts[i].sum()),
                       "mean_accepted": float(sums[i].sum() / counts[i].sum()) if counts[i].sum() else 0.0}
                for i, kind in enumerate(self.kinds)}
