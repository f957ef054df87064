"""The worker extension every engine starts with (`worker_extension_cls` in vLLM): `EngineWorkerExtension`, the
methods that connect the engine to its `DasProposer` (`DasWorkerExtension`) and the step timers (step_profile.py).

vLLM mixes this class into its worker, so its methods run in the worker (the engine core's thread when the
executor is in-process) and are reached with `collective_rpc("das_...")`. Everything that crosses the process
boundary is plain data (dicts, lists, ints, strings).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from das.drafter.records import RolloutRecord
from das.service.engine.vllm.extra_args import EXTRA_ARGS_KEY
from das.service.engine.vllm.proposer import DasProposer
from das.service.engine.vllm.step_profile import StepProfileExtension
from das.service.engine.vllm.weight_transfer import WeightTransferExtension


class DasWorkerExtension:
    """Methods added to vLLM's worker; `self.model_runner` is the worker's model runner."""

    model_runner: Any

    def _das_proposer(self) -> DasProposer:
        drafter = getattr(self.model_runner, "drafter", None)
        if not isinstance(drafter, DasProposer):
            raise RuntimeError("this engine does not run the DAS proposer (speculative method custom_class "
                               "with das.service.engine.vllm.proposer.DasProposer)")
        return drafter

    def das_attach(self) -> bool:
        """Hands the proposer the model runner (request ids, sampling params). Call once after start."""
        self._das_proposer().attach(self.model_runner)
        return True

    def das_set_policy_version(self, version: int) -> int:
        proposer = self._das_proposer()
        proposer.set_policy_version(int(version))
        return proposer.policy_version

    def das_pop_counts(self, request_ids: list[str]) -> dict[str, dict[str, int]]:
        counts = self._das_proposer().pop_counts(list(request_ids))
        return {rid: dataclasses.asdict(c) for rid, c in counts.items()}

    def das_add_rollouts(self, rollouts: list[dict[str, Any]]) -> int:
        """Imports finished rollouts (the history format's fields) as sealed history; all are validated first."""
        records = [RolloutRecord.from_dict(r) for r in rollouts]
        return self._das_proposer().bank.add_rollouts(records)

    def das_stats(self) -> dict[str, Any]:
        return self._das_proposer().stats()

    def das_output_counts(self) -> dict[str, int]:
        """Output tokens committed so far by every request the model runner holds (running, or preempted and
        waiting), by the key of its tags (extra_args.RequestTags); any speculative method. What a weight update
        under a paused engine reads to know where each held sample's new weights begin."""
        counts: dict[str, int] = {}
        for state in self.model_runner.requests.values():
            tags = (getattr(state.sampling_params, "extra_args", None) or {}).get(EXTRA_ARGS_KEY) or {}
            if tags.get("key") is not None:
                counts[str(tags["key"])] = len(state.output_token_ids)
        return counts


class EngineWorkerExtension(DasWorkerExtension, StepProfileExtension, WeightTransferExtension):
    """The worker extension every engine starts with: the DAS proposer's methods (used only by das engines), step
    profiling and the service's side of a weight transfer."""
