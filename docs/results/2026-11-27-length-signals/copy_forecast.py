"""Does the text a sample is copying say how long it will run? At g output tokens, a running sample's last M tokens
are looked up in the outputs of its problem's samples of the W versions before (the drafter's sealed history);
where they occur, the "copy forecast" of its remaining length is the remaining length of the (latest) matching
rollout after the match. Compared with the engine's forecast (LengthPredictor's mean and p90 at g, remaining =
forecast - g) by Spearman correlation with the true remaining length, on the samples the copy forecast covers.
python copy_forecast.py TRACES [M] [W]"""
import sys

import numpy as np

from das.drafter.records import load_rollouts
from das.scheduler.difficulty import DifficultyBook
from das.scheduler.length import LengthPredictor

M = int(sys.argv[2]) if len(sys.argv) > 2 else 16
W = int(sys.argv[3]) if len(sys.argv) > 3 else 4


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


records = load_rollouts(sys.argv[1])
by_version: dict[int, list] = {}
for r in records:
    by_version.setdefault(r.policy_version, []).append(r)
versions = sorted(by_version)
rows = {g: [] for g in (32, 64, 128, 256)}
for v in versions[1:]:
    history = [r for u in versions if v - W <= u < v for r in by_version[u]]
    book = DifficultyBook()
    book.add_records(sorted(history, key=lambda r: r.policy_version))
    predictor = LengthPredictor(book)
    index: dict[tuple[str, tuple[int, ...]], int] = {}  # (problem, M-gram) -> remaining after it, latest rollout
    for r in sorted(history, key=lambda r: r.policy_version):
        out = r.output_token_ids
        for end in range(M, len(out) + 1):
            index[(r.problem_id, tuple(out[end - M:end]))] = len(out) - end
    for r in by_version[v]:
        out = r.output_token_ids
        for g in rows:
            if len(out) <= g:
                continue
            copy = index.get((r.problem_id, tuple(out[g - M:g])))
            forecast = predictor.predict([r.problem_id], np.array([g]))
            rows[g].append((len(out) - g, np.nan if copy is None else copy, float(forecast.mean[0]) - g,
                            float(forecast.p90[0]) - g))
for g, values in rows.items():
    a = np.array(values)
    covered = ~np.isnan(a[:, 1])
    if covered.sum() < 5:
        print(f"g={g}: {covered.sum()} covered of {len(a)}")
        continue
    c = a[covered]
    print(f"{sys.argv[1].split('/')[-1]} M={M} g={g}: {len(a)} running, copy forecast covers {covered.mean():.2f}; "
          f"Spearman with the true remaining: copy {spearman(c[:, 1], c[:, 0]):.2f}, engine mean "
          f"{spearman(c[:, 2], c[:, 0]):.2f}, p90 {spearman(c[:, 3], c[:, 0]):.2f} (covered); engine mean on all "
          f"{spearman(a[:, 2], a[:, 0]):.2f}", flush=True)
