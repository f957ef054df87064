"""`EngineConfig`: everything that shapes one engine, as one typed object that the service validates when it starts
(`das serve`) and hands to its engine actors, without importing vLLM (the coordinator holds one)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from das.drafter.config import DrafterConfig
from das.scheduler.cost_model import prior_cost_model
from das.scheduler.policies import Budget, DasBudget
from das.service.engine.cpu_allocator import CpuAllocator
from das.service.engine.cpu_layout import CpuWorker
from das.service.engine.runner_choice import ModelRunner
from das.service.wire.weight_transfer import TransferBackend, TransferChoice

Speculation = Literal["none", "das", "ngram", "suffix"]

PROPOSER_CLASS = "das.service.engine.vllm.proposer.DasProposer"


def budget_settings(config: EngineConfig) -> dict[str, Any]:
    """The proposer's budget settings as plain data (they cross into vLLM's engine core): `config.budget` with,
    unless it names its own cost model, the prior the engine's online cost fit starts from (a stored `das calibrate`
    result for this model, a shipped calibration, or the generic prior: scheduler/cost_model.py
    `prior_cost_model`)."""
    settings = config.budget.model_dump(exclude_none=True)
    if not config.budget.names_cost_model():
        settings["prior"] = dataclasses.asdict(prior_cost_model(config.model))
    return settings


def transfer_backend(choice: TransferChoice, *, gpu: bool) -> TransferBackend | None:
    """The weight-transfer backend engines start with (vLLM's `weight_transfer_config`): `choice`, where "auto" is
    nccl on GPU engines and gloo on CPU engines, and "none" none (vLLM's transfer routes then answer 501)."""
    if choice == "none":
        return None
    if choice == "auto":
        return "nccl" if gpu else "gloo"
    return choice


class EngineConfig(BaseModel):
    """Everything that shapes one engine. `model` is a prepared model directory (service/engine/vllm/models.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["vllm"] = "vllm"
    model: str
    speculation: Speculation = Field("das", description="speculative decoding: das (ours), none, or vLLM's ngram "
                                     "or suffix")
    num_speculative_tokens: int = Field(8, ge=1, le=64, description="draft tokens a request verifies in a step at "
                                        "most (vLLM's num_speculative_tokens)")
    budget: Budget = Field(DasBudget(), description="the draft budget: a name or the fields of a budget "
                           "(scheduler/policies.py); default: the length-aware budget (das) on an online cost model")
    drafter: DrafterConfig = Field(DrafterConfig(), description="the drafter's configuration (drafter/config.py); "
                                   "max_depth, unless set, fits num_speculative_tokens")
    cost_warmup_requests: int = Field(16, ge=0, le=256, description="the das budget only: requests of the start-up "
                                      "decode that shows the online cost fit every batch size from this many down to 1 "
                                      "(service/engine/vllm/cost_warmup.py); 0: none")
    dtype: Literal["auto", "bfloat16", "float32", "float16"] = Field(
        "auto", description="auto: bfloat16 on a GPU or a CPU with native bfloat16 (avx512_bf16 / amx_bf16), else "
                            "float32 (`serving_dtype`)")
    max_model_len: int = Field(2048, ge=16, description="context length, tokens")
    max_num_seqs: int = Field(256, ge=1)
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="model workers of one engine, each computing a "
                                      "shard of the model on a GPU of its own (vLLM's tensor parallelism); a GPU node "
                                      "runs its GPUs / this many engines (service/cluster/engine_layout.py); on a CPU "
                                      "above 1 the workers run in processes of their own, whatever cpu_worker says")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="vLLM's engine seed (32-bit: numpy's legacy seeding "
                      "refuses more); keyed sampling draws with the groups' own int64 seeds")
    keyed_sampling: bool = Field(True, description="draw every sampled token with a key of (group seed, sample "
                                 "index, position) (service/engine/vllm/keyed_sampler.py): the same tokens with or "
                                 "without speculation; False: vLLM's own sampler (the distribution tests' reference)")
    kv_cache_gib: int = Field(2, ge=1, description="CPU KV cache (VLLM_CPU_KVCACHE_SPACE), GiB")
    enable_prefix_caching: bool = True
    block_size: int | None = Field(None, ge=1, description="tokens per KV-cache block; None: vLLM's default on a "
                                   "GPU, CPU_BLOCK_SIZE on the CPU (`kv_block_size`)")
    enforce_eager: bool = Field(False, description="skip torch.compile: starts in seconds, decodes slower (tests)")
    model_runner: ModelRunner = Field("keyed", description="keyed: V1 without async scheduling wherever keyed "
                                      "sampling needs it (a GPU engine), so samples match across speculation methods; "
                                      "v1: V1 without async scheduling everywhere; auto: vLLM's choice (on a GPU "
                                      "without speculation V2 with async scheduling, samples not keyed) "
                                      "(runner_choice.py)")
    profile_steps: bool = Field(False, description="time every engine step by part (service/engine/vllm/step_profile.py:"
                                " the forward pass against the host's work) and export the sums as "
                                "das_engine_step_part_seconds_total; costs a device synchronisation per part on a GPU")
    cpu_worker: CpuWorker = Field("auto", description="a CPU engine's model worker: in_process (in the engine core "
                                  "process, every core computes), separate (vLLM's CPU layout: a worker process, one "
                                  "core reserved for the engine core), auto: in_process on up to 4 usable CPUs "
                                  "(service/engine/cpu_layout.py); ignored on a GPU")
    cpu_allocator: CpuAllocator = Field("auto", description="a CPU engine core's malloc: jemalloc (Ray's, keeping "
                                        "freed pages for reuse: large-vocabulary logits are not page-faulted in anew "
                                        "every step), system, or auto: jemalloc for a vocabulary of 2**17 entries or "
                                        "more (service/engine/cpu_allocator.py); ignored on a GPU")
    oracle_file: str | None = Field(None, description="benchmarks only (`das bench serve --arms none,oracle`): "
                                    "a file of recorded outputs by sample key (drafter/oracle.py) that samples with "
                                    "those keys draft instead of the history bank's drafts; needs speculation das")
    weight_transfer: TransferChoice = Field("auto", description="vLLM's weight transfer (das serve --weight-transfer): "
                                            "nccl (vLLM's NCCL engine, GPU engines), gloo (ours, "
                                            "service/engine/vllm/weight_transfer.py), none, or auto: nccl on GPU engines, "
                                            "gloo on CPU engines (`transfer_backend`)")
    otlp_traces_endpoint: str | None = Field(None, description="the OTLP/HTTP traces URL vLLM's own spans go to "
                                             "(each request's under the rollout.sample span its group names, "
                                             "GroupRequest.trace_parents): das serve sets the gateway's "
                                             "--otlp-traces-endpoint, checked there (service/config.py traces_url); "
                                             "None: vLLM traces nothing and the trace parents are not passed on")
    suffix_options: dict[str, Any] = Field(default_factory=dict, description="vLLM SpeculativeConfig "
                                           "suffix_decoding_* settings of the suffix method (vLLM's defaults if "
                                           "empty)")

    @field_validator("suffix_options")
    @classmethod
    def _suffix_keys(cls, options: dict[str, Any]) -> dict[str, Any]:
        # Only suffix settings: anything else would silently change what the method is compared on.
        bad = sorted(k for k in options if not k.startswith("suffix_decoding_"))
        if bad:
            raise ValueError(f"suffix_options takes suffix_decoding_* settings only, got {bad}")
        return options

    @field_validator("oracle_file")
    @classmethod
    def _oracle_needs_das(cls, path: str | None, info: Any) -> str | None:
        if path is not None and info.data.get("speculation") != "das":
            raise ValueError("oracle_file drafts through the das proposer: it needs speculation das")
        return path

    @property
    def engines_per_actor(self) -> int:
        """A vLLM engine has a Ray actor of its own: one engine core dying takes no other engine with it."""
        return 1

    @property
    def cpu_workers(self) -> int:
        """Model workers the engine runs on a node without a GPU (service/cluster/engine_layout.py checks they fit)."""
        return self.tensor_parallel_size

    def speculative_config(self) -> dict[str, Any] | None:
        k = self.num_speculative_tokens
        if self.speculation == "none":
            return None
        if self.speculation == "das":
            return {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": k}
        if self.speculation == "ngram":
            return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 5, "prompt_lookup_min": 2}
        return {"method": "suffix", "num_speculative_tokens": k, **self.suffix_options}
