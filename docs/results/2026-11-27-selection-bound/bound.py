"""How far could better choice among the suffix matches take the drafter? A pure-Python model of suffix drafting on
a trace set, replayed request by request (every policy version after the first): at each step the context's longest
suffix (2 to 16 tokens) that occurs in the sources gives the candidates, every occurrence's continuation; a draft of
up to K tokens is taken from them, its accepted prefix plus one token advance the request. Sources: the problem's
rollouts of the earlier versions (prompt and output), its siblings' text up to the request's own position (lockstep,
an approximation of in-flight sharing) and the request's own text. Two choices among the same candidates:

- "frequency": the most frequent continuation, token by token among the candidates still agreeing (what a suffix
  tree's count-ranked path gives: a model of our drafter and Arctic's);
- "oracle choice": the candidate whose continuation agrees longest with what the request really generated next (an
  upper bound for any rule that picks one of these candidates, with the same draft lengths).

Prints tokens per step and draft tokens per step for each K, then the oracle's tokens per step over frequency's at
the oracle's draft tokens per step (frequency's frontier interpolated, anchored at (0, 1)).
--all-levels: the candidates of every matched suffix length, not only the longest (a looser bound).
python bound.py TRACES K[,K...] [--all-levels]"""
import sys
from collections import defaultdict

import numpy as np

from das.drafter.records import load_rollouts

MAX_MATCH, MIN_MATCH, CANDIDATES = 16, 2, 256


class Index:
    """Occurrences of every n-gram (n = MIN_MATCH..MAX_MATCH) in a set of sequences: key -> [(seq, end)]."""

    def __init__(self) -> None:
        self.seqs: list[np.ndarray] = []
        self.at: dict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)

    def add(self, tokens: np.ndarray) -> int:
        s = len(self.seqs)
        self.seqs.append(tokens)
        t = tokens.tolist()
        for end in range(MIN_MATCH, len(t)):  # an occurrence needs at least one token after it
            for n in range(MIN_MATCH, min(MAX_MATCH, end) + 1):
                self.at[tuple(t[end - n:end])].append((s, end))
        return s


def continuations(index: Index, context: list[int], limit: dict[int, int], k: int,
                  all_levels: bool = False) -> list[np.ndarray]:
    """Continuations (up to k tokens) of the longest suffix of `context` with occurrences (all_levels: of every
    suffix of 2-16 tokens with occurrences, longest first); a sequence in `limit` is readable only up to that many
    tokens."""
    out = []
    for n in range(min(MAX_MATCH, len(context)), MIN_MATCH - 1, -1):
        for s, end in index.at.get(tuple(context[-n:]), [])[-CANDIDATES:]:
            stop = min(end + k, limit.get(s, len(index.seqs[s])))
            if stop > end:
                out.append(index.seqs[s][end:stop])
        if out and not all_levels:
            return out
    return out


def frequency_draft(cands: list[np.ndarray], k: int) -> np.ndarray:
    draft = []
    alive = cands
    for j in range(k):
        alive = [c for c in alive if len(c) > j]
        if not alive:
            break
        values, counts = np.unique([c[j] for c in alive], return_counts=True)
        tok = values[np.argmax(counts)]
        draft.append(tok)
        alive = [c for c in alive if c[j] == tok]
    return np.array(draft, dtype=np.int64)


def agree(draft: np.ndarray, truth: np.ndarray) -> int:
    n = min(len(draft), len(truth))
    miss = np.flatnonzero(draft[:n] != truth[:n])
    return int(miss[0]) if miss.size else n


def replay(records, k: int, all_levels: bool = False) -> dict[str, tuple[float, float]]:
    by = defaultdict(list)
    for r in records:
        by[(r.problem_id, r.policy_version)].append(r)
    versions = sorted({r.policy_version for r in records})
    totals = {name: [0, 0, 0] for name in ("frequency", "oracle choice")}  # tokens, steps, drafted
    for (pid, v), group in by.items():
        if v == versions[0]:
            continue
        index = Index()
        for r in by_problem_before(by, pid, v):
            index.add(np.asarray(r.prompt_token_ids + r.output_token_ids, np.int64))
        seqs = [np.asarray(r.prompt_token_ids + r.output_token_ids, np.int64) for r in group]
        ids = [index.add(s) for s in seqs]
        prompt = [len(r.prompt_token_ids) for r in group]
        for me, r in enumerate(group):
            full, out_len = seqs[me], len(r.output_token_ids)
            for name in totals:
                p = 0
                while p < out_len:
                    at = prompt[me] + p
                    # siblings (and the request itself) readable up to the same output position
                    limit = {ids[j]: prompt[j] + p for j in range(len(group))}
                    cands = continuations(index, full[:at].tolist(), limit, k, all_levels)
                    truth = full[at:at + k]
                    if not cands:
                        draft = np.zeros(0, np.int64)
                    elif name == "frequency":
                        draft = frequency_draft(cands, k)
                    else:
                        draft = max(cands, key=lambda c: (agree(c, truth), -len(c)))
                    a = min(agree(draft, truth), out_len - p - 1) if len(draft) else 0
                    totals[name][0] += min(a + 1, out_len - p)
                    totals[name][1] += 1
                    totals[name][2] += len(draft)
                    p += a + 1
    return {name: (t / s, d / s) for name, (t, s, d) in totals.items()}


def by_problem_before(by, pid, v):
    return [r for (p, u), rs in by.items() if p == pid and u < v for r in rs]


if __name__ == "__main__":
    records = load_rollouts(sys.argv[1])
    name = sys.argv[1].split("/")[-1]
    frontier: dict[str, list[tuple[float, float]]] = defaultdict(list)  # (draft tokens/step, tokens/step)
    for k in (int(x) for x in sys.argv[2].split(",")):
        res = replay(records, k, "--all-levels" in sys.argv[3:])
        print(f"{name} K={k}: " + ", ".join(
            f"{arm} {tps:.3f} tokens/step at {dps:.2f} draft tokens/step" for arm, (tps, dps) in res.items()),
              flush=True)
        for arm, (tps, dps) in res.items():
            frontier[arm].append((dps, tps))
    freq = sorted([(0.0, 1.0), *frontier["frequency"]])
    ratios = [tps / np.interp(dps, *zip(*freq)) for dps, tps in frontier["oracle choice"] if dps <= freq[-1][0]]
    print(f"{name}: oracle choice / frequency at equal draft tokens per step: "
          + " ".join(f"{r:.3f}" for r in ratios), flush=True)
