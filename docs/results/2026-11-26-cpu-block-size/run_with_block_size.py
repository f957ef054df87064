"""`das bench e2e` with vLLM's block_size forced to $BS (if set) and every step profile's raw columns appended to
$STEPS (one JSON object per take). Usage: BS=32 STEPS=steps.jsonl python run_with_block_size.py e2e [e2e options]"""
import json, os, sys

def main() -> None:
    from vllm.v1.engine.async_llm import AsyncLLM
    orig_from = AsyncLLM.from_engine_args.__func__

    def from_engine_args(cls, engine_args, *a, **k):
        if os.environ.get("BS"):
            engine_args.block_size = int(os.environ["BS"])
        return orig_from(cls, engine_args, *a, **k)

    AsyncLLM.from_engine_args = classmethod(from_engine_args)
    from das.service.engine import step_profile
    orig = step_profile.StepProfile.of.__func__

    def of(cls, columns):
        with open(os.environ["STEPS"], "a") as f:
            f.write(json.dumps(columns) + "\n")
        return orig(cls, columns)

    step_profile.StepProfile.of = classmethod(of)
    from das.bench.cli import bench_app
    bench_app(sys.argv[1:], standalone_mode=True)

if __name__ == "__main__":
    main()
