"""Keyed sampling's CUDA paths (service/engine/vllm/keyed_cuda.py) driven with CPU tensors (they are pure torch): the
plain sampler and the rejection sampler emit the CPU engine path's keyed tokens (keyed_sampler.py and
cpu_fixes/rejection.py on vLLM's fused kernel), draws follow vLLM's own sampler's distribution, unkeyed requests
keep vLLM's rule, and installation checks the wrapped vLLM signatures first."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from das.service.engine.vllm import keyed_cuda, keyed_sampler
from das.service.engine.vllm.cpu_fixes.rejection import PLACEHOLDER, sample_without_draft_probs
from das.service.engine.vllm.keyed_sampler import StepKeys, keyed_tokens, keys_of_step
from das.service.wire.sample_keys import derive
from tests.service.engine.vllm.cpu_fixes.rejection_checks import metadata

VOCAB = 64


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    from vllm.platforms import current_platform

    current_platform.import_kernels()


def keys_of(n: int, seed: int = 0) -> np.ndarray:
    return np.array([derive(seed, i) for i in range(n)], dtype=np.int64)


def vllm_must_not_run(*args: object) -> None:
    pytest.fail("every row is keyed: vLLM's own function must not run")


@pytest.mark.parametrize("temperature", [0.8, 1.0])
def test_the_plain_sampler_draws_the_cpu_paths_tokens(temperature: float):
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    torch.manual_seed(1)
    requests = 48
    logits = torch.randn(requests, VOCAB) / temperature
    top_k = torch.randint(2, VOCAB + 1, (requests,))
    top_p = torch.full((requests,), 0.9)
    step = StepKeys(keys_of(requests), np.ones(requests, bool), np.arange(requests, dtype=np.int64) * 5,
                    np.zeros(requests, np.int64))
    cuda_forward = keyed_cuda.keyed_forward(vllm_must_not_run)
    cpu_forward = keyed_sampler.keyed_forward_cpu(vllm_must_not_run)
    sampler = TopKTopPSampler(logprobs_mode="processed_logprobs")
    with keys_of_step(step):
        for k, p in ((None, None), (top_k, None), (None, top_p), (top_k, top_p)):
            tokens, logprobs = cuda_forward(sampler, logits.clone(), {}, k, p)
            expected, expected_logprobs = cpu_forward(sampler, logits.clone(), {}, k, p)
            assert torch.equal(tokens, expected)
            assert torch.equal(logprobs, expected_logprobs)


def test_the_plain_sampler_is_vllms_outside_a_keyed_step():
    calls = []

    def vllm_forward(self, logits, generators, k, p):
        calls.append(logits.shape[0])
        return torch.zeros(logits.shape[0], dtype=torch.int64), None

    forward = keyed_cuda.keyed_forward(vllm_forward)
    assert forward(object(), torch.randn(3, VOCAB), {}, None, None)[0].tolist() == [0, 0, 0] and calls == [3]


def grid_inputs(requests: int, k: int, seed: int) -> tuple[torch.Tensor, StepKeys, torch.Tensor]:
    """Target rows (request by request), the step's keys, and the plain keyed draws at those rows."""
    torch.manual_seed(seed)
    rows = torch.randn(requests * k, VOCAB)
    step = StepKeys(keys_of(requests, seed), np.ones(requests, bool), np.arange(requests, dtype=np.int64) * 2,
                    np.full(requests, k, dtype=np.int64))
    plain = keyed_tokens(rows, step.target_row_keys()[0]).view(requests, k)
    return rows, step, plain


@pytest.mark.parametrize("temperature", [0.8, 1.0])
def test_verification_emits_the_cpu_paths_tokens(temperature: float):
    """Request i drafts the keyed tokens for its first i % (k + 1) positions, then wrong ones: drafts accepted up
    to there, the correction, or (all accepted) the bonus, exactly as the CPU path emits them."""
    requests, k = 40, 4
    rows, step, plain = grid_inputs(requests, k, seed=2)
    drafts = [[int(t) for t in plain[i, :i % (k + 1)]] + [(int(t) + 1) % VOCAB for t in plain[i, i % (k + 1):]]
              for i in range(requests)]
    bonus = torch.randint(0, VOCAB, (requests, 1), dtype=torch.int32)
    draft_ids = torch.tensor(sum(drafts, []), dtype=torch.int32)
    meta = metadata(torch.full((requests,), temperature))
    sample = keyed_cuda.make_rejection_sample(vllm_must_not_run)
    with keys_of_step(step):
        out = sample(draft_ids, [k] * requests, k, torch.arange(1, requests + 1) * k, None, rows, bonus, meta)
    expected = sample_without_draft_probs(draft_ids, [k] * requests, k, rows, bonus, meta, step.target_row_keys())
    assert torch.equal(out, expected) and out.dtype == torch.int32
    all_accepted = [i for i in range(requests) if i % (k + 1) == k]
    assert all(out[i].tolist() == plain[i].tolist() + [int(bonus[i])] for i in all_accepted)


