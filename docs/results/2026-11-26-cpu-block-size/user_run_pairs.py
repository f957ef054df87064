"""Per repeat and epoch, das / none makespan of a `das bench serve --json` result on identical samples, their
median and geometric mean with a 95% bootstrap interval. Usage: python user_run_pairs.py RESULT.json"""
import json, sys, math, random, statistics
d = json.load(open(sys.argv[1]))
runs = d["runs"]
pairs = []
for r, (a, b) in enumerate(zip(runs["none"], runs["das"])):
    for e, (x, y) in enumerate(zip(a, b)):
        assert x["output_tokens"] == y["output_tokens"], (r, e)
        pairs.append((r + 1, e + 1, x["makespan_s"], y["makespan_s"], y["makespan_s"] / x["makespan_s"], x["longest_tokens"], y["draft_tokens"], y["accepted_tokens"]))
for p in pairs:
    print("repeat %d epoch %d none %.1f das %.1f ratio %.3f longest %d drafted %d accepted %d" % p)
logs = [math.log(p[4]) for p in pairs]
gm = math.exp(statistics.mean(logs))
random.seed(0)
boots = sorted(math.exp(statistics.mean(random.choices(logs, k=len(logs)))) for _ in range(10000))
print("pairs", len(pairs), "median ratio %.3f" % statistics.median(p[4] for p in pairs), "geometric mean %.3f (95%% bootstrap %.3f-%.3f)" % (gm, boots[250], boots[9750]))
print("sum das / sum none %.3f" % (sum(p[3] for p in pairs) / sum(p[2] for p in pairs)))
for e in (1, 2, 3):
    sel = [p[4] for p in pairs if p[1] == e]
    print("epoch", e, "ratios", " ".join("%.3f" % x for x in sel), "median %.3f" % statistics.median(sel))
