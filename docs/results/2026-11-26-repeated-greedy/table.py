"""Per repeat and epoch: das / none and suffix / none makespan, das's draft tokens and their acceptance, from
`das bench e2e --json` outputs. Usage: python table.py RUN.json [RUN.json ...]"""

import json
import statistics
import sys

for path in sys.argv[1:]:
    doc = json.load(open(path))
    print(f"## {path}")
    print("| repeat | epoch | das / none | suffix / none | das tokens/s / none | das draft tokens (accepted) |")
    print("|---:|---:|---:|---:|---:|---:|")
    ratios: dict[int, list[float]] = {}
    for run in doc["runs"]:
        for epoch in run["epochs"]:
            arms = epoch["arms"]
            das, none, suffix = arms["das"], arms["none"], arms.get("suffix")
            ratio = das["makespan_s"] / none["makespan_s"]
            ratios.setdefault(epoch["epoch"], []).append(ratio)
            sfx = f"{suffix['makespan_s'] / none['makespan_s']:.3f}" if suffix else "-"
            print(f"| {run['repeat']} | {epoch['epoch']} | {ratio:.3f} | {sfx} | "
                  f"{das['tokens_per_s'] / none['tokens_per_s']:.3f} | {das['draft_tokens']} "
                  f"({das['accepted_tokens']}) |")
    for epoch, values in sorted(ratios.items()):
        print(f"epoch {epoch}: median das / none {statistics.median(values):.3f} over {len(values)} repeats")
    print(f"identical outputs across arms: {doc.get('identical_outputs')}")
