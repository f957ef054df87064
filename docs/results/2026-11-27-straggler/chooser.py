"""Prototype source choosers for `das bench drafter`'s replay (bench/drafter_replay.py `replay_arm`).

python chooser.py TRACES K LENGTHS [ALPHA]
  LENGTHS: comma list of context caps per source, 0 = the longest match (0: the native chooser's candidates;
  0,8,4: also each source's drafts from its last 8 and 4 context tokens).
  ALPHA: also key the table by the request's recent agreement with each source kind (a recency-weighted share of
  that source's first draft tokens that held for this request, weight ALPHA, 4 buckets).

Candidates: every source of the problem (HistoryBank's list), one draft per context cap; a table keyed by (source
kind, matched-length bucket, first-token probability bucket, sources agreeing on the first token[, agreement
bucket]) learns the mean accepted tokens per cell (pseudo-count 5 on the draft's own score, fading after 2,000
observations, as the native calibrator); the best expected candidate is proposed, and every candidate is scored
against the tokens committed next."""
import sys
from collections import defaultdict

import numpy as np

from das.bench.drafter_replay import DasDrafter, replay_arm
from das.drafter.history import accepted_prefix
from das.drafter.records import load_rollouts

PSEUDO_COUNT, HORIZON = 5.0, 2000.0


def match_bucket(m):
    for b, upper in enumerate((1, 2, 3, 5, 8, 12, 20)):
        if m <= upper:
            return b
    return 7


class ChooserDrafter(DasDrafter):
    """DasDrafter's bank and sources, this file's choice among their candidates."""

    def __init__(self, caps, alpha=None):
        super().__init__(name="chooser")
        self.caps, self.alpha = caps, alpha
        self.sums, self.counts = defaultdict(float), defaultdict(float)
        self.agreement = defaultdict(lambda: 0.5)  # (request, source kind) -> recent share of first tokens held
        self.pending = {}  # request -> [(cell, draft tokens, kind, score)] of its last proposal

    def propose(self, request_id, context, max_tokens):
        bank = self.bank
        sources = bank._source_list(bank._requests[request_id].problem)
        indices, kinds = sources.indices, sources.kinds
        ctx = np.ascontiguousarray(context, np.int32)
        candidates = []
        for index, kind in zip(indices, kinds):
            seen = set()
            for cap in self.caps:
                d = index.speculate(ctx if cap == 0 else ctx[-cap:], max_tokens, 0.0, 0.0, bank.config.prior)
                tokens = tuple(np.asarray(d.tokens).tolist())
                if tokens and (tokens, d.match_len) not in seen:
                    seen.add((tokens, d.match_len))
                    candidates.append((kind, d.match_len, float(d.probs[0]), float(d.score), tokens))
        best, best_value, cells = (), -1.0, []
        for kind, match_len, first_prob, score, tokens in candidates:
            agree = min(3, sum(c[4][0] == tokens[0] for c in candidates))
            recent = min(3, int(self.agreement[(request_id, kind)] * 4)) if self.alpha is not None else 0
            cell = (kind, match_bucket(match_len), min(7, int(first_prob * 8)), agree, recent)
            value = self.value(cell, score)
            cells.append((cell, tokens, kind, score))
            if value > best_value:
                best, best_value = tokens, value
        self.pending[request_id] = cells
        return np.asarray(best, np.int32)

    def value(self, cell, score):
        """Expected accepted tokens of a candidate: its cell's mean, starting from PSEUDO_COUNT times its score."""
        return (self.sums[cell] + PSEUDO_COUNT * score) / (self.counts[cell] + PSEUDO_COUNT)

    def learn(self, cell, draft, score, committed, accepted):
        """A candidate of `cell` had `accepted` of its tokens committed (censored at the committed tokens)."""
        if self.counts[cell] >= HORIZON:
            self.sums[cell] *= (HORIZON - 1) / HORIZON
            self.counts[cell] *= (HORIZON - 1) / HORIZON
        self.sums[cell] += accepted
        self.counts[cell] += 1

    def extend(self, request_id, tokens):
        for cell, draft, kind, score in self.pending.pop(request_id, ()):
            k = accepted_prefix(np.asarray(draft, np.int32), tokens)  # censored at the committed tokens
            self.learn(cell, draft, score, tokens, k)
            if self.alpha is not None:
                key = (request_id, kind)
                self.agreement[key] = (1 - self.alpha) * self.agreement[key] + self.alpha * (k > 0)
        super().extend(request_id, tokens)


if __name__ == "__main__":
    traces, k, caps = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")]
    alpha = float(sys.argv[4]) if len(sys.argv) > 4 else None
    stats = replay_arm(ChooserDrafter(caps, alpha), load_rollouts(traces), k)
    print(f"K={k} caps={caps} alpha={alpha}: draft/step {stats.draft_tokens_per_step:.2f} "
          f"tokens/step {stats.tokens_per_step:.3f}")
