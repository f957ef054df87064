"""Proposer cost per step at a large batch: 240 requests (30 problems x 8 samples of the SmolLM2 traces' last
epoch), the two epochs before as history; each step commits the accepted draft prefix + 1 true token.
python bench_propose.py [STEPS] [--profile] [--uniform]  (--uniform: every request may draft K = 8 each step)"""
import sys, time, cProfile, pstats
from pathlib import Path
import numpy as np
ROOT = Path(__file__).resolve().parents[3]  # the repository: its tests hold the runner stand-in
sys.path.insert(0, str(ROOT))
from tests.service.engine.test_proposer import make_proposer, FakeRunner
from das.drafter.records import load_rollouts
from das.service.engine.proposer import RequestTags

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 60
recs = load_rollouts(ROOT / "tests" / "fixtures" / "traces-smollm2.jsonl.gz")
last = max(r.policy_version for r in recs)
budget = {"policy": "uniform", "k": 8} if "--uniform" in sys.argv else None
proposer = make_proposer(k=8, vocab=49152, max_model_len=2048, budget=budget)
proposer.bank.add_rollouts([r for r in recs if r.policy_version < last])
runner = FakeRunner(width=2048); proposer.attach(runner)
batch = sorted([r for r in recs if r.policy_version == last], key=lambda r: (r.problem_id, r.sample_index))
truth = {}
for r in batch:
    rid = f"{r.problem_id}/{r.sample_index}"
    runner.add(rid, list(r.prompt_token_ids), max_tokens=1024, tags=RequestTags(r.problem_id, key=rid))
    truth[rid] = list(r.output_token_ids)
pos = {rid: 0 for rid in truth}
drafts = runner.step(proposer, {})
times = []
prof = cProfile.Profile() if "--profile" in sys.argv else None
orig = proposer.propose
def timed(*a, **k):
    t = time.perf_counter()
    if prof: prof.enable()
    out = orig(*a, **k)
    if prof: prof.disable()
    times.append(time.perf_counter() - t)
    return out
proposer.propose = timed
for step in range(STEPS):
    committed = {}
    for rid in runner.input_batch.req_ids:
        d, t, p = drafts[rid], truth[rid], pos[rid]
        a = 0
        while a < len(d) and p + a < len(t) - 1 and d[a] == t[p + a]:
            a += 1
        committed[rid] = t[p:p + a + 1]; pos[rid] += len(committed[rid])
    drafts = runner.step(proposer, committed)
    for rid in [r for r in runner.input_batch.req_ids if pos[r] >= len(truth[r])]:
        runner.remove(rid)
t = np.array(times[5:]) * 1e3
n = len(runner.input_batch.req_ids)
print(f"{len(t)} steps, {n} requests left; propose ms per step: median {np.median(t):.2f}, p90 {np.percentile(t, 90):.2f}; "
      f"drafts/step {np.mean([len(v) for v in drafts.values()]):.2f}")
if prof:
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
