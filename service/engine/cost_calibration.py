"""`das calibrate`: measure a real engine's step time against tokens per step and fit the cost model.

A decode step of B running requests processes B tokens; a verification step with K drafts each processes
B * (1 + K). vLLM runs both through the same batched forward, so the step time is measured across token counts
by decoding batches of B requests (ignore_eos, fixed length): step = (t(2 + T tokens) - t(2 tokens)) / T, which
cancels prefill and engine overhead. Drafted steps are not timed separately here (their extra tokens are
counted as batch tokens, which is the cost model's assumption); a later issue with our proposer in the engine
can check that assumption directly.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from das.scheduler.cost_model import CostModel, fit_cost_model

DecodeStepProbe = Callable[[int], float]  # batch size -> seconds per decode step


@dataclass(frozen=True)
class Calibration:
    model: CostModel
    points: list[tuple[int, float]]  # (tokens per step, median seconds per step)


def calibrate(name: str, timer: DecodeStepProbe, batch_sizes: Sequence[int], repeats: int, source: str,
              on_point: Callable[[int, float], None] | None = None) -> Calibration:
    """Median of `repeats` timings per batch size, then a least-squares fit of c_base + c_tok * n."""
    if len(set(batch_sizes)) < 2 or min(batch_sizes) < 1:
        raise ValueError("need at least two distinct batch sizes, each >= 1")
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    points = []
    for b in sorted(set(batch_sizes)):
        step = statistics.median(timer(b) for _ in range(repeats))
        points.append((b, step))
        if on_point:
            on_point(b, step)
    model = fit_cost_model(name, [p[0] for p in points], [p[1] for p in points], source)
    return Calibration(model, points)


def vllm_step_timer(model_dir: Path, max_batch: int, decode_tokens: int = 16,
                    prompt_tokens: int = 16) -> DecodeStepProbe:
    """A DecodeStepProbe over an in-process vLLM engine (CPU here). Loads the model once (tens of seconds)."""
    from das.service.engine.cpu_fixes.torch_extensions import hide_broken_torch_extensions

    hide_broken_torch_extensions()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: nothing else competes for cores
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), max_model_len=prompt_tokens + decode_tokens + 8, max_num_seqs=max_batch,
              enforce_eager=True, seed=0)
    prompt = {"prompt_token_ids": list(range(100, 100 + prompt_tokens))}
    short = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
    long = SamplingParams(max_tokens=2 + decode_tokens, ignore_eos=True, temperature=0.0)

    def timer(batch: int) -> float:
        prompts = [prompt] * batch
        t0 = time.perf_counter()
        llm.generate(prompts, short, use_tqdm=False)
        t1 = time.perf_counter()
        llm.generate(prompts, long, use_tqdm=False)
        t2 = time.perf_counter()
        return max(((t2 - t1) - (t1 - t0)) / decode_tokens, 0.0)

    return timer
