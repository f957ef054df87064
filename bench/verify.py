"""`das bench verify`: one verification step of vLLM's rejection sampler, vLLM's own CPU path against ours (our CPU fix
of it), unkeyed and keyed (the keyed sampler: the keyed draw per draft row), side by side in one process, with the plain
sampler (what a step without speculation pays) as the floor, vLLM's and keyed; and the keyed draw alone over the step's
rows, vLLM's fused CPU kernel against the torch draw the CUDA path runs (here on CPU tensors), with whether their tokens
agree.

Each case is a batch of `requests` requests, each with `drafts` draft tokens, random logits over `vocab` entries
(SmolLM2's 49,152 by default), temperature `temperature`, sampled-token logprobs requested (as the service does).
Every arm runs the same inputs; figures are medians over `repeats` timed calls after two warm-up calls, in
milliseconds per step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table


@dataclass(frozen=True)
class VerifyCase:
    """Medians (ms per step) for one batch shape: `vllm_ms`, `das_ms` and `keyed_ms` (ours with keyed sampling)
    verify its drafts; `plain_ms` (vLLM's sampler) and `plain_keyed_ms` sample one token per request without
    speculation; `draw_fused_ms` and `draw_torch_ms` draw every row of the step (requests x (drafts + 1)) with the
    fused kernel and with the torch draw, `draw_identical` whether they gave the same tokens."""

    requests: int
    drafts: int
    vllm_ms: float
    das_ms: float
    plain_ms: float
    keyed_ms: float
    plain_keyed_ms: float
    draw_fused_ms: float = 0.0
    draw_torch_ms: float = 0.0
    draw_identical: bool = False

    @property
    def speedup(self) -> float:
        return self.vllm_ms / self.das_ms


@dataclass
class VerifyBenchResult:
    config: dict[str, object]
    cases: list[VerifyCase]

    def to_dict(self) -> dict[str, object]:
        return {"config": self.config,
                "cases": [{**asdict(c), "vllm_over_das": round(c.speedup, 2),
                           "keyed_over_das": round(c.keyed_ms / c.das_ms, 2),
                           "plain_keyed_over_plain": round(c.plain_keyed_ms / c.plain_ms, 3),
                           "torch_over_fused_draw": round(c.draw_torch_ms / c.draw_fused_ms, 2)} for c in self.cases]}

    def print(self, console: Console) -> None:
        c = self.config
        table = Table(title=f"one verification step, vocab {c['vocab']}, T={c['temperature']}, logprobs, "
                            f"{c['threads']} threads, medians of {c['repeats']}")
        for col in ("requests", "drafts each", "vLLM ms", "das ms", "das keyed ms", "vLLM / das", "plain ms",
                    "plain keyed ms", "keyed / plain", "draw fused ms", "draw torch ms", "same tokens"):
            table.add_column(col, justify="right")
        for case in self.cases:
            table.add_row(str(case.requests), str(case.drafts), f"{case.vllm_ms:.1f}", f"{case.das_ms:.1f}",
                          f"{case.keyed_ms:.1f}", f"{case.speedup:.1f}x", f"{case.plain_ms:.1f}",
                          f"{case.plain_keyed_ms:.1f}", f"{case.plain_keyed_ms / case.plain_ms:.3f}",
                          f"{case.draw_fused_ms:.1f}", f"{case.draw_torch_ms:.1f}",
                          "yes" if case.draw_identical else "NO")
        console.print(table)


def _median_ms(call: Callable[[], Any], repeats: int) -> float:
    for _ in range(2):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 2)


def _sampling_metadata(requests: int, temperature: float) -> Any:
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=torch.full((requests,), temperature), all_greedy=temperature == 0.0,
        all_random=temperature > 0.0, top_p=None, top_k=None, generators={}, max_num_logprobs=0, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(requests), presence_penalties=torch.zeros(requests),
        repetition_penalties=torch.ones(requests), output_token_ids=[[] for _ in range(requests)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def run_verify_bench(requests: Sequence[int], drafts: Sequence[int], vocab: int = 49152, temperature: float = 0.8,
                     repeats: int = 20, progress: bool = True) -> VerifyBenchResult:
    """Times every (requests, drafts) case under both rejection samplers and the plain sampler."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from das.service.engine.vllm.cpu_fixes.plugin import expand_kernel_impl
    from das.service.engine.vllm.cpu_fixes.rejection import logprobs_of_kept_cells, make_rejection_sample
    from das.service.engine.vllm.keyed_draw import keyed_draw
    from das.service.engine.vllm.keyed_sampler import StepKeys, keyed_forward_cpu, keyed_tokens, keys_of_step

    if not current_platform.is_cpu():
        raise ValueError("das bench verify measures vLLM's CPU rejection sampler; this vLLM is not the CPU build")
    if getattr(rejection_sampler.rejection_sample, "__wrapped__", None) is not None:
        raise RuntimeError("the DAS rejection sampler is already installed in this process; run in a fresh one")
    from vllm.utils import cpu_triton_utils

    cpu_triton_utils._expand_kernel_impl = expand_kernel_impl  # correct temperatures for both arms
    current_platform.register_triton_kernel_overrides()
    arms = {"vllm": (rejection_sampler.rejection_sample, rejection_sampler.RejectionSampler._get_logprobs_tensors),
            "das": (make_rejection_sample(rejection_sampler.rejection_sample), logprobs_of_kept_cells)}
    sampler = Sampler(logprobs_mode="processed_logprobs")
    verifier = rejection_sampler.RejectionSampler(sampler)
    vllm_forward = TopKTopPSampler.forward_cpu
    TopKTopPSampler.forward_cpu = keyed_forward_cpu(vllm_forward)  # bound by the samplers built until restored
    try:
        keyed = Sampler(logprobs_mode="processed_logprobs")
    finally:
        TopKTopPSampler.forward_cpu = vllm_forward
    keyed_verifier = rejection_sampler.RejectionSampler(keyed)
    cases = []
    shapes = [(r, d) for r in requests for d in drafts]
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("verification steps", total=len(shapes))
        for batch, k in shapes:
            torch.manual_seed(0)
            meta = SpecDecodeMetadata.make_dummy([[int(t) for t in torch.randint(0, vocab, (k,))]] * batch,
                                                 torch.device("cpu"))
            rows = torch.arange(batch * (k + 1), dtype=torch.int32).view(batch, k + 1)
            meta.target_logits_indices = rows[:, :k].flatten().contiguous()  # the runner's layout: drafts, bonus
            meta.bonus_logits_indices = rows[:, k].contiguous()
            logits = torch.randn(batch * (k + 1), vocab)
            metadata = _sampling_metadata(batch, temperature)
            keys = np.arange(batch, dtype=np.int64) * 7919 + 1
            drafted = StepKeys(keys, np.ones(batch, bool), np.full(batch, 100, np.int64), np.full(batch, k, np.int64))
            plain_step = StepKeys(keys, np.ones(batch, bool), np.full(batch, 100, np.int64), np.zeros(batch, np.int64))
            ms = {}
            try:
                for name, (sample, logprobs) in arms.items():
                    rejection_sampler.rejection_sample = sample
                    rejection_sampler.RejectionSampler._get_logprobs_tensors = logprobs
                    ms[name] = _median_ms(lambda: verifier(meta, None, logits.clone(), metadata), repeats)
                with keys_of_step(drafted):  # arms["das"] is still installed
                    ms["keyed"] = _median_ms(lambda: keyed_verifier(meta, None, logits.clone(), metadata), repeats)
            finally:
                rejection_sampler.rejection_sample, rejection_sampler.RejectionSampler._get_logprobs_tensors = \
                    arms["vllm"]
            bonus = logits[meta.bonus_logits_indices.long()]
            plain = _median_ms(lambda: sampler(bonus.clone(), metadata), repeats)
            with keys_of_step(plain_step):
                plain_keyed = _median_ms(lambda: keyed(bonus.clone(), metadata), repeats)
            step_rows = logits / temperature if temperature > 0 else logits
            row_keys = torch.arange(step_rows.shape[0], dtype=torch.int64) * 7919 + 1
            fused = keyed_tokens(step_rows, row_keys)
            identical = bool(torch.equal(keyed_draw(step_rows, row_keys), fused))
            draw_fused = _median_ms(lambda: keyed_tokens(step_rows, row_keys), repeats)
            draw_torch = _median_ms(lambda: keyed_draw(step_rows, row_keys), repeats)
            cases.append(VerifyCase(batch, k, ms["vllm"], ms["das"], plain, ms["keyed"], plain_keyed, draw_fused,
                                    draw_torch, identical))
            bar.advance(task)
    config = {"vocab": vocab, "temperature": temperature, "repeats": repeats, "threads": torch.get_num_threads()}
    return VerifyBenchResult(config, cases)
