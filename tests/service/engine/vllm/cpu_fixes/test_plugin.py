"""The CPU fixes (service/engine/vllm/cpu_fixes/plugin.py): `_expand` through vLLM's own rejection-sampler code path and its
kernel dispatcher, the lean rejection sampler installed in a worker, and the plain sampler for steps without
drafts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from das.service.engine.vllm.cpu_fixes.plugin import expand_kernel_impl


@pytest.mark.parametrize("dtype, values", [(torch.float32, [0.8, 0.6, 1.0]), (torch.int32, [5, 0, 7]),
                                           (torch.int64, [5, 0, 7])])
def test_expand_keeps_every_dtype(dtype, values):
    out = torch.full((6,), -99, dtype=dtype)
    expand_kernel_impl(out, torch.tensor(values, dtype=dtype), torch.tensor([2, 5, 6], dtype=torch.int32), 0, 3)
    want = [values[0]] * 2 + [values[1]] * 3 + [values[2]]
    want = [3 if v == 0 else v for v in want]
    assert torch.allclose(out.double(), torch.tensor(want, dtype=torch.float64))


WORKER_STARTUP = """
import json, torch
from vllm.platforms import current_platform
from vllm.plugins import load_general_plugins
from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens
load_general_plugins()  # a vLLM worker's first steps, in this order: plugins, then the platform's kernel overrides
current_platform.register_triton_kernel_overrides()
temps = expand_batch_to_tokens(torch.tensor([0.8, 0.6, 1.0]), torch.tensor([2, 5, 6], dtype=torch.int32), 6)
top_k = expand_batch_to_tokens(torch.tensor([5, 0, 7], dtype=torch.int32), torch.tensor([1, 3, 4], dtype=torch.int32),
                               4, replace_from=0, replace_to=9)
from vllm.v1.sample import rejection_sampler
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
installed = [hasattr(CPUModelRunner._sample, "__wrapped__"),
             rejection_sampler.RejectionSampler._get_logprobs_tensors.__name__ == "logprobs_of_kept_cells",
             hasattr(rejection_sampler.rejection_sample, "__wrapped__")]
print(json.dumps({"temps": temps.tolist(), "top_k": top_k.tolist(), "installed": installed}))
"""


def test_vllm_expand_on_cpu_uses_the_fix():
    # A fresh process, like a vLLM worker: the kernel registration scans every loaded module, and modules other
    # tests import (numba's llvmlite, through vLLM's ngram proposer) make that scan fail in vLLM 0.32.
    done = subprocess.run([sys.executable, "-c", WORKER_STARTUP], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["temps"] == pytest.approx([0.8, 0.8, 0.6, 0.6, 0.6, 1.0])
    assert out["top_k"] == [5, 9, 9, 7]
    assert out["installed"] == [True, True, True]  # the sampling fixes are in place in a worker too


def test_a_step_without_drafts_takes_the_plain_sampler():
    """vLLM's own `_sample` under the wrapper: zero drafts everywhere goes to the sampler, as without
    speculation; any draft goes to the rejection sampler with the metadata unchanged."""
    from types import SimpleNamespace

    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from das.service.engine.vllm.cpu_fixes.plugin import sample_plainly_without_drafts

    calls = []
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(sampling_metadata="meta", update_async_output_token_ids=lambda: None),
        sampler=lambda logits, sampling_metadata: calls.append(("plain", logits)) or "plain",
        rejection_sampler=lambda spec, draft_probs, logits, meta: calls.append(("verify", spec)) or "verified",
        use_async_scheduling=False, _get_spec_decode_draft_probs=lambda spec: None)
    sample = sample_plainly_without_drafts(getattr(GPUModelRunner._sample, "__wrapped__", GPUModelRunner._sample))
    none = SpecDecodeMetadata.make_dummy([[], [], []], torch.device("cpu"))
    some = SpecDecodeMetadata.make_dummy([[], [5], []], torch.device("cpu"))
    assert sample(runner, "logits", none) == "plain" and calls[-1] == ("plain", "logits")
    assert sample(runner, "logits", some) == "verified" and calls[-1] == ("verify", some)
    assert sample(runner, "logits", None) == "plain"
