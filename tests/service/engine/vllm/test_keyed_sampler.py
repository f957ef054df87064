"""Keyed sampling (service/engine/vllm/keyed_sampler.py, and its verification rule in cpu_fixes/rejection.py) on vLLM's
own CPU kernel: a keyed draw depends on the row and its key only and follows the row's distribution; verification
emits exactly the tokens plain keyed decoding would, accepting a draft with its target probability; the step's
keys come from the input batch (positions count generated tokens)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from das.service.engine.vllm import keyed_sampler
from das.service.engine.vllm.cpu_fixes import rejection
from das.service.engine.vllm.cpu_fixes.rejection import PLACEHOLDER, sample_without_draft_probs
from das.service.engine.vllm.extra_args import POSITION_OFFSET, SAMPLE_KEY
from das.service.engine.vllm.keyed_sampler import StepKeys, keyed_tokens, step_keys
from das.service.engine.vllm.row_keys import row_keys
from das.service.wire.sample_keys import derive
from tests.service.engine.vllm.cpu_fixes.rejection_checks import fit_p_value, metadata

VOCAB = 8


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # vLLM's CPU ops, as an engine process loads them


def keys_of(n: int, seed: int = 0) -> torch.Tensor:
    return torch.tensor([derive(seed, i) for i in range(n)], dtype=torch.int64)


def test_a_keyed_draw_depends_on_its_row_and_key_only_and_follows_the_row():
    torch.manual_seed(0)
    row = torch.randn(VOCAB) * 1.5
    row[2] = float("-inf")  # masked by top-k / top-p: never drawn
    keys = keys_of(40_000)
    drawn = keyed_tokens(row.repeat(40_000, 1), keys)
    assert torch.equal(drawn, keyed_tokens(row.repeat(40_000, 1), keys))
    alone = torch.stack([keyed_tokens(row.view(1, -1), keys[i:i + 1])[0] for i in range(50)])
    assert torch.equal(alone, drawn[:50])  # the same draw in a batch of one or of 40,000
    counts = torch.bincount(drawn, minlength=VOCAB)
    assert counts[2] == 0
    assert fit_p_value(counts, row.softmax(-1)) > 1e-3
    assert not torch.equal(drawn, keyed_tokens(row.repeat(40_000, 1), keys_of(40_000, seed=1)))


def verify(rows: torch.Tensor, drafts: list[list[int]], step: StepKeys, temperature: float = 0.8) -> torch.Tensor:
    """The verification grid for requests drafting `drafts` against `rows` (one per draft, request by request),
    with the bonus drawn as the plain sampler would under `step`."""
    counts = [len(d) for d in drafts]
    starts = np.cumsum([0] + counts)
    bonus_rows = torch.stack([rows[s + c - 1] + 0.25 for s, c in zip(starts, counts)])  # any row after the drafts
    bonus = keyed_tokens(bonus_rows, step.sampler_keys()[0]).view(-1, 1).to(torch.int32)
    return sample_without_draft_probs(torch.tensor(sum(drafts, []), dtype=torch.int32), counts, max(counts),
                                      rows, bonus, metadata(torch.full((len(drafts),), temperature)),
                                      step.target_row_keys()), bonus


def test_verification_emits_the_tokens_plain_keyed_decoding_draws():
    torch.manual_seed(1)
    requests, k = 64, 4
    rows = torch.randn(requests * k, VOCAB)
    keys = keys_of(requests)
    step = StepKeys(keys.numpy(), np.ones(requests, bool), np.arange(requests, dtype=np.int64) * 3,
                    np.full(requests, k, dtype=np.int64))
    plain = keyed_tokens(rows, step.target_row_keys()[0]).view(requests, k)  # what decoding without drafts draws
    # request i drafts plain decoding's tokens for its first i % (k + 1) positions, then a wrong one
    drafts = []
    for i in range(requests):
        right = i % (k + 1)
        drafts.append([int(t) for t in plain[i, :right]] + [(int(t) + 1) % VOCAB for t in plain[i, right:]])
    out, bonus = verify(rows, drafts, step)
    for i in range(requests):
        right = i % (k + 1)
        if right == k:  # every draft accepted: the bonus is the next position's keyed draw
            assert out[i].tolist() == plain[i].tolist() + [int(bonus[i])]
        else:  # accepted up to the first wrong draft, which is corrected to the keyed draw there
            assert out[i, :right + 1].tolist() == plain[i, :right + 1].tolist()
            assert (out[i, right + 1:] == PLACEHOLDER).all()


def test_verification_draws_no_row_after_a_requests_first_rejection(monkeypatch: pytest.MonkeyPatch):
    """Rows after a request's first rejected draft are never read, so they are not drawn: the keyed kernel sees each
    request's accepted drafts plus one row (all k when every draft is accepted), and the grid is the one plain
    keyed decoding gives."""
    torch.manual_seed(5)
    requests, k = 40, 4
    rows = torch.randn(requests * k, VOCAB)
    step = StepKeys(keys_of(requests, seed=9).numpy(), np.ones(requests, bool), np.zeros(requests, np.int64),
                    np.full(requests, k, dtype=np.int64))
    plain = keyed_tokens(rows, step.target_row_keys()[0]).view(requests, k)
    drafts = [[int(t) for t in plain[i, :i % (k + 1)]] + [(int(t) + 1) % VOCAB for t in plain[i, i % (k + 1):]]
              for i in range(requests)]
    drawn: list[int] = []

    def counted(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        drawn.append(logits.shape[0])
        return keyed_tokens(logits, keys)

    monkeypatch.setattr(rejection, "keyed_tokens", counted)
    out, bonus = verify(rows, drafts, step)
    assert sum(drawn) == sum(min(i % (k + 1) + 1, k) for i in range(requests))  # 112 rows of 160
    assert len(drawn) == k  # one kernel call per position
    for i in range(requests):
        right = i % (k + 1)
        emitted = plain[i].tolist() + [int(bonus[i])] if right == k else plain[i, :right + 1].tolist()
        assert out[i, :len(emitted)].tolist() == emitted and (out[i, len(emitted):] == PLACEHOLDER).all()


def test_a_draft_is_accepted_with_its_target_probability():
    torch.manual_seed(2)
    row = torch.randn(VOCAB)
    p = row.softmax(-1)
    draft = int(p.argsort()[-2])
    n = 20_000
    step = StepKeys(keys_of(n, seed=3).numpy(), np.ones(n, bool), np.zeros(n, np.int64), np.ones(n, np.int64))
    out, _ = verify(row.repeat(n, 1), [[draft]] * n, step)
    accepted = float((out[:, 0] == draft).float().mean())
    sd = (float(p[draft]) * (1 - float(p[draft])) / n) ** 0.5
    assert abs(accepted - float(p[draft])) < 4.5 * sd, (accepted, float(p[draft]))


def test_greedy_and_unkeyed_rows_keep_their_rules_beside_keyed_ones():
    torch.manual_seed(4)
    rows = torch.randn(3, VOCAB)
    step = StepKeys(keys_of(3).numpy(), np.array([True, True, False]), np.zeros(3, np.int64), np.ones(3, np.int64))
    wrong = [[(int(r.argmax()) + 1) % VOCAB] for r in rows]
    temperature = torch.tensor([0.0, 0.8, 0.8])
    bonus = torch.zeros((3, 1), dtype=torch.int32)
    out = sample_without_draft_probs(torch.tensor(sum(wrong, []), dtype=torch.int32), [1, 1, 1], 1, rows, bonus,
                                     metadata(temperature), step.target_row_keys())
    assert int(out[0, 0]) == int(rows[0].argmax())  # greedy: the argmax, keyed or not
    assert int(out[1, 0]) == int(keyed_tokens(rows[1:2], step.target_row_keys()[0][1:2])[0])
    assert int(out[2, 0]) != wrong[2][0] and 0 <= int(out[2, 0]) < VOCAB  # unkeyed: the rejection rule's draw


def test_step_keys_lay_rows_out_as_vllm_does():
    step = StepKeys(np.array([11, 22, 33], np.int64), np.ones(3, bool), np.array([5, 0, 9], np.int64),
                    np.array([2, 0, 3], np.int64))
    target, keyed = step.target_row_keys()
    expected = row_keys(np.array([11, 11, 33, 33, 33]), np.array([5, 6, 9, 10, 11]))
    assert target.tolist() == expected.tolist() and keyed.all()
    assert step.sampler_keys()[0].tolist() == row_keys(np.array([11, 22, 33]), np.array([7, 0, 12])).tolist()


def runner(extra_args: list[dict | None], prompt: list[int], generated: list[int]) -> SimpleNamespace:
    ids = [f"r{i}" for i in range(len(extra_args))]
    batch = SimpleNamespace(num_reqs=len(ids), req_ids=ids + ["stale"],
                            num_prompt_tokens=np.array(prompt + [0]),
                            num_tokens_no_spec=np.array([p + g for p, g in zip(prompt, generated)] + [0]))
    requests = {i: SimpleNamespace(sampling_params=SimpleNamespace(extra_args=e)) for i, e in zip(ids, extra_args)}
    return SimpleNamespace(input_batch=batch, requests=requests)


def test_the_step_reads_keys_and_generated_positions_from_the_input_batch():
    step = step_keys(runner([{SAMPLE_KEY: 7}, None, {"das": {}}, {SAMPLE_KEY: -3}], [10, 4, 6, 2], [0, 3, 1, 8]),
                     [1, 0, 0, 2])
    assert step.sample_keys.tolist() == [7, 0, 0, -3] and step.keyed.tolist() == [True, False, False, True]
    assert step.positions.tolist() == [0, 3, 1, 8] and step.drafts.tolist() == [1, 0, 0, 2]
    assert step_keys(runner([None, {"das": {}}], [3, 3], [1, 1]), None) is None  # nothing keyed: vLLM's sampler


def test_the_sampler_draws_keyed_rows_with_their_keys_and_leaves_the_rest_to_vllm():
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    calls = []

    def vllm_forward(self, logits, generators, k, p):
        calls.append(logits.shape[0])
        return torch.zeros(logits.shape[0], dtype=torch.int64), None

    forward = keyed_sampler.keyed_forward_cpu(vllm_forward)
    sampler = TopKTopPSampler()
    torch.manual_seed(5)
    logits = torch.randn(3, VOCAB)
    top_k = torch.tensor([VOCAB, 2, VOCAB])
    assert forward(sampler, logits.clone(), {}, top_k, None)[0].tolist() == [0, 0, 0] and calls == [3]
    step = StepKeys(np.array([4, 0, 6], np.int64), np.array([True, False, True]), np.array([2, 0, 0], np.int64),
                    np.zeros(3, np.int64))
    with keyed_sampler.keys_of_step(step):
        first = forward(sampler, logits.clone(), {}, top_k, None)[0]
        second = forward(sampler, logits.clone(), {}, top_k, None)[0]
    keys = step.sampler_keys()[0]
    assert calls == [3]
    assert first[0] == second[0] == keyed_tokens(logits[0:1], keys[0:1])[0]
    masked = logits[2:3].clone()
    assert first[2] == second[2] == keyed_tokens(masked, keys[2:3])[0]
    assert int(first[1]) in logits[1].topk(2).indices.tolist()  # top-k applied before the (unkeyed) draw


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits", "raw_logprobs"])
def test_a_drafted_steps_bonus_rows_come_back_as_processed_logits_for_the_rows_kept(mode):
    """Under processed logprobs a plain step returns the rows' log-softmax; a drafted step's bonus sample returns the
    processed logits, whose log-softmax the rejection sampler takes for the rows it keeps (the same figures as a
    plain step's, one vocabulary pass fewer); the tokens are the same either way. Other modes keep vLLM's rule."""
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    from vllm.v1.sample.sampler import Sampler

    forward = keyed_sampler.keyed_forward_cpu(lambda *args: pytest.fail("every row is keyed"))
    sampler = TopKTopPSampler(logprobs_mode=mode)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(6))
    keys, keyed, positions = np.array([4, 5, 6], np.int64), np.ones(3, bool), np.array([2, 0, 1], np.int64)
    plain = StepKeys(keys, keyed, positions, np.zeros(3, np.int64))
    drafted = StepKeys(keys, keyed, positions - np.array([1, 0, 0]), np.array([1, 0, 0], np.int64))
    with keyed_sampler.keys_of_step(plain):
        plain_tokens, plain_processed = forward(sampler, logits.clone(), {}, None, None)
    with keyed_sampler.keys_of_step(drafted):  # the same rows at the same positions, request 0 after one draft
        bonus_tokens, bonus_processed = forward(sampler, logits.clone(), {}, None, None)
    assert torch.equal(plain_tokens, bonus_tokens)
    if mode == "raw_logprobs":
        assert plain_processed is None and bonus_processed is None
    elif mode == "processed_logits":
        assert torch.equal(plain_processed, logits) and torch.equal(bonus_processed, logits)
    else:
        assert torch.equal(plain_processed, logits.log_softmax(-1))
        assert torch.equal(bonus_processed, logits)
        assert torch.equal(Sampler.compute_logprobs(bonus_processed), plain_processed)


def test_a_resumed_samples_positions_count_the_tokens_it_had_before_its_request():
    step = step_keys(runner([{SAMPLE_KEY: 7, POSITION_OFFSET: 40}, {SAMPLE_KEY: 9}], [12, 4], [3, 3]), None)
    assert step.positions.tolist() == [43, 3]  # 40 delivered before the death + 3 generated since
