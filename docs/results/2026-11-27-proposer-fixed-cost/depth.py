"""The suffix index's depth D against what the drafter finds and what a committed token costs: every trace set
replayed with DrafterConfig(max_depth=D) for each D (no budget: every step drafts up to K tokens).
python depth.py K D[,D...] TRACES...   prints tokens per step, draft tokens per step, extend us per committed
token and speculate p50 / p99 us per (set, D)."""
import sys

from das.bench.drafter_replay import DasDrafter, replay_arm
from das.drafter.history import DrafterConfig
from das.drafter.records import load_rollouts

k = int(sys.argv[1])
depths = [int(d) for d in sys.argv[2].split(",")]
for traces in sys.argv[3:]:
    records = load_rollouts(traces)
    for depth in depths:
        s = replay_arm(DasDrafter(DrafterConfig(max_depth=depth)), records, k)
        print(f"{traces.split('/')[-1]} D={depth}: tokens/step {s.tokens_per_step:.3f}, draft tokens/step "
              f"{s.draft_tokens_per_step:.2f}, extend {s.append_us_per_token:.2f} us/token, speculate p50 "
              f"{s.speculate_us_p50:.1f} p99 {s.speculate_us_p99:.1f} us", flush=True)
