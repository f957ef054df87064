"""Does a sample's acceptance over its first G tokens tell its final length, beyond what the forecast knows (the
problem's history and L > G)? Replays every batch at uniform K = 4 (every request drafts every step) and records,
per sample, draft tokens proposed and accepted before position G; then, within each group, among the samples
still running at G, the rank correlation of the acceptance rate with the final length.
python acceptance_signal.py G1,G2,... TRACES..."""
import sys

import numpy as np

sys.path.insert(0, "../2026-11-27-length-signals")
sys.path.insert(0, "../2026-11-27-eos-signal")
from eos_signal import spearman  # noqa: E402
from patched import patched_simulate_batch, simulate_with  # noqa: E402

from das.drafter.records import load_rollouts  # noqa: E402
from das.scheduler.cost_model import load_cost_model  # noqa: E402

STATS: list[tuple] = []
COUNT = ("        counts.record(slot[active], drafted, accepted)\n",
         "        counts.record(slot[active], drafted, accepted)\n"
         "        TRACK.setdefault(id(finish), [np.zeros((len(batch), GMAX + 1)), np.zeros((len(batch), GMAX + 1))])\n"
         "        d_at, a_at = TRACK[id(finish)]\n"
         "        at_pos = np.minimum(pos[active] - advanced, GMAX)\n"
         "        d_at[active, at_pos] += drafted\n"
         "        a_at[active, at_pos] += accepted\n")
END = ("    makespan = float(finish.max())\n",
       "    makespan = float(finish.max())\n"
       "    STATS.append((problems, lengths.copy(), *TRACK.pop(id(finish))))\n")
gs = [int(g) for g in sys.argv[1].split(",")]
GMAX = max(gs)
fn = patched_simulate_batch(COUNT, END, STATS=STATS, TRACK={}, GMAX=GMAX)
for traces in sys.argv[2:]:
    STATS.clear()
    simulate_with(fn, load_rollouts(traces), load_cost_model("h100-7b"), 8, "uniform-4")
    for g in gs:
        rhos, weights, hi, lo = [], [], [], []
        for problems, lengths, d_at, a_at in STATS:
            rate = a_at[:, :g].sum(1) / np.maximum(d_at[:, :g].sum(1), 1)
            groups: dict[str, list[int]] = {}
            for i, p in enumerate(problems):
                if lengths[i] > g:
                    groups.setdefault(p, []).append(i)
            for members in groups.values():
                if len(members) >= 4 and len(set(lengths[members])) > 1:
                    rho = spearman(rate[members], lengths[members])
                    if np.isfinite(rho):
                        rhos.append(rho)
                        weights.append(len(members))
                    order = np.argsort(rate[members])
                    m = np.asarray(members)[order]
                    lo.append(np.mean(lengths[m[: len(m) // 2]]))
                    hi.append(np.mean(lengths[m[len(m) - len(m) // 2:]]))
        print(f"{traces.split('/')[-1]} G={g}: {len(rhos)} groups, mean within-group Spearman(acceptance, length) "
              f"{np.average(rhos, weights=weights):+.3f} (median {np.median(rhos):+.3f}); mean length of the lower "
              f"half by acceptance {np.mean(lo):.0f}, upper half {np.mean(hi):.0f}", flush=True)
