"""Keyed sampling on vLLM's CUDA paths (vLLM 0.32.0's V1 model runner): the same keyed draw as the CPU worker
(keyed_sampler.py), in torch (keyed_draw.py), so a sample drawn on a GPU and on a CPU agree wherever their
processed logits do.

- Plain steps and bonus tokens: `TopKTopPSampler.forward_native` and `forward_cuda` (the FlashInfer path; vLLM
  binds one of them per sampler at construction) take vLLM's top-k / top-p masking and processed-logprobs rules,
  then draw every keyed row with its key; unkeyed rows draw with a random seed (a vLLM-seeded request's from its
  generator). Outside a step with keys, or with fp64 Gumbel noise asked for, vLLM's own method runs.
- Verification: the module-level `rejection_sample` applies the keyed rule to the keyed requests: a draft is
  accepted iff it equals the keyed draw from its target row, the first mismatch emits that draw (the correction),
  and a request whose drafts are all accepted emits its bonus token (the keyed draw at the next position, from the
  plain sampler above). Greedy requests follow the same rule with the argmax, as vLLM's greedy kernel does. Unkeyed
  random requests keep vLLM's rule (its function runs for the batch, the keyed requests' rows are then replaced);
  draft probabilities or synthetic acceptance go to vLLM's function unchanged. Every draft row of a keyed request
  is drawn in one batched pass (no host round trip per position, unlike the CPU path, which stops at the first
  rejection to save CPU time).
- The step's keys: the model runner's `_sample` publishes them (keyed_sampler.publish_step_keys, the CPU path's
  wrapper, on `GPUModelRunner`).
- Ready before traffic: vLLM runs its sampler once on dummy logits (`_dummy_sampler_run`, max_num_seqs rows) while
  profiling memory, before the KV cache is sized, and again when warming up. `keyed_dummy_sampler_run` keys every
  dummy row there, so the keyed draw compiles (torch.compile, dynamic shapes: once) before the engine serves, and
  its temporaries are part of the peak vLLM's profiling measures: at most one float64 word a vocabulary entry of
  the rows drawn at once, bounded by keyed_draw's chunking (~1 GiB; 256 rows of Qwen2.5's 151,936 entries take
  311 MB), so they never come out of the KV cache's share at run time.

Each wrapped function's signature is checked against the one recorded here for vLLM 0.32.0 before anything is
installed: a vLLM whose signatures differ is refused with a clear error (a missed keyword argument would otherwise
surface as a TypeError mid-step). Not covered: model runner V2 (vllm/v1/worker/gpu/, its own murmur3-keyed Gumbel
sampler, which the baseline arms may run on a GPU), ROCm's aiter and XPU's fused samplers.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

import numpy as np
import torch

from das.service.engine.vllm.keyed_draw import keyed_draw
from das.service.engine.vllm.keyed_sampler import StepKeys, current_step, keys_of_step, publish_step_keys

VLLM_VERSION = "0.32.0"
PLACEHOLDER = -1  # vLLM's PLACEHOLDER_TOKEN_ID
GREEDY_TEMPERATURE = 0.0

# (module, owner or None for a module-level function, attribute) -> its parameters (names and defaults, in order)
# in vLLM 0.32.0's source: vllm/v1/sample/ops/topk_topp_sampler.py, vllm/v1/sample/rejection_sampler.py,
# vllm/v1/worker/gpu_model_runner.py. Types as there: logits float [rows, vocab], generators dict[int, Generator],
# k / p tensors or None; the rejection sampler's as in `make_rejection_sample`; `_sample(logits,
# spec_decode_metadata)` -> SamplerOutput.
WRAPPED_SIGNATURES: dict[tuple[str, str | None, str], str] = {
    ("vllm.v1.sample.ops.topk_topp_sampler", "TopKTopPSampler", "forward_native"): "self, logits, generators, k, p",
    ("vllm.v1.sample.ops.topk_topp_sampler", "TopKTopPSampler", "forward_cuda"): "self, logits, generators, k, p",
    ("vllm.v1.sample.rejection_sampler", None, "rejection_sample"):
        "draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_logits, "
        "bonus_token_ids, sampling_metadata, synthetic_mode=False, synthetic_conditional_rates=None, "
        "use_fp64_gumbel=False",
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_sample"): "self, logits, spec_decode_metadata",
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_dummy_sampler_run"): "self, hidden_states",
}


def _seeds(keys: torch.Tensor, keyed: torch.Tensor, generators: dict[int, torch.Generator],
           device: torch.device) -> torch.Tensor:
    """int64 [rows] on `device`: each keyed row's key; a random seed elsewhere, from the row's generator for a
    vLLM-seeded request (so its outputs repeat)."""
    seeds = torch.where(keyed.to(device), keys.to(device),
                        torch.randint(0, 2**31, keys.shape, dtype=torch.int64, device=device))
    for i, generator in generators.items():
        if not bool(keyed[i]):  # keyed: a host tensor
            seeds[i] = torch.randint(0, 2**31, (1,), generator=generator, dtype=torch.int64,
                                     device=generator.device).item()
    return seeds


def keyed_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps `TopKTopPSampler.forward_native` or `forward_cuda` (same signature): vLLM's forward_native steps
    (top-k / top-p, processed logprobs) with the keyed draw; vLLM's method where nothing is keyed."""

    def forward(self: Any, logits: torch.Tensor, generators: dict[int, torch.Generator], k: torch.Tensor | None,
                p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        step = current_step()
        if step is None or self.use_fp64_gumbel or logits.shape[0] != len(step.keyed):
            return original(self, logits, generators, k, p)
        logits = apply_top_k_top_p(logits, k, p)
        processed = None
        if self.logprobs_mode == "processed_logits":
            processed = logits
        elif self.logprobs_mode == "processed_logprobs":
            processed = logits.log_softmax(dim=-1, dtype=torch.float32)
        keys, keyed = step.sampler_keys()
        return keyed_draw(logits, _seeds(keys, keyed, generators, logits.device)), processed

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    return forward


def keyed_dummy_sampler_run(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps `GPUModelRunner._dummy_sampler_run(hidden_states)`: every dummy row keyed while vLLM's sampler runs
    (module docstring: compiled and counted in the profiled memory before the engine serves)."""

    def _dummy_sampler_run(self: Any, hidden_states: torch.Tensor) -> Any:
        rows = int(hidden_states.shape[0])
        step = StepKeys(np.arange(1, rows + 1, dtype=np.int64), np.ones(rows, dtype=bool),
                        np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64))
        with keys_of_step(step):
            return original(self, hidden_states)

    _dummy_sampler_run.__wrapped__ = original  # type: ignore[attr-defined]
    return _dummy_sampler_run


def make_rejection_sample(vllm_rejection_sample: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """vLLM 0.32's module-level `rejection_sample`, keyed requests verified by the keyed rule (module docstring)."""

    def rejection_sample(draft_token_ids: torch.Tensor, num_draft_tokens: list[int], max_spec_len: int,
                         cu_num_draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                         target_logits: torch.Tensor, bonus_token_ids: torch.Tensor, sampling_metadata: Any,
                         synthetic_mode: bool = False, synthetic_conditional_rates: torch.Tensor | None = None,
                         use_fp64_gumbel: bool = False) -> torch.Tensor:
        step = current_step()
        args = (draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_logits,
                bonus_token_ids, sampling_metadata, synthetic_mode, synthetic_conditional_rates, use_fp64_gumbel)
        if (step is None or draft_probs is not None or synthetic_mode or use_fp64_gumbel
                or len(step.keyed) != len(num_draft_tokens)):
            return vllm_rejection_sample(*args)
        keyed = torch.from_numpy(step.keyed)
        base = None if bool(keyed.all()) else vllm_rejection_sample(*args)
        return keyed_verify(draft_token_ids, num_draft_tokens, max_spec_len, target_logits, bonus_token_ids,
                            sampling_metadata, step.target_row_keys()[0], keyed, base)

    rejection_sample.__wrapped__ = vllm_rejection_sample  # type: ignore[attr-defined]
    return rejection_sample


def keyed_verify(draft_token_ids: torch.Tensor, num_draft_tokens: list[int], max_spec_len: int,
                 target_logits: torch.Tensor, bonus_token_ids: torch.Tensor, sampling_metadata: Any,
                 row_keys: torch.Tensor, keyed: torch.Tensor, base: torch.Tensor | None = None) -> torch.Tensor:
    """The [requests, max_spec_len + 1] int32 grid of emitted tokens (PLACEHOLDER after each request's last) on
    target_logits' device, keyed requests by the keyed rule.

    target_logits: float32 [drafts, vocab] processed logits, request by request; row_keys: int64 [drafts], the key
    of each target row (StepKeys.target_row_keys); keyed: bool [requests]; bonus_token_ids: [requests, 1];
    base: vLLM's grid for the same step, whose rows of unkeyed requests are kept (None: every request is keyed).
    No host synchronisation beyond keyed_draw's one."""
    device = target_logits.device
    batch = len(num_draft_tokens)
    out = torch.full((batch, max_spec_len + 1), PLACEHOLDER, dtype=torch.int32, device=device)
    counts = torch.tensor(num_draft_tokens, dtype=torch.int64, device=device)
    if draft_token_ids.numel() == 0:
        out[:, 0] = bonus_token_ids.view(-1).to(torch.int32)
    else:
        req = torch.repeat_interleave(torch.arange(batch, device=device), counts)
        pos = torch.arange(req.numel(), device=device) - (torch.cumsum(counts, 0) - counts)[req]
        if sampling_metadata.all_greedy:
            drawn = target_logits.argmax(-1)
        else:
            drawn = keyed_draw(target_logits, row_keys)
            if not sampling_metadata.all_random:
                greedy = (sampling_metadata.temperature[:batch] == GREEDY_TEMPERATURE)[req]
                drawn = torch.where(greedy, target_logits.argmax(-1), drawn)
        draft = draft_token_ids.to(device=device, dtype=torch.int64)
        grid_drawn = torch.full((batch, max_spec_len + 1), PLACEHOLDER, dtype=torch.int64, device=device)
        grid_draft = torch.full_like(grid_drawn, PLACEHOLDER)
        grid_drawn[req, pos], grid_draft[req, pos] = drawn, draft
        # accepted prefix length: drafts before the first mismatch (a request's padding never matches)
        accepted = torch.cumprod((grid_drawn == grid_draft) & (grid_draft != PLACEHOLDER), dim=1).sum(1)
        # the token after them: the keyed draw at the first mismatch, or the bonus when every draft was accepted
        last = torch.where(accepted < counts, grid_drawn.gather(1, accepted.unsqueeze(1)).squeeze(1),
                           bonus_token_ids.view(-1).to(torch.int64))
        columns = torch.arange(max_spec_len + 1, device=device).unsqueeze(0)
        grid = torch.where(columns < accepted.unsqueeze(1), grid_draft, PLACEHOLDER)
        out = grid.scatter_(1, accepted.unsqueeze(1), last.unsqueeze(1)).to(torch.int32)
    if base is not None:
        out = torch.where(keyed.to(device).unsqueeze(1), out, base.to(device))
    return out


def _resolve(module: str, owner: str | None, name: str) -> tuple[Any, Any]:
    holder = importlib.import_module(module)
    if owner is not None:
        holder = getattr(holder, owner)
    return holder, getattr(holder, name)


def parameters_of(fn: Callable[..., Any]) -> str:
    """A function's parameters as WRAPPED_SIGNATURES records them: names in order, `=default` where one is."""
    return ", ".join(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
                     for p in inspect.signature(inspect.unwrap(fn)).parameters.values())


def check_signatures() -> None:
    """Raises RuntimeError naming every wrapped vLLM function whose parameters are not the recorded ones."""
    import vllm

    wrong = []
    for (module, owner, name), expected in WRAPPED_SIGNATURES.items():
        actual = parameters_of(_resolve(module, owner, name)[1])
        if actual != expected:
            wrong.append(f"{module}.{owner + '.' if owner else ''}{name}({actual}), expected ({expected})")
    if wrong:
        raise RuntimeError(f"keyed sampling on CUDA was written for vLLM {VLLM_VERSION}; this vLLM "
                           f"({vllm.__version__}) differs: " + "; ".join(wrong))


def install_cuda() -> None:
    """Installs keyed sampling in this (CUDA) worker process: the samplers, the rejection sampler and the model
    runner's `_sample`; idempotent. Must run before the model runner builds its sampler (vLLM binds the sampler's
    forward at construction), as vLLM general plugins do."""
    check_signatures()
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for name in ("forward_native", "forward_cuda"):
        method = getattr(TopKTopPSampler, name)
        if not hasattr(method, "__wrapped__"):
            setattr(TopKTopPSampler, name, keyed_forward(method))
    if not hasattr(rejection_sampler.rejection_sample, "__wrapped__"):
        rejection_sampler.rejection_sample = make_rejection_sample(rejection_sampler.rejection_sample)
    if not getattr(GPUModelRunner._sample, "_das_keyed", False):
        GPUModelRunner._sample = publish_step_keys(GPUModelRunner._sample)
        GPUModelRunner._sample._das_keyed = True  # type: ignore[attr-defined]
    if not hasattr(GPUModelRunner._dummy_sampler_run, "__wrapped__"):
        GPUModelRunner._dummy_sampler_run = keyed_dummy_sampler_run(GPUModelRunner._dummy_sampler_run)
