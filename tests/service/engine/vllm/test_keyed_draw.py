"""The device-agnostic keyed draw (service/engine/vllm/keyed_draw.py) against vLLM-CPU's fused Gumbel-max kernel: the
same token for every row (temperatures 0.8 and 1.0, top-k / top-p masks, near-tied and degenerate rows, any chunk
size), the row's distribution, and noise that is a function of (key, vocabulary entry) only."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from das.service.engine.vllm import keyed_draw as keyed_draw_module
from das.service.engine.vllm.keyed_draw import _kernel_row, gumbel_noise, keyed_draw
from das.service.wire.sample_keys import derive
from tests.service.engine.vllm.cpu_fixes.rejection_checks import fit_p_value


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # vLLM's CPU ops, as an engine process loads them


def fused(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return torch.ops._C.fused_gumbel_argmax(logits.to(torch.float32).contiguous(), keys.contiguous())


def keys_of(n: int, seed: int = 0) -> torch.Tensor:
    return torch.tensor([derive(seed, i) for i in range(n)], dtype=torch.int64)


def masked(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Top-k / top-p by vLLM's own (PyTorch) masking, as the sampler applies it before the draw."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    return apply_top_k_top_p_pytorch(logits.clone(), k, p)


@pytest.mark.parametrize("temperature", [0.8, 1.0])
@pytest.mark.parametrize("vocab", [1, 2, 50, 49152])
def test_every_token_is_the_fused_kernels(temperature: float, vocab: int):
    torch.manual_seed(vocab)
    rows = 96 if vocab < 1000 else 16  # the torch draw is ~30x the kernel's cost on this CPU
    logits = torch.randn(rows, vocab) * 3 / temperature
    keys = torch.cat([keys_of(rows // 2), torch.randint(-2**63, 2**63 - 1, (rows - rows // 2,))])
    plain = logits.clone()
    k = torch.randint(1, vocab + 1, (rows,))
    p = torch.rand(rows) * 0.9 + 0.05
    for case in (plain, masked(logits, k, None), masked(logits, None, p), masked(logits, k, p)):
        assert torch.equal(keyed_draw(case, keys, chunk_elements=5 * vocab), fused(case, keys))


def test_verification_rows_with_drafts_accepted_draw_the_kernels_tokens():
    """A verification step's rows: each request's rows at consecutive positions under keys derived per position
    (as StepKeys.target_row_keys lays them out), drafts equal to the keyed draws (all accepted)."""
    import numpy as np

    from das.service.engine.vllm.row_keys import row_keys

    torch.manual_seed(3)
    requests, k, vocab = 16, 5, 4096
    samples = np.repeat([derive(7, i) for i in range(requests)], k).astype(np.int64)
    positions = np.tile(np.arange(k), requests).astype(np.int64) + 40
    keys = torch.from_numpy(row_keys(samples, positions))
    logits = masked(torch.randn(requests * k, vocab) / 0.8, None, torch.full((requests * k,), 0.95))
    drafts = fused(logits, keys)
    assert torch.equal(keyed_draw(logits, keys), drafts)


def near_tied(vocab: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose two best perturbed logits are within float32 rounding: entry j is given the logit that makes
    x_j + g_j equal x_a + g_a for the row's winner a (rounded to float32, so the gap is ~1e-7)."""
    torch.manual_seed(seed)
    logits = torch.randn(rows, vocab)
    keys = keys_of(rows, seed)
    g = gumbel_noise(keys, torch.arange(vocab))
    perturbed = logits.double() + g
    a = perturbed.argmax(-1)
    j = (a + 1 + torch.randint(0, vocab - 1, (rows,))) % vocab
    idx = torch.arange(rows)
    logits[idx, j] = (perturbed[idx, a] - g[idx, j]).to(torch.float32)
    return logits, keys


def test_near_tied_rows_are_settled_as_the_kernel_settles_them():
    logits, keys = near_tied(vocab=300, rows=64, seed=11)
    g = gumbel_noise(keys, torch.arange(300))
    top = (logits.double() + g).topk(2, dim=-1).values
    assert ((top[:, 0] - top[:, 1]) < 1e-6).all()  # every row goes through the exact scan
    assert torch.equal(keyed_draw(logits, keys), fused(logits, keys))


