"""Score-calibrated chooser: a cell learns accepted / score (the draft's own expected accepted tokens), and a
candidate's value is its score times its cell's ratio (shrunk to 1 with pseudo-count PC on the score side).
python docs/results/2026-11-27-straggler/ratio.py TRACES K MODE   MODE: mean (the native rule) | ratio"""
import sys
from collections import defaultdict
import numpy as np
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from chooser import ChooserDrafter, match_bucket, PSEUDO_COUNT, HORIZON
from das.bench.drafter_replay import replay_arm
from das.drafter.history import accepted_prefix
from das.drafter.records import load_rollouts


class RatioDrafter(ChooserDrafter):
    def __init__(self, mode):
        super().__init__([0])
        self.mode = mode
        self.score_sums = defaultdict(float)

    def propose(self, request_id, context, max_tokens):
        bank = self.bank
        indices, kinds = bank._source_list(bank._requests[request_id].problem)
        ctx = np.ascontiguousarray(context, np.int32)
        candidates = []
        for index, kind in zip(indices, kinds):
            d = index.speculate(ctx, max_tokens, 0.0, 0.0, bank.config.prior)
            tokens = tuple(np.asarray(d.tokens).tolist())
            if tokens:
                candidates.append((kind, d.match_len, float(d.probs[0]), float(d.score), tokens))
        best, best_value, cells = (), -1.0, []
        for kind, match_len, first_prob, score, tokens in candidates:
            agree = min(3, sum(c[4][0] == tokens[0] for c in candidates))
            cell = (kind, match_bucket(match_len), min(7, int(first_prob * 8)), agree)
            if self.mode == "ratio":
                value = score * (self.sums[cell] + PSEUDO_COUNT) / (self.score_sums[cell] + PSEUDO_COUNT)
            else:
                value = (self.sums[cell] + PSEUDO_COUNT * score) / (self.counts[cell] + PSEUDO_COUNT)
            cells.append((cell, tokens, score))
            if value > best_value:
                best, best_value = tokens, value
        self.pending[request_id] = cells
        return np.asarray(best, np.int32)

    def extend(self, request_id, tokens):
        for cell, draft, score in self.pending.pop(request_id, ()):
            k = accepted_prefix(np.asarray(draft, np.int32), tokens)
            if self.counts[cell] >= HORIZON:
                keep = (HORIZON - 1) / HORIZON
                self.sums[cell] *= keep; self.counts[cell] *= keep; self.score_sums[cell] *= keep
            # censored: a draft scored against fewer committed tokens than its length counts its score only so far
            n = min(len(draft), len(tokens))
            self.sums[cell] += k
            self.counts[cell] += 1
            self.score_sums[cell] += score if n == len(draft) else score * n / len(draft)
        super(ChooserDrafter, self).extend(request_id, tokens)


if __name__ == "__main__":
    traces, k, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    stats = replay_arm(RatioDrafter(mode), load_rollouts(traces), k)
    print(f"K={k} mode={mode}: draft/step {stats.draft_tokens_per_step:.2f} tokens/step {stats.tokens_per_step:.3f}")
