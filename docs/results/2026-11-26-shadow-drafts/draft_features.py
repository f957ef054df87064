"""How a draft's acceptance depends on what the drafter knows when it proposes it (2026-11-26-shadow-drafts.md).

Replays a recorded history (default: the bundled SmolLM2 traces) version by version, the earlier versions sealed
in a HistoryBank and every sample of the version fed one token a step in lockstep (siblings see each other through
the live segment, as in the engine). Every third position of every sample proposes a draft of K tokens, which is
scored against the recorded continuation. Prints, by source, matched-context length and the index's own estimate
of the first token, the share of drafts whose tokens 1..j were all accepted, and how the index's cumulative
estimate at position j compares with what happened.

    .venv/bin/python docs/results/2026-11-26-shadow-drafts/draft_features.py [TRACES]
"""

from __future__ import annotations

import sys
from collections import defaultdict

import numpy as np

from das.drafter.history import DrafterConfig, HistoryBank, accepted_prefix
from das.drafter.records import load_rollouts

K = 8


def replay(path: str) -> list[tuple[str, int, np.ndarray, int, int]]:
    """(source, match_len, cumulative estimates, accepted, draft length) per proposal."""
    records = load_rollouts(path)
    by_version: dict[int, list] = defaultdict(list)
    for r in records:
        by_version[r.policy_version].append(r)
    rows = []
    for v in sorted(by_version)[1:]:
        bank = HistoryBank(DrafterConfig(window=4))
        bank.add_rollouts([r for u in by_version if u < v for r in by_version[u]])
        batch = by_version[v]
        ids = [f"{r.problem_id}/{r.sample_index}" for r in batch]
        full = [np.asarray(list(r.prompt_token_ids) + list(r.output_token_ids), np.int32) for r in batch]
        prompt = [len(r.prompt_token_ids) for r in batch]
        length = [len(r.output_token_ids) for r in batch]
        for i, r in enumerate(batch):
            bank.start_request(ids[i], r.problem_id, full[i][:prompt[i]], v)
        for t in range(max(length)):
            for i in range(len(batch)):
                if t >= length[i]:
                    continue
                at = prompt[i] + t
                if t % 3 == 0:
                    p = bank.propose(ids[i], full[i][max(0, at - 32):at], K)
                    if p.tokens.size:
                        rows.append((p.source, p.match_len, np.pad(p.probs, (0, K - p.probs.size)),
                                     accepted_prefix(p.tokens, full[i][at:at + p.tokens.size]), p.tokens.size))
                bank.extend(ids[i], full[i][at:at + 1])
    return rows


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/traces-smollm2.jsonl.gz"
    rows = replay(path)
    source = np.array([r[0] for r in rows])
    match = np.array([r[1] for r in rows])
    probs = np.array([r[2] for r in rows])
    accepted = np.array([r[3] for r in rows])
    drafted = np.array([r[4] for r in rows])
    print(f"{path}: {len(rows)} drafts of up to {K} tokens")
    print(f"{'drafts':32s} {'n':>6s} {'share':>5s} {'acc/draft':>9s}  P(tokens 1..j accepted), j = 1..{K}")

    def line(mask: np.ndarray, label: str) -> None:
        n = int(mask.sum())
        if n >= 30:
            held = " ".join(f"{(accepted[mask] >= j).mean():.2f}" for j in range(1, K + 1))
            print(f"{label:32s} {n:6d} {n / len(rows):5.2f} {accepted[mask].mean():9.2f}  {held}")

    line(np.ones(len(rows), bool), "all")
    for s in sorted(set(source)):
        line(source == s, f"source {s}")
    for lo, hi in [(1, 1), (2, 2), (3, 3), (4, 5), (6, 8), (9, 12), (13, 20), (21, 10**6)]:
        line((match >= lo) & (match <= hi), f"matched {lo}-{hi if hi < 10**6 else ''} tokens")
    for lo in np.arange(0.0, 1.0, 0.25):
        line((probs[:, 0] >= lo) & (probs[:, 0] < lo + 0.25), f"first-token estimate {lo:.2f}-{lo + 0.25:.2f}")
    print("index's cumulative estimate at position j -> share of drafts of >= j tokens with 1..j accepted [n]")
    for j in range(1, K + 1):
        m = drafted >= j
        est, held = probs[m, j - 1], accepted[m] >= j
        cells = [f"{lo:.1f}-{lo + 0.2:.1f}: {held[(est >= lo) & (est < lo + 0.2)].mean():.2f} "
                 f"[{int(((est >= lo) & (est < lo + 0.2)).sum())}]"
                 for lo in np.arange(0.0, 1.0, 0.2) if ((est >= lo) & (est < lo + 0.2)).sum() >= 20]
        print(f"  j={j}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