def test_degenerate_rows_follow_the_kernel():
    torch.manual_seed(4)
    logits = torch.randn(7, 40)
    logits[0] = float("-inf")  # nothing drawable: 0
    logits[1, 3] = logits[1, 9] = float("inf")  # the first +inf
    logits[2, 0] = float("nan")  # a NaN first entry is the kernel's running best and is never displaced
    logits[3, 5] = float("nan")  # a later NaN never wins
    logits[4, :10] = float("-inf")
    logits[5] = 3e38  # huge equal logits: the noise still decides
    logits[6, 1:] = float("-inf")  # one drawable entry
    keys = keys_of(7, seed=5)
    assert keyed_draw(logits, keys).tolist() == fused(logits, keys).tolist()
    assert keyed_draw(logits, keys).tolist()[:3] == [0, 3, 0] and int(keyed_draw(logits, keys)[6]) == 0


def test_the_exact_scan_is_the_kernel_on_ordinary_rows():
    torch.manual_seed(6)
    logits = torch.randn(12, 2000) * 2
    keys = torch.randint(-2**63, 2**63 - 1, (12,))
    assert [_kernel_row(logits[i], int(keys[i])) for i in range(12)] == fused(logits, keys).tolist()


def test_the_noise_is_a_function_of_key_and_entry_only():
    keys = keys_of(5, seed=2)
    whole = gumbel_noise(keys, torch.arange(1000))
    assert torch.equal(gumbel_noise(keys[3:4], torch.arange(500, 1000)), whole[3:4, 500:])
    logits = torch.randn(5, 1000)
    one_by_one = torch.cat([keyed_draw(logits[i:i + 1], keys[i:i + 1]) for i in range(5)])
    assert torch.equal(one_by_one, keyed_draw(logits, keys, chunk_elements=1))


def test_draws_follow_the_rows_distribution():
    torch.manual_seed(8)
    row = torch.randn(8) * 1.5
    row[2] = float("-inf")
    n = 40_000
    drawn = keyed_draw(row.repeat(n, 1), keys_of(n, seed=9))
    counts = torch.bincount(drawn, minlength=8)
    assert counts[2] == 0
    assert fit_p_value(counts, row.softmax(-1)) > 1e-3


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="rows"):
        keyed_draw(torch.zeros(3, 4), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="vocab >= 1"):
        keyed_draw(torch.zeros(3, 0), torch.zeros(3, dtype=torch.int64))


def test_the_module_imports_without_vllm():
    """What a GPU machine with torch but no vLLM runs (bench/gpu_cost.py): vLLM is made unimportable."""
    code = ("import sys; sys.modules['vllm'] = None\n"
            "import das.service.engine.vllm.keyed_draw, das.scheduler.cost_model, das.bench.gpu_cost\n"
            "assert 'vllm' not in {m.split('.')[0] for m in sys.modules if sys.modules[m] is not None}")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("vocab", [1, 50, 49152])
def test_the_compiled_draw_gives_the_fused_kernels_tokens(vocab: int):
    """torch.compile's fused draw (the CUDA default; Inductor's C++ here) over varying row counts in one compiled
    function (dynamic shapes): the kernel's tokens, ties and non-finite rows included."""
    torch.manual_seed(11)
    for rows in (3, 17):
        logits = torch.randn(rows, vocab) * 2
        logits[0, : vocab // 2] = float("-inf")
        if vocab > 1:
            logits[1, 1] = logits[1, 0] = float("inf")
            logits[2, 1] = float("nan")
        keys = keys_of(rows, seed=rows)
        assert torch.equal(keyed_draw(logits, keys, compiled=True), fused(logits, keys))
    assert keyed_draw_module._compiled and keyed_draw_module._compiled[0] is not None  # it did compile


def test_a_failing_compile_falls_back_to_the_eager_draw(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture):
    def broken(*args: object) -> None:
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(keyed_draw_module, "_compiled", [broken])
    logits, keys = torch.randn(4, 30), keys_of(4, seed=3)
    with caplog.at_level("WARNING"):
        assert torch.equal(keyed_draw(logits, keys, compiled=True), fused(logits, keys))
    assert "torch.compile failed" in caplog.text and keyed_draw_module._compiled == [None]
    assert torch.equal(keyed_draw(logits, keys, compiled=True), fused(logits, keys))  # eager from now on
