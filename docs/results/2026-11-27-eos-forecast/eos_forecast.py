"""Does the model's probability of ending, read at every token, make the length-aware budget better? The budget's
end-of-sample forecast (the request's LengthCurve p90, conditional on the tokens it has generated) is scaled by the
sample's recent ending probability: remaining' = remaining * exp(beta * (f - f0)) (or, "shrink-only", never more
than remaining), f the mean log probability of ending over the request's last W tokens (none before its first
token). beta and f0 are fitted on the other trace set (cross-fitting: the least-squares slope of log(true
remaining / forecast remaining) on f at every 16th token of every sample after the first epoch, with the forecast
from the epochs before it; f0 the mean f there).
Replayed with the package's simulator (`simulate_batch` with the budget's one line patched, patched.py); das only;
"budget oracle" = the true lengths in the budget alone (the oracle split's "budget" row).
python eos_forecast.py COST ENGINES K_MAX W A B       (A, B: trace prefixes from sample_traces.py)"""
import sys

import numpy as np

sys.path.insert(0, "../2026-11-27-length-signals")
from patched import patched_simulate_batch, simulate_with

from das.drafter.records import load_rollouts
from das.scheduler import simulator
from das.scheduler.cost_model import load_cost_model
from das.scheduler.difficulty import DifficultyBook
from das.scheduler.length import LengthPredictor

BUDGET = "                ends = predictor.predict([problems[i] for i in active], pos[active]).p90\n"


def load(prefix: str):
    records = load_rollouts(prefix + ".jsonl.gz")
    p_end = np.load(prefix + ".npz")["p_end"]
    assert len(records) == len(p_end)
    log_p = np.log(np.maximum(np.nan_to_num(p_end, nan=1.0), 1e-12))
    return records, {(r.problem_id, r.policy_version, r.sample_index): log_p[i] for i, r in enumerate(records)}


def feature(log_p: np.ndarray, pos: int, window: int) -> float:
    return float(log_p[max(pos - window, 0):pos].mean()) if pos > 0 else float("nan")


def fit(records, log_p, window: int) -> tuple[float, float]:
    """(beta, f0) on one trace set: forecast remaining from the versions before each sample's."""
    versions = sorted({r.policy_version for r in records})
    xs, ys = [], []
    for v in versions[1:]:
        book = DifficultyBook()
        book.add_records([r for r in records if r.policy_version < v])
        predictor = LengthPredictor(book)
        for r in (r for r in records if r.policy_version == v):
            length = len(r.output_token_ids)
            at = np.arange(16, length, 16)
            if not at.size:
                continue
            p90 = predictor.predict([r.problem_id] * len(at), at).p90
            row = log_p[(r.problem_id, r.policy_version, r.sample_index)]
            xs += [feature(row, int(g), window) for g in at]
            ys += list(np.log((length - at) / np.maximum(p90 - at, 1.0)))
    x, y = np.array(xs), np.array(ys)
    beta = float(np.cov(x, y)[0, 1] / x.var(ddof=1))
    print(f"  fit: {len(x)} points, beta {beta:+.3f} per nat, f0 {x.mean():.2f}, "
          f"corr {np.corrcoef(x, y)[0, 1]:+.3f}", flush=True)
    return beta, float(x.mean())


def eos_ends(log_p, window: int, beta: float, f0: float, shrink_only: bool):
    def ends(batch, active, pos, p90):
        f = np.array([feature(log_p[(batch[i].problem_id, batch[i].policy_version, batch[i].sample_index)],
                              int(g), window) for i, g in zip(active, pos)])
        scale = np.where(np.isfinite(f), np.exp(beta * (np.nan_to_num(f, nan=f0) - f0)), 1.0)
        if shrink_only:
            scale = np.minimum(scale, 1.0)
        return pos + np.maximum(p90 - pos, 1.0) * scale
    return ends


def main(cost_name: str, engines: int, k_max: int, window: int, a: str, b: str) -> None:
    cost = load_cost_model(cost_name)
    sets = {a: load(a), b: load(b)}
    for name, other in ((a, b), (b, a)):
        records, log_p = sets[name]
        print(f"{name.split('/')[-1]} (fitted on {other.split('/')[-1]}), {cost_name}, {engines} engines, "
              f"K_max {k_max}, W {window}:", flush=True)
        beta, f0 = fit(*sets[other], window)
        base = simulate_with(simulator.simulate_batch, records, cost, engines, "das", k_max=k_max)
        row = [f"as is {base.makespan_s:.3f} s"]
        for shrink_only in (False, True):
            for mult in (0.5, 1.0, 2.0):
                fn = patched_simulate_batch(
                    (BUDGET, "                ends = EOS_ENDS(batch, active, pos[active], "
                             "predictor.predict([problems[i] for i in active], pos[active]).p90)\n"),
                    EOS_ENDS=eos_ends(log_p, window, beta * mult, f0, shrink_only))
                t = simulate_with(fn, records, cost, engines, "das", k_max=k_max).makespan_s
                row.append(f"{'shrink-only ' if shrink_only else ''}beta x{mult:g} {t:.3f} ({t / base.makespan_s:.3f})")
        fn = patched_simulate_batch((BUDGET, "                ends = lengths[active].astype(np.float64)\n"))
        t = simulate_with(fn, records, cost, engines, "das", k_max=k_max).makespan_s
        row.append(f"budget oracle {t:.3f} ({t / base.makespan_s:.3f})")
        print("  " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
