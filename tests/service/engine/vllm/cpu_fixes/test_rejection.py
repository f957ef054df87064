"""The CPU rejection sampler (service/engine/vllm/cpu_fixes/rejection.py): emitted tokens follow the target rows exactly
(goodness of fit against the known distribution, many requests in one call), greedy requests follow the argmax
rule token for token, seeded requests repeat, and logprobs equal vLLM's own for every kept cell."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from das.service.engine.vllm.cpu_fixes.rejection import PLACEHOLDER, sample_without_draft_probs
from tests.service.engine.vllm.cpu_fixes.rejection_checks import fit_p_value, metadata

VOCAB = 8


def batch(requests: int, drafts: list[int], rows: torch.Tensor, temperature: float = 0.8, bonus: int = 7):
    """`requests` identical requests drafting `drafts`, verified against `rows` (one logits row per draft)."""
    k = len(drafts)
    return dict(draft_token_ids=torch.tensor(drafts * requests, dtype=torch.int32),
                num_draft_tokens=[k] * requests, max_spec_len=k,
                target_logits=rows.repeat(requests, 1),
                bonus_token_ids=torch.full((requests, 1), bonus, dtype=torch.int32),
                sampling_metadata=metadata(torch.full((requests,), temperature)))


def test_emitted_tokens_follow_the_target_rows():
    """First token ~ p1 whatever the draft; second ~ p2 given the first draft accepted; both accepted: the bonus
    token; every cell after a request's last emitted token is a placeholder."""
    torch.manual_seed(0)
    rows = torch.randn(2, VOCAB) * 1.5
    rows[1, 5] = float("-inf")  # a token top-k / top-p masked out: never emitted
    p1, p2 = rows.softmax(-1)
    drafts = [int(p1.argsort()[-2]), 3]  # neither the likeliest first token nor certain
    out = sample_without_draft_probs(**batch(40_000, drafts, rows))
    assert out.shape == (40_000, 3) and out.dtype == torch.int32
    assert fit_p_value(torch.bincount(out[:, 0].long(), minlength=VOCAB), p1) > 1e-3
    first_taken = out[:, 0] == drafts[0]
    assert fit_p_value(torch.bincount(out[first_taken, 1].long(), minlength=VOCAB), p2) > 1e-3
    assert not (out[first_taken, 1] == 5).any()
    both = first_taken & (out[:, 1] == drafts[1])
    assert (out[both, 2] == 7).all() and (out[~both, 2] == PLACEHOLDER).all()
    assert (out[~first_taken, 1] == PLACEHOLDER).all()
    assert abs(float(first_taken.float().mean()) - float(p1[drafts[0]])) < 0.01  # acceptance = p1(d1)


def test_a_mixed_batch_keeps_each_request_to_its_own_rows_and_rule():
    """Requests with 0, 1 and 3 drafts, greedy and random, in one ragged batch."""
    torch.manual_seed(1)
    rows = torch.randn(4, VOCAB)
    best = rows.argmax(-1)
    drafts = [[], [int(best[0])], [int(best[1]), int(best[2]), int((best[3] + 1) % VOCAB)], [2]]
    flat = [t for d in drafts for t in d]
    certain = torch.full((1, VOCAB), -1e4).index_fill_(1, torch.tensor([2]), 0.0)
    target = torch.cat([rows[:1], rows[1:4], certain])
    out = sample_without_draft_probs(
        torch.tensor(flat, dtype=torch.int32), [len(d) for d in drafts], 3, target,
        torch.tensor([[4], [5], [6], [1]], dtype=torch.int32),
        metadata(torch.tensor([0.0, 0.0, 0.0, 1.0])))
    assert out[0].tolist() == [4, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER]  # no drafts: the bonus token
    assert out[1].tolist() == [int(best[0]), 5, PLACEHOLDER, PLACEHOLDER]  # greedy, draft = argmax: accepted
    assert out[2].tolist() == [int(best[1]), int(best[2]), int(best[3]), PLACEHOLDER]  # third rejected: argmax
    assert out[3].tolist() == [2, 1, PLACEHOLDER, PLACEHOLDER]  # random, all mass on the draft: accepted


