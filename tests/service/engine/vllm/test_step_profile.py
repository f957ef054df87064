"""RunnerStepTimer against a stand-in model runner that calls its parts the way vLLM's does, and StepProfile's sums."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from das.service.engine.contract import IDLE_GAP_S
from das.service.engine.vllm.step_profile import RunnerStepTimer, StepProfile, StepProfileExtension, device_sync


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class Runner:
    """Like vLLM's GPUModelRunner: execute_model, then sample_tokens, which calls _sample and then (with a
    drafter) propose_draft_token_ids through the instance, so wrapped attributes are the ones called."""

    def __init__(self, forward_s: float, sample_s: float, propose_s: float | None) -> None:
        self.forward_s, self.sample_s, self.propose_s = forward_s, sample_s, propose_s

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        time.sleep(self.forward_s)

    def _sample(self, logits: Any, metadata: Any) -> str:
        time.sleep(self.sample_s)
        return "sampled"

    def propose_draft_token_ids(self, *args: Any) -> list[list[int]]:
        assert self.propose_s is not None
        time.sleep(self.propose_s)
        return [[1, 2]]

    def sample_tokens(self, grammar_output: Any) -> str:
        out = self._sample(None, None)
        if self.propose_s is not None:
            self.propose_draft_token_ids(out)
        return out


def step(runner: Runner, output: SchedulerOutput, gap_s: float = 0.0) -> None:
    runner.execute_model(output)
    assert runner.sample_tokens(None) == "sampled"  # results pass through the timers unchanged
    time.sleep(gap_s)


def test_each_part_of_a_step_is_timed_with_its_shape() -> None:
    runner = Runner(forward_s=0.03, sample_s=0.01, propose_s=0.005)
    timer = RunnerStepTimer(runner)
    step(runner, SchedulerOutput({"a": 3, "b": 1}, {"a": [7, 8]}), gap_s=0.02)
    step(runner, SchedulerOutput({"a": 1}), gap_s=0.0)
    cols = timer.take()
    assert cols["requests"] == [2, 1] and cols["tokens"] == [4, 1] and cols["drafts"] == [2, 0]
    assert 0.03 <= cols["forward_s"][0] < 0.06 and 0.01 <= cols["sample_s"][0] < 0.03
    assert 0.005 <= cols["propose_s"][0] < 0.02 and 0 <= cols["rest_s"][0] < 0.005
    assert 0.02 <= cols["gap_s"][0] < 0.04  # the time until the next step started
    assert cols["gap_s"][1] == 0.0  # the last step has no next step yet
    assert timer.take() == {name: [] for name in cols}  # taken means forgotten


def test_an_idle_engine_is_not_loop_overhead() -> None:
    runner = Runner(forward_s=0.0, sample_s=0.0, propose_s=None)
    timer = RunnerStepTimer(runner)
    step(runner, SchedulerOutput({"a": 1}), gap_s=IDLE_GAP_S + 0.05)
    step(runner, SchedulerOutput({"a": 1}))
    cols = timer.take()
    assert cols["gap_s"] == [0.0, 0.0] and cols["propose_s"] == [0.0, 0.0]


class QueuedDevice:
    """A stand-in GPU: the runner's calls queue work and return at once; synchronize() waits for it."""

    def __init__(self) -> None:
        self.pending_s = 0.0
        self.syncs = 0

    def queue(self, seconds: float) -> None:
        self.pending_s += seconds

    def synchronize(self, device: Any = None) -> None:
        self.syncs += 1
        time.sleep(self.pending_s)
        self.pending_s = 0.0


