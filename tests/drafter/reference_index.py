"""A deliberately naive pure-Python suffix index with the native index's API and semantics.

It exists to cross-check `das.drafter._suffix_index.SuffixIndex` in tests, so it favours obviousness over speed:
it counts every substring of length <= D in a dict (O(N * D) memory).

Semantics shared with the native index:
    occ(w)   = number of positions j over all stored sequences with s[j : j + |w|] == w, for 1 <= |w| <= D;
    next(w)  = sum over t of occ(w + t) (occurrences of w that continue);
    P(t | w) = occ(w + t) / (next(w) + prior);
    speculate(context, K, min_prob, match_factor, prior) matches the longest suffix w of the context with
    |w| <= max(1, min(len, D - K)) and next(w) > 0, then repeatedly appends the t maximising occ(w + t) (ties:
    smaller t) while |w| < D, at most K tokens (at most floor(match_factor * match length) when match_factor > 0),
    and while the running product of P(t | w) stays >= min_prob.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

_MAX_TOKEN = 2**31 - 1


@dataclass
class ReferenceDraft:
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0

    def __len__(self) -> int:
        return len(self.tokens)


class ReferenceSuffixIndex:
    """Counts of all substrings up to length max_depth, kept incrementally."""

    def __init__(self, max_depth: int = 64) -> None:
        if not 1 <= max_depth <= 255:
            raise ValueError(f"max_depth must be in [1, 255], got {max_depth}")
        self.max_depth = max_depth
        self._occ: Counter[tuple[int, ...]] = Counter()
        self._next: dict[tuple[int, ...], Counter[int]] = {}
        self._seqs: list[list[int] | None] = []
        self._sealed: set[int] = set()

    def new_sequence(self) -> int:
        self._seqs.append([])
        return len(self._seqs) - 1

    def _checked(self, seq_id: int) -> list[int]:
        if not 0 <= seq_id < len(self._seqs) or self._seqs[seq_id] is None:
            raise ValueError(f"unknown sequence id {seq_id}")
        return self._seqs[seq_id]  # type: ignore[return-value]

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        seq = self._checked(seq_id)
        if seq_id in self._sealed:
            raise ValueError(f"sequence {seq_id} is sealed")
        tokens = [int(t) for t in tokens]
        if any(not 0 <= t <= _MAX_TOKEN for t in tokens):
            raise ValueError("token id outside [0, 2147483647]")
        for t in tokens:
            seq.append(t)
            self._add_substrings_ending_at(seq, len(seq), +1)

    def seal(self, seq_id: int) -> None:
        self._checked(seq_id)
        self._sealed.add(seq_id)

    def remove(self, seq_id: int) -> None:
        seq = self._checked(seq_id)
        for end in range(1, len(seq) + 1):
            self._add_substrings_ending_at(seq, end, -1)
        self._seqs[seq_id] = None

    def _add_substrings_ending_at(self, seq: list[int], end: int, sign: int) -> None:
        for length in range(1, min(self.max_depth, end) + 1):
            w = tuple(seq[end - length : end])
            self._occ[w] += sign
            nxt = self._next.setdefault(w[:-1], Counter())
            nxt[w[-1]] += sign
            if self._occ[w] == 0:
                del self._occ[w]
                del nxt[w[-1]]

    def count(self, pattern: Sequence[int]) -> int:
        if not 0 < len(pattern) <= self.max_depth:
            return 0
        return self._occ.get(tuple(int(t) for t in pattern), 0)

    def contains(self, seq_id: int) -> bool:
        return 0 <= seq_id < len(self._seqs) and self._seqs[seq_id] is not None

    def sequence(self, seq_id: int) -> list[int]:
        return list(self._checked(seq_id))

    @property
    def num_sequences(self) -> int:
        return sum(s is not None for s in self._seqs)

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self._seqs if s is not None)

    def speculate(self, context: Sequence[int], max_tokens: int, min_prob: float = 0.0, match_factor: float = 0.0,
                  prior: float = 0.0) -> ReferenceDraft:
        draft = ReferenceDraft()
        context = [int(t) for t in context]
        if not context or max_tokens <= 0:
            return draft
        cap = max(1, min(len(context), self.max_depth, self.max_depth - max_tokens))
        match = next((m for m in range(cap, 0, -1) if self._next.get(tuple(context[-m:]))), 0)
        if match == 0:
            return draft
        draft.match_len = match
        if match_factor > 0:
            max_tokens = min(max_tokens, int(match_factor * match + 1e-9))
        w = tuple(context[-match:])
        prob = 1.0
        while len(draft.tokens) < max_tokens and len(w) < self.max_depth:
            nxt = self._next.get(w)
            if not nxt:
                break
            token = min(nxt, key=lambda t: (-nxt[t], t))
            prob *= nxt[token] / (sum(nxt.values()) + prior)
            if prob < min_prob:
                break
            draft.tokens.append(token)
            draft.probs.append(prob)
            draft.score += prob
            w = w + (token,)
        return draft
