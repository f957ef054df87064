"""The proposer's cost per decode step at batches of 1 to 240 (on a GPU a das step's host time sits on the
makespan's critical path: async scheduling is off for a custom proposer): B requests of the SmolLM2 traces' last
epoch (the first sample of every problem, then the second, ...), each with its problem's length curve as the
service gives it, the epochs before as history; each step commits the accepted draft prefix + 1 true token (a
sample that reaches its end starts over, so the batch stays at B).
python bench_small.py B[,B...] [STEPS] [--forward-ms F] [--max-depth D] [--parts] [--profile]
prints median / p90 ms of the proposer's `propose` per step and drafts per step. --forward-ms: sleep F ms between
steps (a forward pass for the online cost fit to time, and cold caches at each call as in an engine; default 0);
--max-depth: the suffix index's depth (default: the proposer's, K_max + 8 = 16); --parts: median ms of the bank's
two batch calls, the budget's plan, the acceptance estimate and the cost fit's update."""
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]  # the repository: its tests hold the runner stand-in
sys.path.insert(0, str(ROOT))
from das.drafter.records import load_rollouts  # noqa: E402
from das.scheduler.difficulty import DifficultyBook  # noqa: E402
from das.scheduler.length import LengthPredictor  # noqa: E402
from das.service.engine.proposer import RequestTags  # noqa: E402
from tests.service.engine.test_proposer import FakeRunner, make_proposer  # noqa: E402

sizes = [int(x) for x in sys.argv[1].split(",")]
FORWARD_S = float(sys.argv[sys.argv.index("--forward-ms") + 1]) / 1e3 if "--forward-ms" in sys.argv else 0.0
DRAFTER = {"max_depth": int(sys.argv[sys.argv.index("--max-depth") + 1])} if "--max-depth" in sys.argv else None


def timed_parts(proposer) -> dict[str, list[float]]:
    """Wraps the proposer's parts with timers (instance attributes shadow the methods)."""
    parts: dict[str, list[float]] = {}
    for owner, name in ((proposer.bank, "commit_step"), (proposer.bank, "draft_step"), (proposer.budget, "plan"),
                        (proposer.acceptance, "params"), (proposer.budget, "observe")):
        method, spent = getattr(owner, name), parts.setdefault(name, [])

        def wrapper(*args, _method=method, _spent=spent, **kwargs):
            start = time.perf_counter()
            out = _method(*args, **kwargs)
            _spent.append(time.perf_counter() - start)
            return out
        setattr(owner, name, wrapper)
    return parts
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 150
recs = load_rollouts(ROOT / "tests" / "fixtures" / "traces-smollm2.jsonl.gz")
last = max(r.policy_version for r in recs)
current = sorted([r for r in recs if r.policy_version == last], key=lambda r: (r.sample_index, r.problem_id))
book = DifficultyBook()
book.add_records(sorted((r for r in recs if r.policy_version < last), key=lambda r: r.policy_version))
predictor = LengthPredictor(book)  # every request carries its problem's length curve, as the service's do
for size in sizes:
    proposer = make_proposer(k=8, vocab=49152, max_model_len=2048, drafter=DRAFTER)
    proposer.bank.add_rollouts([r for r in recs if r.policy_version < last])
    runner = FakeRunner(width=2048)
    proposer.attach(runner)
    truth, pos = {}, {}
    for r in current[:size]:
        rid = f"{r.problem_id}/{r.sample_index}"
        curve = predictor.curves([r.problem_id])[0]
        runner.add(rid, list(r.prompt_token_ids), max_tokens=1024,
                   tags=RequestTags(r.problem_id, key=rid, predicted_tokens=curve.at(0), length_curve=curve))
        truth[rid], pos[rid] = list(r.output_token_ids), 0
    drafts = runner.step(proposer, {})
    parts = timed_parts(proposer) if "--parts" in sys.argv else {}
    times, drafted = [], []
    prof = cProfile.Profile() if "--profile" in sys.argv else None
    propose = proposer.propose

    def timed(*args, _propose=propose):
        start = time.perf_counter()
        if prof:
            prof.enable()
        out = _propose(*args)
        if prof:
            prof.disable()
        times.append(time.perf_counter() - start)
        return out
    proposer.propose = timed
    for step in range(STEPS):
        committed = {}
        for rid in runner.input_batch.req_ids:
            d, t, p = drafts[rid], truth[rid], pos[rid]
            a = 0
            while a < len(d) and d[a] == t[(p + a) % len(t)]:
                a += 1
            committed[rid] = [t[(p + i) % len(t)] for i in range(a + 1)]  # a sample that ends starts over
            pos[rid] += len(committed[rid])
        if FORWARD_S:
            time.sleep(FORWARD_S)
        drafts = runner.step(proposer, committed)
        drafted.append(sum(len(v) for v in drafts.values()))
    t = np.array(times[10:]) * 1e3
    print(f"batch {size:3d}: {len(t)} steps, step ms median {np.median(t):.3f}, p90 {np.percentile(t, 90):.3f}; "
          f"drafts/step {np.mean(drafted):.2f}", flush=True)
    if parts:
        print("   " + ", ".join(f"{name} {np.median(v[10:]) * 1e3:.3f}" for name, v in parts.items()), flush=True)
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