def test_on_a_gpu_every_clock_read_waits_for_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    gpu = QueuedDevice()
    monkeypatch.setattr(torch.cuda, "synchronize", gpu.synchronize)
    runner = Runner(forward_s=0.0, sample_s=0.0, propose_s=0.0)
    runner.device = torch.device("cuda", 0)
    execute, sample = runner.execute_model, runner._sample
    runner.execute_model = lambda output: (gpu.queue(0.03), execute(output))[1]  # returns before the work is done
    runner._sample = lambda *args: (gpu.queue(0.01), sample(*args))[1]
    timer = RunnerStepTimer(runner)  # the default hook: the runner's device is CUDA
    step(runner, SchedulerOutput({"a": 1}))
    cols = timer.take()
    assert gpu.syncs == 8  # before each of the eight clock reads of a drafted step
    assert cols["forward_s"][0] >= 0.03 and cols["sample_s"][0] >= 0.01  # the device time, not the launch time


def test_no_device_wait_on_the_cpu() -> None:
    import torch

    assert device_sync(Runner(0.0, 0.0, None)) is None
    cpu = Runner(0.0, 0.0, None)
    cpu.device = torch.device("cpu")
    assert device_sync(cpu) is None


def test_profile_means_and_the_fitted_cost_line() -> None:
    tokens = [1, 10, 20, 40]
    columns = {"forward_s": [(5 + 0.5 * n) / 1e3 for n in tokens], "sample_s": [0.001] * 4,
               "propose_s": [0.0, 0.002, 0.002, 0.0], "rest_s": [0.0005] * 4, "gap_s": [0.001] * 4,
               "requests": [1, 2, 4, 8], "tokens": tokens, "drafts": [0, 8, 16, 32]}
    p = StepProfile.of(columns)
    assert p.steps == 4 and p.requests == 3.75 and p.tokens == 17.75 and p.drafts == 14.0
    assert p.propose_ms == pytest.approx(1.0) and p.sample_ms == pytest.approx(1.0)
    assert p.step_ms == pytest.approx(p.forward_ms + p.sample_ms + p.propose_ms + p.rest_ms + p.gap_ms, abs=1e-2)
    assert p.fit_base_ms == pytest.approx(6.0, abs=1e-3) and p.fit_ms_per_token == pytest.approx(0.5, abs=1e-4)
    assert p.drafted_steps == 3
    assert p.sample_ms_drafted == pytest.approx(1.0) and p.sample_ms_plain == pytest.approx(1.0)
    plain = StepProfile.of({**columns, "drafts": [0] * 4})
    assert plain.drafted_steps == 0 and plain.sample_ms_drafted is None and plain.sample_ms_plain == pytest.approx(1.0)
    one_shape = StepProfile.of({**columns, "tokens": [4] * 4})
    assert one_shape.fit_base_ms is None and one_shape.fit_ms_per_token is None
    assert StepProfile.of({}).steps == 0


def test_the_step_cost_fit_separates_decode_prompt_and_drafted_steps() -> None:
    """Steps made by t = 50 ms + 4 ms per decode token + 3 ms per prompt token + 10 ms when drafted (prompt tokens
    = scheduled tokens less one per request and the drafts), all in forward_s."""
    rng = np.random.default_rng(1)
    requests = rng.integers(1, 64, 60)
    drafts = rng.integers(0, 3, 60) * rng.integers(0, 2, 60)
    prompt = np.where(rng.random(60) < 0.2, rng.integers(50, 500, 60), 0)
    tokens = requests + drafts + prompt
    step_s = (50 + 4 * (requests + drafts) + 3 * prompt + 10 * (drafts > 0)) / 1e3
    zeros = [0.0] * 60
    columns = {"forward_s": step_s.tolist(), "sample_s": zeros, "propose_s": zeros, "rest_s": zeros,
               "gap_s": zeros, "requests": requests.tolist(), "tokens": tokens.tolist(), "drafts": drafts.tolist()}
    p = StepProfile.of(columns)
    assert (p.cost_base_ms, p.cost_ms_per_token, p.cost_ms_per_prompt_token, p.cost_spec_ms) == pytest.approx(
        (50.0, 4.0, 3.0, 10.0), abs=1e-3)
    no_prefill = StepProfile.of({**columns, "tokens": (requests + drafts).tolist(),
                                 "forward_s": ((50 + 4 * (requests + drafts) + 10 * (drafts > 0)) / 1e3).tolist()})
    assert no_prefill.cost_ms_per_prompt_token is None and no_prefill.cost_ms_per_token == pytest.approx(4.0)


