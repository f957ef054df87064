"""Score-calibrated chooser: a cell learns accepted / score (the draft's own expected accepted tokens), and a
candidate's value is its score times its cell's ratio (shrunk to 1 with pseudo-count PSEUDO_COUNT on the score side).
python docs/results/2026-11-27-straggler/ratio.py TRACES K MODE   MODE: mean (the native rule) | ratio"""
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chooser import HORIZON, PSEUDO_COUNT, ChooserDrafter  # noqa: E402

from das.bench.drafter_replay import replay_arm  # noqa: E402
from das.drafter.records import load_rollouts  # noqa: E402


class RatioDrafter(ChooserDrafter):
    """chooser.py's candidates and table, valued as score x the cell's accepted / score."""

    def __init__(self):
        super().__init__([0])
        self.score_sums = defaultdict(float)

    def value(self, cell, score):
        return score * (self.sums[cell] + PSEUDO_COUNT) / (self.score_sums[cell] + PSEUDO_COUNT)

    def learn(self, cell, draft, score, committed, accepted):
        if self.counts[cell] >= HORIZON:
            self.score_sums[cell] *= (HORIZON - 1) / HORIZON
        super().learn(cell, draft, score, committed, accepted)
        # a draft scored against fewer committed tokens than its length counts its score only so far
        n = min(len(draft), len(committed))
        self.score_sums[cell] += score if n == len(draft) else score * n / len(draft)


if __name__ == "__main__":
    traces, k, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    drafter = RatioDrafter() if mode == "ratio" else ChooserDrafter([0])
    stats = replay_arm(drafter, load_rollouts(traces), k)
    print(f"K={k} mode={mode}: draft/step {stats.draft_tokens_per_step:.2f} tokens/step {stats.tokens_per_step:.3f}")