def test_a_seeded_request_repeats_its_draws():
    rows = torch.randn(2, VOCAB)
    runs = []
    for _ in range(2):
        torch.manual_seed(len(runs))  # the unseeded requests' draws differ between the runs
        args = batch(64, [1, 2], rows)
        args["sampling_metadata"].generators = {3: torch.Generator().manual_seed(11)}
        runs.append(sample_without_draft_probs(**args))
    assert torch.equal(runs[0][3], runs[1][3])
    assert not torch.equal(runs[0], runs[1])


LOGPROBS_EQUIVALENCE = """
import json, torch
from types import SimpleNamespace
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
from das.service.engine.vllm.cpu_fixes.rejection import logprobs_of_kept_cells

original = RejectionSampler._get_logprobs_tensors  # vLLM's own: no plugin loaded in this process
assert original is not logprobs_of_kept_cells
torch.manual_seed(0)
vocab, drafts = 50, [[3, 4, 5, 6], [], [7], [8, 9]]  # ragged: the grid is 4 x 5
meta = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
start = 0
meta.target_logits_indices, meta.bonus_logits_indices = [], []
for d in drafts:  # the runner's layout: each request's draft rows, then its bonus row
    meta.target_logits_indices += range(start, start + len(d))
    meta.bonus_logits_indices.append(start + len(d))
    start += len(d) + 1
meta.target_logits_indices = torch.tensor(meta.target_logits_indices, dtype=torch.int32)
meta.bonus_logits_indices = torch.tensor(meta.bonus_logits_indices, dtype=torch.int32)
logits = torch.randn(sum(map(len, drafts)) + len(drafts), vocab)
target, bonus = logits[meta.target_logits_indices] * 0.9, logits[meta.bonus_logits_indices] * 1.1
P = -1
sampled = torch.tensor([[3, 4, 11, P, P], [12, P, P, P, P], [7, 13, P, P, P], [8, 9, 14, P, P]])
report = {}
for mode in ("processed_logprobs", "raw_logits"):
    me = SimpleNamespace(sampler=Sampler(logprobs_mode=mode), is_logits_logprobs_mode=mode == "raw_logits")
    for k in (0, 3):
        want = original(me, k, meta, logits, target, bonus, sampled)
        got = logprobs_of_kept_cells(me, k, meta, logits, target, bonus, sampled)
        keep = (sampled.flatten() >= 0)
        same = (torch.equal(want.logprob_token_ids[keep], got.logprob_token_ids[keep])
                and torch.allclose(want.logprobs[keep], got.logprobs[keep])
                and torch.equal(want.selected_token_ranks[keep], got.selected_token_ranks[keep])
                and want.logprobs.shape == got.logprobs.shape)
        report[f"{mode}/{k}"] = bool(same)
        report[f"{mode}/{k}/dropped_zero"] = bool((got.logprobs[~keep] == 0).all())
print(json.dumps(report))
"""


def test_logprobs_of_kept_cells_match_vllms_own():
    """vLLM's figures for every cell parse_output keeps (accepted drafts from their target rows, the last token of a
    request that accepted everything from its bonus row), sampled-token logprobs and top-k, in both logprob modes;
    the dropped cells are zero."""
    done = subprocess.run([sys.executable, "-c", LOGPROBS_EQUIVALENCE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report and all(report.values()), report


@pytest.mark.parametrize("greedy", [True, False])
def test_no_drafts_at_all_emits_the_bonus_tokens(greedy):
    out = sample_without_draft_probs(torch.zeros(0, dtype=torch.int32), [0, 0], 0, torch.zeros(0, VOCAB),
                                     torch.tensor([[3], [4]], dtype=torch.int32),
                                     metadata(torch.tensor([0.0 if greedy else 1.0] * 2)))
    assert out.tolist() == [[3], [4]]