def test_the_worker_extension_starts_once_and_refuses_a_take_before_start() -> None:
    class Worker(StepProfileExtension):
        def __init__(self) -> None:
            self.model_runner = Runner(0.0, 0.0, None)

    worker = Worker()
    with pytest.raises(RuntimeError, match="not started"):
        worker.das_profile_take()
    assert worker.das_profile_start()
    wrapped = worker.model_runner.execute_model
    step(worker.model_runner, SchedulerOutput({"a": 2}))
    assert worker.das_profile_start()  # clears, does not wrap twice
    assert worker.model_runner.execute_model is wrapped
    assert worker.das_profile_take()["tokens"] == []
    step(worker.model_runner, SchedulerOutput({"a": 2}))
    assert worker.das_profile_take()["tokens"] == [2]


class Budget:
    def plan(self, view: Any, params: Any) -> str:
        time.sleep(0.004)
        return "plan"


class DraftingRunner(Runner):
    """A runner whose execute_model runs `_model_forward` and the model's `compute_logits` (the forward pass) after
    preparing inputs, and whose drafter plans with a budget hook, as the V1 runner and DasProposer do."""

    def __init__(self) -> None:
        super().__init__(forward_s=0.0, sample_s=0.002, propose_s=None)
        self.model = SimpleNamespace(compute_logits=lambda hidden: time.sleep(0.003))
        self.drafter = SimpleNamespace(budget=Budget())

    def _model_forward(self, **inputs: Any) -> str:
        time.sleep(0.02)
        return "hidden"

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        time.sleep(0.01)  # input preparation on the host
        self.model.compute_logits(self._model_forward(input_ids=None))

    def propose_draft_token_ids(self, *args: Any) -> list[list[int]]:
        assert self.drafter.budget.plan(None, None) == "plan"
        time.sleep(0.002)
        return [[1]]

    def sample_tokens(self, grammar_output: Any) -> str:
        out = self._sample(None, None)
        self.propose_draft_token_ids(out)
        return out


def test_the_forward_pass_and_the_budget_are_timed_apart_from_the_host_work() -> None:
    runner = DraftingRunner()
    timer = RunnerStepTimer(runner)
    step(runner, SchedulerOutput({"a": 1}), gap_s=0.005)
    step(runner, SchedulerOutput({"a": 1}))
    cols = timer.take()
    assert 0.023 <= cols["model_s"][0] < 0.035  # _model_forward + compute_logits, not the input preparation
    assert cols["forward_s"][0] - cols["model_s"][0] >= 0.01
    assert 0.004 <= cols["budget_s"][0] < cols["propose_s"][0]
    profile = StepProfile.of(cols)
    assert profile.host_ms == pytest.approx(profile.step_ms - profile.model_ms, abs=2e-3)
    assert profile.prepare_ms == pytest.approx(profile.forward_ms - profile.model_ms, abs=2e-3)
    assert profile.host_ms >= 10 + 2 + 4  # preparation, sampling, budget at least


def test_step_part_totals_sum_takes_and_give_the_host_time_a_step() -> None:
    from das.service.engine.contract import StepPartTotals

    assert StepPartTotals().host_ms_per_step() is None
    take = {"forward_s": [0.03, 0.03], "sample_s": [0.01, 0.01], "propose_s": [0.0, 0.0], "rest_s": [0.0, 0.0],
            "gap_s": [0.002, 0.0], "model_s": [0.02, 0.02], "budget_s": [0.0, 0.0], "tokens": [1, 1]}
    totals = StepPartTotals().add(take).add(take)
    assert totals.steps == 4 and dict(totals.seconds)["model_s"] == pytest.approx(0.08)
    assert totals.host_ms_per_step() == pytest.approx((2 * (0.06 + 0.02 + 0.002) - 0.08) / 4 * 1e3)
