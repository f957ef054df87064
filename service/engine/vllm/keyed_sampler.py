"""Keyed sampling in vLLM's CPU worker: every sampled token is `argmax_v(logit_v + Gumbel(key, v))`, the Gumbel
noise a function of the row's key alone (vLLM's own fused Gumbel-max kernel, `_C.fused_gumbel_argmax`, which
seeds each vocabulary entry's SplitMix64 stream from the row's seed), the key a function of (sample key,
position) (das.service.wire.sample_keys). Nothing depends on a generator's running state, the batch's shape or the
step's drafts, so a sample draws the same tokens with or without speculation.

- Plain steps and bonus tokens: `TopKTopPSampler.forward_cpu` is vLLM's body with the row seeds replaced by the
  rows' keys: the same kernel at the same cost (rows of unkeyed requests keep vLLM's random seeds).
- Verification (cpu_fixes.rejection, with `target_row_keys`): a draft token is accepted iff it equals the token
  the keyed sampler draws from the target row at its position; at the first mismatch that keyed token is the
  correction; after the last accepted draft the bonus token is the keyed draw at the next position. For the
  drafter's point-mass drafts a draft d is accepted with probability p(d), as under rejection sampling (so
  acceptance is unchanged), and the emitted tokens are by construction the tokens plain decoding would draw. Cost:
  one kernel pass over the vocabulary per draft row up to the request's first rejection (the rows after it are
  never drawn; ~0.14 ms a row for SmolLM2's 49,152 entries here).

The engine puts a sample's key in `SamplingParams.extra_args[SAMPLE_KEY]`; positions are the tokens a request has
generated (`num_tokens_no_spec - num_prompt_tokens` of vLLM's input batch, plus `extra_args[POSITION_OFFSET]`: the
tokens a resumed sample had before its request), so preemption (recompute), re-running a sample and resuming it from
its delivered tokens reproduce its tokens. The model runner's `_sample` publishes the step's keys in a context
variable that the sampler and the rejection sampler read; it is unset outside a step, where they behave as vLLM's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from das.service.engine.vllm.extra_args import POSITION_OFFSET, SAMPLE_KEY
from das.service.engine.vllm.row_keys import row_keys


@dataclass(frozen=True)
class StepKeys:
    """The keys of one step's requests, in the input batch's order.

    sample_keys: int64 [requests] (0 where unkeyed); keyed: bool [requests]; positions: int64 [requests], tokens
    each request generated before this step; drafts: int64 [requests], draft tokens verified for it this step."""

    sample_keys: np.ndarray
    keyed: np.ndarray
    positions: np.ndarray
    drafts: np.ndarray

    def sampler_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 keys, bool keyed) of the rows the plain sampler draws: one per request, the token after its
        drafts (its only token on a step without drafts)."""
        keys = row_keys(self.sample_keys, self.positions + self.drafts)
        return torch.from_numpy(keys), torch.from_numpy(self.keyed)

    def target_row_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 keys, bool keyed) of the verification rows: request i's draft j is verified at position
        positions[i] + j; rows request by request, as vLLM lays out the target logits."""
        req = np.repeat(np.arange(len(self.drafts)), self.drafts)
        within = np.arange(len(req)) - np.repeat(np.cumsum(self.drafts) - self.drafts, self.drafts)
        keys = row_keys(self.sample_keys[req], self.positions[req] + within)
        return torch.from_numpy(keys), torch.from_numpy(self.keyed[req])


_step: ContextVar[StepKeys | None] = ContextVar("das_step_keys", default=None)


def current_step() -> StepKeys | None:
    """The keys of the step being sampled, or None outside the model runner's `_sample` (or with no keyed
    request in it)."""
    return _step.get()


def keyed_tokens(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: the keyed Gumbel-max draw from each row of processed logits (float32 [rows, vocab]; -inf
    cells are never drawn). vLLM's CPU kernel; one pass over the vocabulary per row."""
    return torch.ops._C.fused_gumbel_argmax(logits.to(torch.float32).contiguous(), keys.contiguous()).to(torch.int64)


