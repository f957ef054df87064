"""Where an engine step's time goes: timers on vLLM's model runner, read by `das bench e2e --profile` and, with
`das serve --profile-steps`, by the service's metrics.

vLLM's engine loop, once per step: the scheduler picks the requests and their draft tokens; the model runner's
`execute_model` prepares the inputs and runs the forward pass over every scheduled token (drafts included);
`sample_tokens` samples (or, when the step carries drafts, runs the rejection sampler over every draft position),
updates the request states and asks the drafter for the next step's drafts (`propose_draft_token_ids`); the
engine core then turns the sampled tokens into outputs. `RunnerStepTimer` wraps those runner methods on one runner
instance (instance attributes shadow the class's methods, vLLM's code is untouched; declared in patches.py as the
on-demand patch "step-profile") and keeps, per step:

- forward_s: `execute_model`, of which model_s is the forward pass itself (`_model_forward` and the model's
  `compute_logits`): the device work; the rest of forward_s is input preparation on the host;
- sample_s: the sampler or rejection sampler (`_sample`: the keyed draw, its host synchronisation included);
- propose_s: the drafter (`propose_draft_token_ids`; 0 without speculation), of which budget_s is our budget's
  plan (the proposer's `budget.plan`; 0 for other drafters);
- rest_s: the remainder of `sample_tokens` (state updates, copying tokens to the host);
- gap_s: from the end of this step's `sample_tokens` to the start of the next step's `execute_model`: the
  scheduler and the engine core's output handling. A gap over `IDLE_GAP_S` is the engine waiting for work and is
  counted as 0, as is the last step's;
- requests, tokens, drafts: the step's shape (running requests, scheduled tokens, of which draft tokens).

Host time a step is everything but model_s: what an engine without async scheduling (V1 with a `custom_class`
proposer, as ours) adds to every step's device time, and what async scheduling would overlap with the next step's
forward pass.

Cost: eight `perf_counter` calls and one list append per step (~3 us, against steps of milliseconds).

On a GPU the runner's calls return once their kernels are queued, so every clock read is preceded by a device
synchronisation (`device_sync`: `torch.cuda.synchronize` on the runner's CUDA device; nothing on the CPU, whose
work is done when the call returns). The parts then hold the device time they queued, not the host's launch time,
at the price of the overlap of host and device work while profiling.

`StepProfileExtension` is mixed into vLLM's worker (`worker_extension_cls`), so the timer runs in the engine
process and is reached with `collective_rpc("das_profile_start" | "das_profile_take")`; engines start with it
inside worker.py's `EngineWorkerExtension`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from das.service.engine.contract import IDLE_GAP_S, STEP_PARTS as PARTS

FIELDS = ("forward_s", "sample_s", "propose_s", "rest_s", "gap_s", "requests", "tokens", "drafts", "model_s",
          "budget_s")

_GAP = FIELDS.index("gap_s")  # filled in when the next step starts


def device_sync(runner: Any) -> Callable[[], None] | None:
    """What waits for the work the runner queued on its device (`runner.device`): torch.cuda.synchronize on a CUDA
    device, None (nothing to wait for) elsewhere."""
    device = torch.device(getattr(runner, "device", "cpu"))
    if device.type != "cuda":
        return None
    return lambda: torch.cuda.synchronize(device)


class RunnerStepTimer:
    """Times one model runner's steps until `take()`; see the module docstring for the fields. `sync` runs before
    every clock read (default: `device_sync(runner)`)."""

    def __init__(self, runner: Any, sync: Callable[[], None] | None = None) -> None:
        self._runner = runner
        wait = sync or device_sync(runner)

        def clock() -> float:
            if wait is not None:
                wait()
            return time.perf_counter()

        self._steps: list[list[float]] = []  # one record a step, in FIELDS order
        self._current: dict[str, float] = {}
        self._last_end: float | None = None
        execute, sample_tokens = runner.execute_model, runner.sample_tokens
        sample, propose = runner._sample, runner.propose_draft_token_ids

        def timed_execute(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            start = clock()
            gap = start - self._last_end if self._last_end is not None else 0.0
            if self._steps and gap <= IDLE_GAP_S:  # the gap belongs to the step before this one
                self._steps[-1][_GAP] = gap
            self._current = {"forward_s": 0.0, "sample_s": 0.0, "propose_s": 0.0, "model_s": 0.0, "budget_s": 0.0}
            try:
                return execute(scheduler_output, *args, **kwargs)
            finally:
                self._current["forward_s"] = clock() - start
                drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
                self._current["requests"] = len(scheduler_output.num_scheduled_tokens)
                self._current["tokens"] = scheduler_output.total_num_scheduled_tokens
                self._current["drafts"] = sum(len(d) for d in drafts.values())

        def timed_sample_tokens(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return sample_tokens(*args, **kwargs)
            finally:
                self._last_end = end = clock()
                c = self._current
                if c:
                    rest = end - start - c["sample_s"] - c["propose_s"]
                    self._steps.append([c["forward_s"], c["sample_s"], c["propose_s"], rest, 0.0,
                                        c["requests"], c["tokens"], c["drafts"], c["model_s"], c["budget_s"]])
                    self._current = {}

        def timed(name: str, method: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                start = clock()
                try:
                    return method(*args, **kwargs)
                finally:
                    if self._current:
                        self._current[name] += clock() - start
            return wrapper

        runner.execute_model = timed_execute
        runner.sample_tokens = timed_sample_tokens
        runner._sample = timed("sample_s", sample)
        runner.propose_draft_token_ids = timed("propose_s", propose)
        if hasattr(runner, "_model_forward"):
            runner._model_forward = timed("model_s", runner._model_forward)
        model = getattr(runner, "model", None)
        if model is not None and hasattr(model, "compute_logits"):
            model.compute_logits = timed("model_s", model.compute_logits)
        budget = getattr(getattr(runner, "drafter", None), "budget", None)  # our proposer's budget hook
        if budget is not None and hasattr(budget, "plan"):
            budget.plan = timed("budget_s", budget.plan)

    def take(self) -> dict[str, list[float]]:
        """The steps recorded since the last take, column by column (FIELDS), and forgets them."""
        steps, self._steps = self._steps, []
        return {name: [s[i] for s in steps] for i, name in enumerate(FIELDS)}


class StepProfileExtension:
    """Worker methods (vLLM `worker_extension_cls`): `self.model_runner` is the worker's model runner."""

    model_runner: Any
    _das_step_timer: RunnerStepTimer | None = None

    def das_profile_start(self) -> bool:
        """Starts timing steps (once; later calls only clear what was recorded). PatchError where the step-profile
        patch (patches.py) is not for this platform or vLLM release."""
        if self._das_step_timer is None:
            from vllm.platforms import current_platform

            from das.service.engine.vllm.patches import STEP_PROFILE, platform_name
            from das.service.engine.vllm_version import check_vllm_version

            STEP_PROFILE.check(platform_name(current_platform.is_cpu(), current_platform.device_type,
                                             current_platform.is_rocm()), check_vllm_version())
            self._das_step_timer = RunnerStepTimer(self.model_runner)
        self._das_step_timer.take()
        return True

    def das_profile_take(self) -> dict[str, list[float]]:
        if self._das_step_timer is None:
            raise RuntimeError("step profiling was not started (das_profile_start)")
        return self._das_step_timer.take()