def test_uneven_drafts_greedy_and_unkeyed_requests():
    """Draft counts 0..3 in one step; a greedy request follows the argmax; an unkeyed request keeps the row vLLM's
    function gave it."""
    torch.manual_seed(3)
    counts = [2, 0, 3, 1]
    rows = torch.randn(sum(counts), VOCAB)
    step = StepKeys(keys_of(4, 4), np.array([True, True, True, False]), np.zeros(4, np.int64),
                    np.array(counts, np.int64))
    keys = step.target_row_keys()[0]
    drawn = keyed_tokens(rows, keys)
    drafts = torch.tensor([int(drawn[0]), (int(drawn[1]) + 1) % VOCAB,  # request 0: one accepted, then corrected
                           int(rows[2].argmax()), int(rows[3].argmax()), int(rows[4].argmax()),  # 2: greedy, all
                           5], dtype=torch.int32)
    bonus = torch.tensor([[11], [12], [13], [14]], dtype=torch.int32)
    vllm_grid = torch.full((4, 4), 42, dtype=torch.int32)
    sample = keyed_cuda.make_rejection_sample(lambda *args: vllm_grid)
    meta = metadata(torch.tensor([0.8, 0.8, 0.0, 0.8]))
    with keys_of_step(step):
        out = sample(drafts, counts, 3, torch.tensor([2, 2, 5, 6]), None, rows, bonus, meta)
    assert out[0].tolist() == [int(drawn[0]), int(drawn[1]), PLACEHOLDER, PLACEHOLDER]
    assert out[1].tolist() == [12, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER]  # no drafts: the bonus
    assert out[2].tolist() == [int(d) for d in drafts[2:5]] + [13]
    assert out[3].tolist() == [42] * 4  # unkeyed: vLLM's rule


def test_other_verifications_go_to_vllm():
    calls = []

    def vllm_sample(*args):
        calls.append(args)
        return torch.zeros(1, 2, dtype=torch.int32)

    sample = keyed_cuda.make_rejection_sample(vllm_sample)
    step = StepKeys(keys_of(1), np.ones(1, bool), np.zeros(1, np.int64), np.ones(1, np.int64))
    args = (torch.tensor([1], dtype=torch.int32), [1], 1, torch.tensor([1]))
    rest = (torch.randn(1, VOCAB), torch.tensor([[2]], dtype=torch.int32), metadata(torch.tensor([0.8])))
    sample(*args, None, *rest)  # no step keys
    with keys_of_step(step):
        sample(*args, torch.rand(1, VOCAB), *rest)  # draft probabilities
        sample(*args, None, *rest, synthetic_mode=True)
        sample(*args, None, *rest, use_fp64_gumbel=True)
    assert len(calls) == 4 and calls[2][8] is True and calls[3][10] is True


