"""`das calibrate`: measure a real engine's step time against tokens per step and fit the cost model.

A decode step of B running requests processes B tokens; a verification step with K drafts each processes
B * (1 + K). vLLM runs both through the same batched forward, so the step time is measured across token counts
by decoding batches of B requests (ignore_eos, fixed length): step = (t(2 + T tokens) - t(2 tokens)) / T, which
cancels prefill and engine overhead. Drafted steps are not timed here (c_spec = 0 in the result): every das
engine's online fit (scheduler/cost_model.py) learns c_spec from its own drafted steps, starting from this prior.
The price of a prompt token (c_prefill, which the simulator charges) is timed the same way: one step prefilling
short prompts against one prefilling long ones.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from das.scheduler.cost_model import CostModel, fit_cost_model
from das.service.engine.vllm.engine import VllmEngine, EngineConfig
from das.service.wire.api import GroupRequest

DecodeStepProbe = Callable[[int], float]  # batch size -> seconds per decode step
PrefillProbe = Callable[[], float]  # -> seconds per prompt token prefilled


@dataclass(frozen=True)
class Calibration:
    model: CostModel
    points: list[tuple[int, float]]  # (tokens per step, median seconds per step)


def calibrate(name: str, timer: DecodeStepProbe, batch_sizes: Sequence[int], repeats: int, source: str,
              on_point: Callable[[int, float], None] | None = None,
              prefill: PrefillProbe | None = None) -> Calibration:
    """Median of `repeats` timings per batch size, then a least-squares fit of c_base + c_tok * n; with `prefill`,
    c_prefill is the median of `repeats` of its timings."""
    if len(set(batch_sizes)) < 2 or min(batch_sizes) < 1:
        raise ValueError("need at least two distinct batch sizes, each >= 1")
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    points = []
    for b in sorted(set(batch_sizes)):
        step = _positive(statistics.median(timer(b) for _ in range(repeats)), f"a decode step of {b} requests")
        points.append((b, step))
        if on_point:
            on_point(b, step)
    model = fit_cost_model(name, [p[0] for p in points], [p[1] for p in points], source)
    if prefill is not None:
        model = replace(model, c_prefill_s=_positive(statistics.median(prefill() for _ in range(repeats)),
                                                     "a prompt token"))
    return Calibration(model, points)


def _positive(seconds: float, what: str) -> float:
    """A timing is a difference of two wall-clock runs; on a busy machine it can come out <= 0, which is no
    measurement: a clear error rather than a cost model fitted to it."""
    if not seconds > 0:
        raise ValueError(f"{what} timed at {seconds * 1e3:.3f} ms: the machine was too busy to time it; "
                         f"retry with more --repeats or --decode-tokens")
    return seconds


class ServedEngineTimer:
    """A DecodeStepProbe over the engine `das serve` runs: `VllmEngine` with the served defaults (vLLM's CPU process
    layout, torch.compile, the served dtype) and speculation off, so the prior it yields is the cost the budget
    will meet. (An in-process eager engine, what this tool timed before, has other costs: on the 2-core AMD
    machine ~18 ms per token against the served engine's ~5 ms.) A context manager: the engine starts on entry
    (a minute or two with compilation) and stops on exit. One timing decodes `batch` samples of one prompt
    twice, 2 and 2 + decode_tokens tokens (greedy, ignore_eos). `prefill_token_s` is the PrefillProbe."""

    PREFILL_REQUESTS = 16
    PREFILL_SHORT, PREFILL_LONG = 16, 112  # prompt tokens: 16 x 112 = 1,792 fit one step (vLLM's budget: 2,048)

    def __init__(self, model_dir: Path, max_batch: int, decode_tokens: int = 16, prompt_tokens: int = 16) -> None:
        self.config = EngineConfig(model=str(model_dir), speculation="none",
                                   max_num_seqs=max(max_batch, self.PREFILL_REQUESTS))
        self.decode_tokens = decode_tokens
        self.prompt = list(range(100, 100 + prompt_tokens))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine: VllmEngine | None = None
        self._prompts = np.random.default_rng(0)

    def __enter__(self) -> ServedEngineTimer:
        self._loop = asyncio.new_event_loop()
        try:
            self._engine = self._loop.run_until_complete(VllmEngine.create(self.config))
        except BaseException:
            self._loop.close()
            raise
        # The first requests after start pay one-off costs (first runs of each shape); untimed, they would land in
        # the first point as a difference of hundreds of ms (seen as a negative decode step of 1 request).
        try:
            self._decode(1, 2 + self.decode_tokens)
            self._prefill(self.PREFILL_LONG)
        except BaseException:  # `with` calls no __exit__ when __enter__ raises: the engine would outlive us
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None
        if self._engine is not None:
            self._loop.run_until_complete(self._engine.close())
        self._loop.close()

    def __call__(self, batch: int) -> float:
        t0 = time.perf_counter()
        self._decode(batch, 2)
        t1 = time.perf_counter()
        self._decode(batch, 2 + self.decode_tokens)
        t2 = time.perf_counter()
        return ((t2 - t1) - (t1 - t0)) / self.decode_tokens

    def prefill_token_s(self) -> float:
        """Seconds per prompt token: PREFILL_REQUESTS new prompts of PREFILL_LONG tokens against as many of
        PREFILL_SHORT, one output token each (one step each: the difference cancels the step's fixed cost and the
        engine's overhead). The prompts are drawn afresh every time, so the prefix cache never serves them."""
        t0 = time.perf_counter()
        self._prefill(self.PREFILL_SHORT)
        t1 = time.perf_counter()
        self._prefill(self.PREFILL_LONG)
        t2 = time.perf_counter()
        extra = self.PREFILL_REQUESTS * (self.PREFILL_LONG - self.PREFILL_SHORT)
        return ((t2 - t1) - (t1 - t0)) / extra

    def _prefill(self, prompt_tokens: int) -> None:
        self._run([GroupRequest(problem_id=f"calibrate-prefill-{i}", n=1,
                                prompt_token_ids=self._prompts.integers(100, 10_000, prompt_tokens).tolist(),
                                sampling={"max_tokens": 1, "temperature": 0.0})
                   for i in range(self.PREFILL_REQUESTS)])

    def _decode(self, batch: int, tokens: int) -> None:
        self._run([GroupRequest(problem_id="calibrate", n=batch, prompt_token_ids=self.prompt,
                                sampling={"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True})])

    def _run(self, groups: list[GroupRequest]) -> None:
        """Runs the groups at once on the engine until every sample is out."""
        assert self._engine is not None and self._loop is not None, "use ServedEngineTimer as a context manager"
        engine = self._engine

        async def drain(group: GroupRequest) -> None:
            async for _ in engine.generate(group):
                pass

        async def run() -> None:
            await asyncio.gather(*(drain(g) for g in groups))

        self._loop.run_until_complete(run())
