"""Per-sample draft figures of the user's workload (reasoning-gym:8 x 8 samples, 512 tokens, T = 0.8, 3 epochs) against
a running `das serve` on :8000: the four samples with the most steps per epoch. python probe.py OUT.json [SEED]"""
import json
import sys
import time
from das.service.api import SamplingSpec
from das.service.client import RolloutClient
from das.service.prompt_sets import load_prompt_set
from das.service.rollout_run import derive
problems = load_prompt_set("reasoning-gym:8")
sampling = SamplingSpec(max_tokens=512, temperature=0.8)
groups = [p.group(8, sampling).model_dump(exclude_none=True) for p in problems]
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 1
out = []
with RolloutClient("http://localhost:8000", None) as client:
    for epoch in range(1, 4):
        t = time.perf_counter(); rows = []
        for s in client.generate(groups, seed=derive(seed, epoch - 1)):
            rows.append(dict(p=s.problem_id, i=s.sample_index, n=len(s.output_token_ids), d=s.draft_tokens,
                             a=s.accepted_tokens, lat=s.latency_s, fin=s.finish_reason, toks=s.output_token_ids))
        ms = time.perf_counter() - t
        rows.sort(key=lambda r: -(r["n"] - r["a"]))
        print(f"epoch {epoch} makespan {ms:.2f}")
        for r in rows[:4]:
            st = r["n"] - r["a"]
            print(f"  {r['p']}/{r['i']} n={r['n']} steps={st} drafted={r['d']} acc={r['a']} d/step={r['d']/st:.2f} "
                  f"acc/draft={r['a']/max(1,r['d']):.2f} lat={r['lat']:.1f}")
        out.append(dict(epoch=epoch, makespan=ms, rows=rows))
json.dump(out, open(sys.argv[1], "w"))
