"""Which vLLM model runner and scheduling an engine runs, and how to make every engine run the same.

vLLM 0.32 picks model runner V2 unless the configuration needs V1: `custom_class` (ours) and `suffix` speculation
are on V2's unsupported list, and async scheduling is off for them, while an engine without speculation runs V2
with async scheduling on a GPU (tests/service/engine/test_gpu_contract.py checks these rules in the GPU wheel). So
on a GPU an arm without speculation and ours would differ in runner as well as in speculation. `model_runner="v1"`
(EngineConfig) forces V1 (VLLM_USE_V2_MODEL_RUNNER=0, read when the engine is configured) and async scheduling
off, the configuration ours needs, for a like-for-like comparison. On the CPU without Triton every engine runs V1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

ModelRunner = Literal["auto", "v1"]
V2_SWITCH = "VLLM_USE_V2_MODEL_RUNNER"


@dataclass(frozen=True)
class RunnerChoice:
    """What an engine runs: platform ("cpu", "cuda"), model runner ("V1", "V2"), async scheduling on or off."""

    platform: str
    model_runner: str
    async_scheduling: bool

    @classmethod
    def of(cls, vllm_config: Any, platform: str) -> RunnerChoice:
        """Read from a configured engine's VllmConfig (call while the engine's environment is in place: vLLM reads
        the runner switch from it)."""
        return cls(platform, "V2" if vllm_config.use_v2_model_runner else "V1",
                   bool(vllm_config.scheduler_config.async_scheduling))

    def describe(self) -> str:
        return (f"{self.platform} model runner {self.model_runner}, async scheduling "
                f"{'on' if self.async_scheduling else 'off'}")