@dataclass(frozen=True)
class StepProfile:
    """Steps of one engine over one epoch: per-step mean milliseconds of each part (module docstring), the mean
    step shape, `drafted_steps` (steps that verified at least one draft token) with the mean sample (verification)
    time of those and of the other steps (None where there are none), and `fit_ms_per_token` / `fit_base_ms`: a
    least-squares line of forward + sample time against scheduled tokens (None with fewer than two distinct token
    counts).

    `model_ms` is the forward pass (device work), `host_ms` = step_ms - model_ms everything else a step, of which
    `prepare_ms` (input preparation: forward_ms - model_ms) and `budget_ms` (inside propose_ms); on a CPU engine the
    "device" is the CPU itself.

    `cost_*`: the engine's step cost model (scheduler/cost_model.py) fitted by least squares to the whole steps
    (step_ms) of this epoch, t = base + per_token * decode tokens + per_prompt_token * prompt tokens + spec *
    [drafted]. A step's prompt tokens are its scheduled tokens less one per request and its drafts (a prefilling
    request's chunk less one); a term the epoch cannot show (no prefill, no drafted step, or only drafted steps) is
    None. What `das bench validate` replays a run under."""

    steps: int
    requests: float
    tokens: float
    drafts: float
    forward_ms: float
    sample_ms: float
    propose_ms: float
    rest_ms: float
    gap_ms: float
    step_ms: float
    drafted_steps: int
    sample_ms_drafted: float | None
    sample_ms_plain: float | None
    fit_base_ms: float | None
    fit_ms_per_token: float | None
    cost_base_ms: float | None = None
    cost_ms_per_token: float | None = None
    cost_ms_per_prompt_token: float | None = None
    cost_spec_ms: float | None = None
    model_ms: float = 0.0
    prepare_ms: float = 0.0
    budget_ms: float = 0.0
    host_ms: float = 0.0

    @classmethod
    def of(cls, columns: dict[str, list[float]]) -> StepProfile:
        data = {name: np.asarray(columns.get(name, []), dtype=np.float64) for name in FIELDS}
        n = len(data["tokens"])
        if n == 0:
            return cls(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, None, None, None, None)
        for name in ("model_s", "budget_s"):  # columns of a timer that did not record them
            if data[name].size != n:
                data[name] = np.zeros(n)

        def ms(name: str, rows: np.ndarray | None = None) -> float:
            values = data[name] if rows is None else data[name][rows]
            return round(float(values.mean()) * 1e3, 3)

        drafted = data["drafts"] > 0

        fit_base = fit_slope = None
        if len(np.unique(data["tokens"])) >= 2:
            slope, base = np.polyfit(data["tokens"], (data["forward_s"] + data["sample_s"]) * 1e3, 1)
            fit_base, fit_slope = round(float(base), 3), round(float(slope), 4)
        step_s = sum(data[p] for p in PARTS)
        cost = _step_cost_fit(data, step_s)
        return cls(steps=n, requests=round(float(data["requests"].mean()), 2),
                   tokens=round(float(data["tokens"].mean()), 2), drafts=round(float(data["drafts"].mean()), 2),
                   forward_ms=ms("forward_s"), sample_ms=ms("sample_s"), propose_ms=ms("propose_s"),
                   rest_ms=ms("rest_s"), gap_ms=ms("gap_s"),
                   step_ms=round(float(step_s.mean()) * 1e3, 3),
                   drafted_steps=int(drafted.sum()),
                   sample_ms_drafted=ms("sample_s", drafted) if drafted.any() else None,
                   sample_ms_plain=ms("sample_s", ~drafted) if (~drafted).any() else None,
                   fit_base_ms=fit_base, fit_ms_per_token=fit_slope, **cost,
                   model_ms=ms("model_s"), prepare_ms=round(float((data["forward_s"] - data["model_s"]).mean()) * 1e3, 3),
                   budget_ms=ms("budget_s"), host_ms=round(float((step_s - data["model_s"]).mean()) * 1e3, 3))


def _step_cost_fit(data: dict[str, np.ndarray], step_s: np.ndarray) -> dict[str, float | None]:
    """StepProfile's cost_* fields (ms) from the step columns and whole step times (s)."""
    prompt = np.maximum(data["tokens"] - data["requests"] - data["drafts"], 0.0)
    columns = {"cost_base_ms": np.ones_like(step_s), "cost_ms_per_token": data["tokens"] - prompt,
               "cost_ms_per_prompt_token": prompt, "cost_spec_ms": (data["drafts"] > 0).astype(np.float64)}
    # a term is fitted only where the epoch shows it varying (prefill in some steps, drafts in some but not all)
    shown = [name for name, col in columns.items()
             if name == "cost_base_ms" or (len(np.unique(col)) >= 2)]
    out: dict[str, float | None] = dict.fromkeys(columns)
    if len(step_s) <= len(shown) or "cost_ms_per_token" not in shown:
        return out
    coef, *_ = np.linalg.lstsq(np.stack([columns[name] for name in shown], axis=1), step_s, rcond=None)
    out.update({name: round(float(c) * 1e3, 4) for name, c in zip(shown, coef)})
    return out
