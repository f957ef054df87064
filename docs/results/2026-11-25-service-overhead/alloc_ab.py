"""One plain engine (speculation none, the served defaults otherwise), a warm batch, then 2 timed batches of
4 groups x 8 samples x 128 tokens (ignore_eos, T=0.8, keyed seeds); prints tokens/s per batch. Run it under
different LD_PRELOAD settings (docs/results/2026-11-25-service-overhead.md)."""
import asyncio, os, sys, time
from das.service.api import GroupRequest
from das.service.engine.async_engine import Engine, EngineConfig
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
    return sum(len(r.token_ids) for o in outs for r in o), time.perf_counter() - t

async def main():
    spec = sys.argv[1] if len(sys.argv) > 1 else "none"
    engine = await Engine.create(EngineConfig(model=str(prepare_model("smollm2", progress=False)), speculation=spec))
    try:
        await run(engine, groups(0))
        rates = []
        for rep in range(2):
            tok, s = await run(engine, groups(rep + 1))
            rates.append(tok / s)
        print("RESULT", os.environ.get("LD_PRELOAD", "-"), spec, " ".join(f"{r:.1f}" for r in rates), flush=True)
    finally:
        await engine.close()

if __name__ == "__main__":
    asyncio.run(main())