def test_keyed_draws_follow_vllms_sampler():
    """Two-sample chi-square: 30,000 keyed draws against 30,000 of vLLM's own sampler (exponential noise) from the
    same processed row (T = 0.8, top-k 6 of 8)."""
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    torch.manual_seed(5)
    n, vocab = 30_000, 8
    row = torch.randn(vocab) / 0.8
    top_k = torch.full((n,), 6)
    sampler = TopKTopPSampler()
    forward = keyed_cuda.keyed_forward(vllm_must_not_run)
    step = StepKeys(keys_of(n, 6), np.ones(n, bool), np.zeros(n, np.int64), np.zeros(n, np.int64))
    with keys_of_step(step):
        keyed = forward(sampler, row.repeat(n, 1), {}, top_k, None)[0]
    ours = torch.bincount(keyed, minlength=vocab).double()
    theirs = torch.bincount(TopKTopPSampler.forward_native(sampler, row.repeat(n, 1), {}, top_k, None)[0],
                            minlength=vocab).double()
    assert int(ours[row.argsort()[:2]].sum()) == 0  # top-k's masked entries are never drawn
    both = ours + theirs
    used = both > 0
    expected = both[used] / 2
    stat = float((((ours[used] - expected) ** 2 + (theirs[used] - expected) ** 2) / expected).sum())
    dof = int(used.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    assert p_value > 1e-3, (stat, dof)


def test_the_installed_vllm_has_the_recorded_signatures():
    """check_signatures as install_cuda runs it, on the installed build (the CPU one here). What counts is the GPU
    wheel: gpu_contract.check_keyed_cuda_wrappers compares the table with its source ("keyed CUDA wrappers")."""
    keyed_cuda.check_signatures()


def test_a_changed_signature_is_refused(monkeypatch: pytest.MonkeyPatch):
    from vllm.v1.sample import rejection_sampler

    def newer(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_logits,
              bonus_token_ids, sampling_metadata, synthetic_mode=False, synthetic_conditional_rates=None,
              use_fp64_gumbel=False, fly_acceptance=None):
        raise AssertionError("never called")

    monkeypatch.setattr(rejection_sampler, "rejection_sample", newer)
    with pytest.raises(RuntimeError, match=r"rejection_sample\(.*fly_acceptance=None\)"):
        keyed_cuda.install_cuda()
    assert rejection_sampler.rejection_sample is newer  # nothing installed


def test_install_cuda_wraps_each_path_once(monkeypatch: pytest.MonkeyPatch):
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    originals = {"forward_native": TopKTopPSampler.forward_native, "forward_cuda": TopKTopPSampler.forward_cuda}
    for name, method in originals.items():
        monkeypatch.setattr(TopKTopPSampler, name, method)
    monkeypatch.setattr(rejection_sampler, "rejection_sample", rejection_sampler.rejection_sample)
    monkeypatch.setattr(GPUModelRunner, "_sample", GPUModelRunner._sample)
    monkeypatch.setattr(GPUModelRunner, "_dummy_sampler_run", GPUModelRunner._dummy_sampler_run)
    keyed_cuda.install_cuda()
    keyed_cuda.install_cuda()
    for name, method in originals.items():
        assert getattr(TopKTopPSampler, name).__wrapped__ is method
    assert not hasattr(rejection_sampler.rejection_sample.__wrapped__, "__wrapped__")
    assert GPUModelRunner._sample._das_keyed and not getattr(GPUModelRunner._sample.__wrapped__, "_das_keyed", False)
    assert not hasattr(GPUModelRunner._dummy_sampler_run.__wrapped__, "__wrapped__")  # wrapped exactly once


def test_vllms_dummy_sampler_run_draws_every_row_keyed_so_the_draw_is_ready_and_profiled():
    """vLLM's memory profiling runs the sampler on dummy rows: under the wrapper every row is keyed, so the keyed
    draw (not vLLM's) runs there, with keys the sampler's forward accepts (one a row)."""
    seen = []

    def dummy_run(runner: object, hidden_states: torch.Tensor) -> str:
        step = keyed_cuda.current_step()
        seen.append(step)
        keys, keyed = step.sampler_keys()
        assert keys.shape == (hidden_states.shape[0],) and bool(keyed.all())
        return "sampled"

    wrapped = keyed_cuda.keyed_dummy_sampler_run(dummy_run)
    assert wrapped(object(), torch.zeros(5, 8)) == "sampled"
    assert len(seen) == 1 and len(set(seen[0].sample_keys.tolist())) == 5  # every row its own key
    assert keyed_cuda.current_step() is None  # only while the dummy run samples


def test_the_patch_registry_installs_keyed_cuda_on_cuda_only():
    from das.service.engine.vllm.patches import patches_for

    cuda = {patch.name: patch for patch in patches_for("cuda")}
    assert "keyed-sampling-cuda" in cuda and "keyed-sampling-cpu" not in cuda
    assert not any(patch.name.startswith("keyed") for patch in patches_for("xpu"))
    wrapped = {f"vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler.{name}"
               for name in ("forward_native", "forward_cuda")}
    assert wrapped <= set(cuda["keyed-sampling-cuda"].targets)
