"""torch profiles of 10 exploration-shaped drafted steps (32 requests, one drafting) and 10 plain ones, as the engine
samples (sampler_cost.py's setup). Run from this folder: python profile_drafted.py"""
import sys, runpy
sys.argv = ["x", "49152", "32", "0.03", "3"]
g = runpy.run_path("sampler_cost.py")
from torch.profiler import profile
with profile() as pr:
    for _ in range(10):
        x = g["rows"].clone()
        with g["keys_of_step"](g["keys"]):
            g["verifier"](g["sd"], None, x, g["meta"])
print(pr.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
with profile() as pr:
    for _ in range(10):
        x = g["plain_rows"].clone()
        with g["keys_of_step"](g["plain_keys"]):
            g["verifier"].sampler(x, g["meta"])
print(pr.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))
