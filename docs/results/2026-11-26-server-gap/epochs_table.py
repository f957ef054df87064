"""Every epoch of a `das bench serve --json` result as a markdown table; with --pairs, the none/das pairs of each
repeat and their geometric mean (meaningful where the arms drew the same samples, i.e. in float32).
`python epochs_table.py RESULT.json [--pairs]`"""
import json
import math
import sys

runs = json.load(open(sys.argv[1]))["runs"]
if "--pairs" not in sys.argv:
    print("| arm | repeat | epoch | makespan s | output tokens | longest sample | critical-path steps | drafted | "
          "accepted | ms / critical step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for arm, repeats in runs.items():
        for r, epochs in enumerate(repeats, start=1):
            for e in epochs:
                print(f"| {arm} | {r} | {e['epoch']} | {e['makespan_s']:.1f} | {e['output_tokens']} | "
                      f"{e['longest_tokens']} | {e['critical_steps']} | {e['draft_tokens']} | {e['accepted_tokens']} | "
                      f"{e['seconds_per_critical_step'] * 1e3:.1f} |")
else:
    print("| repeat | epoch | longest (none / das) | same outputs | none s | das s | das / none | das critical steps "
          "| drafted | accepted |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    ratios = []
    for r, (none, das) in enumerate(zip(runs["none"], runs["das"]), start=1):
        for a, b in zip(none, das):
            ratios.append(b["makespan_s"] / a["makespan_s"])
            same = "yes" if (a["output_tokens"], a["longest_tokens"]) == (b["output_tokens"], b["longest_tokens"]) \
                else "no"
            print(f"| {r} | {a['epoch']} | {a['longest_tokens']} / {b['longest_tokens']} | {same} | "
                  f"{a['makespan_s']:.1f} | {b['makespan_s']:.1f} | {ratios[-1]:.3f} | {b['critical_steps']} | "
                  f"{b['draft_tokens']} | {b['accepted_tokens']} |")
    print(f"\n{len(ratios)} pairs, geomean {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}")
