"""One served engine (`Engine`, the served defaults, the model prepared in the served dtype), a warm batch, then 2
timed batches of 4 groups x 8 samples x 128 tokens (ignore_eos, T=0.8, keyed seeds); prints tokens/s per batch and
the batch's draft/accepted tokens. `python preload_ab.py das|none`; run it under different LD_PRELOAD settings
(docs/results/2026-11-26-server-gap.md)."""
import asyncio
import os
import sys
import time

from das.service.api import GroupRequest
from das.service.engine.async_engine import Engine, EngineConfig, engine_dtype
from das.service.engine.models import prepare_model


def groups(seed):
    return [GroupRequest(problem_id=f"p{g}", n=8, prompt_token_ids=[1, 2, 3 + g, 40 + g],
                         sampling={"max_tokens": 128, "temperature": 0.8, "ignore_eos": True, "seed": seed * 100 + g})
            for g in range(4)]


async def run(engine, gs):
    async def one(g):
        return [r async for r in engine.generate(g)]
    t = time.perf_counter()
    outs = await asyncio.gather(*(one(g) for g in gs))
    results = [r for o in outs for r in o]
    return (sum(len(r.token_ids) for r in results), time.perf_counter() - t,
            sum(r.draft_tokens for r in results), sum(r.accepted_tokens for r in results))


async def main():
    spec = sys.argv[1] if len(sys.argv) > 1 else "none"
    model = prepare_model("smollm2", progress=False, dtype=engine_dtype("auto"))
    engine = await Engine.create(EngineConfig(model=str(model), speculation=spec))
    try:
        await run(engine, groups(0))
        figures = []
        for rep in range(2):
            tok, s, drafted, accepted = await run(engine, groups(rep + 1))
            figures.append(f"{tok / s:.1f} tok/s ({drafted} drafted, {accepted} accepted)")
        print("RESULT", os.environ.get("LD_PRELOAD", "-"), spec, "; ".join(figures), flush=True)
    finally:
        await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