def step_keys(runner: Any, drafts: list[int] | None) -> StepKeys | None:
    """The keys of the runner's current input batch (None if no request is keyed). Cost: one dictionary lookup per
    request and vectorised arithmetic."""
    batch = runner.input_batch
    n = batch.num_reqs
    keys = np.zeros(n, dtype=np.int64)
    keyed = np.zeros(n, dtype=bool)
    offsets = np.zeros(n, dtype=np.int64)  # a resumed sample's tokens from before its request (POSITION_OFFSET)
    for i, req_id in enumerate(batch.req_ids[:n]):
        extra = runner.requests[req_id].sampling_params.extra_args
        key = extra.get(SAMPLE_KEY) if extra else None
        if key is not None:
            keys[i], keyed[i] = key, True
            offsets[i] = extra.get(POSITION_OFFSET, 0)
    if not keyed.any():
        return None
    positions = (batch.num_tokens_no_spec[:n] - batch.num_prompt_tokens[:n]).astype(np.int64) + offsets
    counts = np.zeros(n, dtype=np.int64) if drafts is None else np.asarray(drafts, dtype=np.int64)
    return StepKeys(keys, keyed, positions, counts)


@contextmanager
def keys_of_step(step: StepKeys | None) -> Iterator[None]:
    """Makes `step` the current step's keys for the block (what the sampler and the rejection sampler draw with)."""
    token = _step.set(step)
    try:
        yield
    finally:
        _step.reset(token)


def publish_step_keys(original: Any) -> Any:
    """Wraps the model runner's `_sample(logits, spec_decode_metadata)`: the step's keys are current while it
    samples."""

    def _sample(self: Any, logits: Any, spec_decode_metadata: Any) -> Any:
        drafts = None if spec_decode_metadata is None else spec_decode_metadata.num_draft_tokens
        with keys_of_step(step_keys(self, drafts)):
            return original(self, logits, spec_decode_metadata)

    _sample.__wrapped__ = original  # type: ignore[attr-defined]
    return _sample


def keyed_forward_cpu(original: Any) -> Any:
    """Wraps `TopKTopPSampler.forward_cpu`: vLLM's steps (top-k/top-p, processed logprobs, the fused Gumbel-max
    kernel) with each keyed row's seed its key; vLLM's own method where nothing is keyed."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    def forward_cpu(self: Any, logits: torch.Tensor, generators: dict[int, torch.Generator],
                    k: torch.Tensor | None, p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        step = current_step()
        if step is None or self.use_fp64_gumbel or logits.shape[0] != len(step.keyed):
            return original(self, logits, generators, k, p)
        logits = apply_top_k_top_p(logits, k, p)
        processed = None
        # A step with drafts samples here only its bonus rows, for which the rejection sampler wants processed
        # logits (its `logprobs_mode_override`, which vLLM does not hand down to this sampler): it takes the
        # log-softmax of the rows it keeps (cpu_fixes.rejection.logprobs_of_kept_cells), so one here would be
        # thrown away or taken twice (one vocabulary-wide pass, and a write, per request).
        if self.logprobs_mode == "processed_logits" or (self.logprobs_mode == "processed_logprobs"
                                                        and step.drafts.any()):
            processed = logits
        elif self.logprobs_mode == "processed_logprobs":
            processed = logits.log_softmax(dim=-1, dtype=torch.float32)
        keys, keyed = step.sampler_keys()
        seeds = torch.where(keyed, keys, torch.randint(0, 2**31, keys.shape, dtype=torch.int64))
        for i, generator in generators.items():  # a vLLM-seeded request (no key) keeps its generator
            if not keyed[i]:
                seeds[i] = torch.randint(0, 2**31, (1,), generator=generator, dtype=torch.int64).item()
        return keyed_tokens(logits, seeds), processed

    forward_cpu.__wrapped__ = original  # type: ignore[attr-defined]
    return forward_cpu


def install() -> None:
    """Installs keyed sampling in this (CPU) worker process; idempotent."""
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if not hasattr(TopKTopPSampler.forward_cpu, "__wrapped__"):
        TopKTopPSampler.forward_cpu = keyed_forward_cpu(TopKTopPSampler.forward_cpu)
    if not getattr(CPUModelRunner._sample, "_das_keyed", False):
        CPUModelRunner._sample = publish_step_keys(CPUModelRunner._sample)
        CPUModelRunner._sample._das_keyed = True  # type: ignore[attr-defined]
