"""Every step profile (per arm and epoch) of `das bench e2e --profile --json` files, one line each.
Usage: python profile_lines.py E2E.json [...]"""
import json, sys
for f in sys.argv[1:]:
    d = json.load(open(f))
    def walk(o, p=""):
        if isinstance(o, dict):
            for k, v in o.items():
                if k == "profile" and isinstance(v, dict):
                    print(f, p, {kk: (round(vv, 2) if isinstance(vv, float) else vv) for kk, vv in v.items() if not isinstance(vv, (list, dict))})
                else:
                    walk(v, p + "/" + k)
        elif isinstance(o, list):
            for i, v in enumerate(o):
                walk(v, p + f"[{i}]")
    walk(d)
