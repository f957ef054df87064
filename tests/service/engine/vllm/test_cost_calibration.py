"""The calibration loop (the vLLM timer itself is exercised by `das calibrate` on a real engine)."""

from __future__ import annotations

import pytest

from das.service.engine.vllm.cost_calibration import calibrate


def test_medians_and_fit_recover_a_noisy_linear_engine():
    calls = []

    def timer(batch: int) -> float:
        calls.append(batch)
        noise = [0.0, 0.5, -0.5][len(calls) % 3]  # the median of each point's three timings is noise-free
        return 0.02 + 0.001 * batch + noise

    result = calibrate("fake", timer, [1, 8, 64, 8], repeats=3, source="test")
    assert sorted(set(calls)) == [1, 8, 64] and len(calls) == 9
    assert [p[0] for p in result.points] == [1, 8, 64]
    assert result.model.c_base_s == pytest.approx(0.02) and result.model.c_tok_s == pytest.approx(0.001)


def test_the_prefill_price_is_the_median_of_its_probe():
    timings = iter([3e-3, 50e-3, 2e-3])  # one outlier among three
    result = calibrate("fake", lambda b: 0.02 + 0.001 * b, [1, 8], repeats=3, source="test",
                       prefill=lambda: next(timings))
    assert result.model.c_prefill_s == pytest.approx(3e-3)
    assert calibrate("fake", lambda b: 0.02 + 0.001 * b, [1, 8], repeats=1, source="test").model.c_prefill_s is None


def test_a_timing_at_or_below_zero_is_a_clear_error():
    with pytest.raises(ValueError, match="too busy"):
        calibrate("x", lambda b: 0.02 - 0.001 * b, [1, 32], repeats=1, source="s")
    with pytest.raises(ValueError, match="prompt token.*too busy"):
        calibrate("x", lambda b: 0.02 + 0.001 * b, [1, 32], repeats=1, source="s", prefill=lambda: -1e-4)


def test_needs_two_batch_sizes():
    with pytest.raises(ValueError, match="two distinct"):
        calibrate("x", lambda b: 1.0, [4, 4], repeats=1, source="s")
    with pytest.raises(ValueError, match="repeats"):
        calibrate("x", lambda b: 1.0, [1, 4], repeats=0, source="s")


class _EngineFailingOnFirstRequest:
    """Stands in for `VllmEngine`: starts, fails the first request (an engine core that dies during the warm-up),
    and records its close."""

    closed = 0

    @classmethod
    async def create(cls, config: object) -> _EngineFailingOnFirstRequest:
        return cls()

    async def generate(self, group: object):
        raise RuntimeError("engine core died")
        yield

    async def close(self) -> None:
        type(self).closed += 1


def test_a_failed_warm_up_closes_the_served_engine(monkeypatch, tmp_path):
    from das.service.engine.vllm import cost_calibration

    monkeypatch.setattr(cost_calibration, "VllmEngine", _EngineFailingOnFirstRequest)
    with pytest.raises(RuntimeError, match="engine core died"):
        with cost_calibration.ServedEngineTimer(tmp_path, max_batch=4):
            pass
    assert _EngineFailingOnFirstRequest.closed == 1
