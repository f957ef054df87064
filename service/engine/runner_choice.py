"""Which vLLM model runner and scheduling an engine runs, and whether our keyed draw samples its tokens.

vLLM 0.32 picks model runner V2 unless the configuration needs V1: `custom_class` (ours) and `suffix` speculation
are on V2's unsupported list, and async scheduling is off for them, while an engine without speculation runs V2
with async scheduling on a GPU (tests/service/engine/vllm/test_gpu_contract.py checks these rules in the GPU wheel).
Our keyed draw wraps V1's sampler and rejection sampler only (keyed_cuda.py): on V2 a step samples with V2's own
Gumbel draw, so a seed would no longer give the same sample with and without speculation.

`ModelRunner` (EngineConfig.model_runner):
- "keyed" (the default): V1 with async scheduling off wherever keyed sampling needs it (a GPU engine with keyed
  sampling), vLLM's choice elsewhere: every arm samples with the same keyed draw, so samples match across
  speculation methods, and every arm pays V1's host time a step (the like-for-like comparison);
- "v1": V1 with async scheduling off on every platform (VLLM_USE_V2_MODEL_RUNNER=0, read when the engine is
  configured);
- "auto": vLLM's choice, plain vLLM as users run it (on a GPU without speculation: V2 with async scheduling);
  samples there are not keyed, and the engine says so when it starts.
On the CPU without Triton every engine runs V1 whatever the choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

ModelRunner = Literal["keyed", "v1", "auto"]
V2_SWITCH = "VLLM_USE_V2_MODEL_RUNNER"
KEYED_PLATFORMS = ("cpu", "cuda")  # the platforms whose V1 samplers our keyed draw wraps (patches.py)


def forces_v1(choice: ModelRunner, keyed_sampling: bool, cpu: bool) -> bool:
    """Whether an engine configured with `choice` is started on model runner V1 with async scheduling off."""
    return choice == "v1" or (choice == "keyed" and keyed_sampling and not cpu)


@dataclass(frozen=True)
class RunnerChoice:
    """What an engine runs: platform ("cpu", "cuda", ...), model runner ("V1", "V2"), async scheduling on or off,
    and `keyed`: whether every sampled token is our keyed draw (the same samples with and without speculation)."""

    platform: str
    model_runner: str
    async_scheduling: bool
    keyed: bool = False

    @classmethod
    def of(cls, vllm_config: Any, platform: str, keyed_sampling: bool = True) -> RunnerChoice:
        """Read from a configured engine's VllmConfig (call while the engine's environment is in place: vLLM reads
        the runner switch from it)."""
        runner = "V2" if vllm_config.use_v2_model_runner else "V1"
        return cls(platform, runner, bool(vllm_config.scheduler_config.async_scheduling),
                   keyed_sampling and platform in KEYED_PLATFORMS and runner == "V1")

    @property
    def step_timer_applies(self) -> bool:
        """Whether the step timer (step_profile.py) can time this engine: it wraps V1's runner methods, and its
        device waits would undo async scheduling's overlap."""
        return self.model_runner == "V1" and not self.async_scheduling

    def describe(self) -> str:
        return (f"{self.platform} model runner {self.model_runner}, async scheduling "
                f"{'on' if self.async_scheduling else 'off'}, {'keyed' if self.keyed else 'unkeyed'} sampling")
