"""Per-step forward time at equal batch size: a plain engine against a das engine that never drafts (uniform K=0)."""
import asyncio, sys, json
import numpy as np
from das.service.api import GroupRequest
from das.service.engine.async_engine import Engine, EngineConfig
from das.service.engine.models import prepare_model

MODEL = "smollm2"

async def run(arm):
    cfg = dict(model=str(prepare_model(MODEL, progress=False)), speculation=arm)
    if arm == "das":
        cfg["budget"] = {"policy": "uniform", "k": 0}
    engine = await Engine.create(EngineConfig(**cfg))
    groups = [GroupRequest(problem_id=f"p{g}", n=8, prompt_token_ids=[5, 6, 7 + g, 9, 10, 11],
                           sampling={"max_tokens": 96 + 16 * g, "temperature": 0.8, "ignore_eos": True, "seed": g})
              for g in range(4)]
    async def go():
        async def one(gr):
            return [r async for r in engine.generate(gr)]
        await asyncio.gather(*(one(g) for g in groups))
    await go()  # warm
    await engine.start_step_profile()
    out = {}
    for rep in range(2):
        await go()
    (cols,) = await engine._llm.collective_rpc("das_profile_take")
    await engine.close()
    return cols

async def main():
    res = {}
    for arm in ("none", "das", "none", "das"):
        cols = await run(arm)
        res.setdefault(arm, []).append(cols)
    for arm, runs in res.items():
        for cols in runs:
            req = np.array(cols["requests"]); tok = np.array(cols["tokens"]); fw = np.array(cols["forward_s"]) * 1e3
            sm = np.array(cols["sample_s"]) * 1e3; gap = np.array(cols["gap_s"]) * 1e3; dr = np.array(cols["drafts"])
            dec = (tok == req) & (dr == 0)
            line = [arm]
            for n in (8, 16, 24, 32):
                m = dec & (req == n)
                line.append(f"n={n}: fwd {np.median(fw[m]):.1f} smp {np.median(sm[m]):.1f} gap {np.median(gap[m]):.2f} ({m.sum()})" if m.any() else f"n={n}: -")
            print(" | ".join(line), flush=True)

if __name__ == "__main__":
    asyncio.run(main())
