"""Rejection sampling for vLLM on the CPU without vocabulary-wide random numbers: the same verification rule as
vLLM's rejection sampler for drafters without draft probabilities (n-gram, suffix, ours), at a fraction of the
cost.

vLLM 0.32's CPU path follows its GPU layout: an Exp(1) draw for every (request, vocabulary entry) and their
reciprocals for the recovered-token kernel, a softmax of every target row, and for logprobs a zeroed
[requests + drafts, vocabulary] copy of all logits scattered and gathered again. On GPUs that keeps the step free of
host syncs; on this machine's two cores each vocabulary-wide pass costs milliseconds (SmolLM2's 49,152 entries at
~10-60 ns each), so with 10 requests and 11 drafts the rejection sampler took 141 ms against the plain sampler's
9.5 ms (torch profiler: exponential_ 28 ms, zero-fill, scatter and gather of the logprobs copy 30 ms). Draft-free
steps already bypass it (cpu_fixes.plugin.sample_plainly_without_drafts).

The rule, per request with drafts d_1..d_k and processed target rows p_1..p_k (draft probability 1, the drafter's
point mass): accept d_j while u_j < p_j(d_j) with u_j ~ U[0, 1); at the first rejection emit a token from p_j
with d_j removed (renormalised); if all k are accepted, emit the bonus token vLLM's sampler drew from the row
after the last draft. Greedy requests (temperature 0) accept while d_j is the argmax and emit the argmax. So the
first emitted token is distributed exactly as p_1, and each later one as its own row given the accepted prefix:
lossless. Costs: one max / exp / sum pass over the vocabulary per random draft row, one float64 cumulative sum per
rejected row (the recovered token by inverse CDF from one uniform), and uniforms per draft token: O(drafts x
vocabulary) arithmetic, no vocabulary-wide random numbers. Anything else (draft probabilities, synthetic
acceptance) goes to vLLM's own function.

Under keyed sampling (service/engine/vllm/keyed_sampler.py, the default for the service's requests) a random row
instead accepts d_j iff d_j is the keyed draw from p_j at its position, and that draw is the correction at the
first rejection: the same acceptance probability p_j(d_j), and the tokens plain decoding would have drawn.

`logprobs_of_kept_cells` replaces `RejectionSampler._get_logprobs_tensors`: vLLM's figures for the cells
`parse_output` keeps (accepted drafts, each request's last token), taken from the target row or the bonus row each
cell was sampled from; the other cells are zero, as nothing reads them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from das.service.engine.vllm.keyed_sampler import current_step, keyed_tokens

PLACEHOLDER = -1  # vLLM's PLACEHOLDER_TOKEN_ID: a grid cell after a request's last emitted token
GREEDY_TEMPERATURE = 0.0


def _uniforms(owners: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """float64 uniforms in [0, 1), one per entry of owners (a request index each); a request with its own
    generator (a seeded request) draws its entries from it, so its outputs repeat."""
    u = torch.rand(owners.numel(), dtype=torch.float64)
    if not generators:  # the common case: no seeded request, no per-entry Python loop
        return u
    for at, owner in enumerate(owners.tolist()):
        if owner in generators:
            u[at] = torch.rand(1, dtype=torch.float64, generator=generators[owner])[0]
    return u


def make_rejection_sample(vllm_rejection_sample: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """vLLM's module-level `rejection_sample` signature; the module docstring's rule for drafts without
    probabilities, vLLM's own function otherwise."""

    def rejection_sample(draft_token_ids: torch.Tensor, num_draft_tokens: list[int], max_spec_len: int,
                         cu_num_draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                         target_logits: torch.Tensor, bonus_token_ids: torch.Tensor, sampling_metadata: Any,
                         synthetic_mode: bool = False, synthetic_conditional_rates: torch.Tensor | None = None,
                         use_fp64_gumbel: bool = False) -> torch.Tensor:
        if draft_probs is not None or synthetic_mode:
            return vllm_rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                                         draft_probs, target_logits, bonus_token_ids, sampling_metadata,
                                         synthetic_mode, synthetic_conditional_rates, use_fp64_gumbel)
        step = current_step()
        return sample_without_draft_probs(draft_token_ids, num_draft_tokens, max_spec_len, target_logits,
                                          bonus_token_ids, sampling_metadata,
                                          None if step is None else step.target_row_keys())

    rejection_sample.__wrapped__ = vllm_rejection_sample  # type: ignore[attr-defined]
    return rejection_sample


def _rows(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """logits' `rows` (sorted, distinct); logits itself, uncopied, when they are all of its rows."""
    return logits if rows.numel() == logits.shape[0] else logits.index_select(0, rows)


def sample_without_draft_probs(draft_token_ids: torch.Tensor, num_draft_tokens: list[int], max_spec_len: int,
                               target_logits: torch.Tensor, bonus_token_ids: torch.Tensor, sampling_metadata: Any,
                               row_keys: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The [requests, max_spec_len + 1] int32 grid of emitted tokens (PLACEHOLDER after each request's last).

    target_logits: [drafts, vocab] processed (temperature, top-k, top-p applied) logits of the rows the drafts are
    verified against, request by request; bonus_token_ids: [requests, 1] tokens already sampled from the row after
    each request's last draft. row_keys: (int64 keys, bool keyed) per target row; a keyed random row accepts its
    draft iff the keyed sampler draws it there and is otherwise corrected to that draw (service/engine/
    keyed_sampler.py), an unkeyed one follows the module docstring's rule."""
    batch = len(num_draft_tokens)
    out = torch.full((batch, max_spec_len + 1), PLACEHOLDER, dtype=torch.int32)
    if draft_token_ids.numel() == 0:
        out[:, 0] = bonus_token_ids.view(-1).to(torch.int32)
        return out
    counts = torch.tensor(num_draft_tokens, dtype=torch.int64)
    starts = torch.cumsum(counts, 0) - counts
    req = torch.repeat_interleave(torch.arange(batch), counts)
    pos = torch.arange(req.numel()) - starts[req]
    draft = draft_token_ids.to(torch.int64)
    if sampling_metadata.all_greedy:
        greedy = torch.ones(batch, dtype=torch.bool)
    elif sampling_metadata.all_random:
        greedy = torch.zeros(batch, dtype=torch.bool)
    else:
        greedy = sampling_metadata.temperature[:batch] == GREEDY_TEMPERATURE
    row_greedy = greedy[req]

    accept = torch.zeros(req.numel(), dtype=torch.bool)
    correction = torch.zeros(req.numel(), dtype=torch.int64)  # the token a row emits if it is the first rejected
    g_rows = row_greedy.nonzero().squeeze(1)
    if g_rows.numel():
        correction[g_rows] = _rows(target_logits, g_rows).argmax(-1)
        accept[g_rows] = correction[g_rows] == draft[g_rows]
    row_keyed = ~row_greedy & row_keys[1] if row_keys is not None else torch.zeros_like(row_greedy)
    k_rows = row_keyed.nonzero().squeeze(1)
    if k_rows.numel():
        _draw_keyed_until_rejection(target_logits, row_keys[0], draft, req, k_rows[pos[k_rows] == 0], correction,
                                    accept)
    known = row_greedy | row_keyed  # rows whose correction is already drawn
    r_rows = (~known).nonzero().squeeze(1)
    weights = None
    if r_rows.numel():
        logits = _rows(target_logits, r_rows).to(torch.float32)
        weights = torch.exp(logits - logits.amax(-1, keepdim=True))  # -inf (top-k/top-p masked) -> 0
        total = weights.sum(-1, dtype=torch.float64)
        p_draft = weights.gather(1, draft[r_rows].unsqueeze(1)).squeeze(1).to(torch.float64) / total
        u = _uniforms(req[r_rows], sampling_metadata.generators)
        accept[r_rows] = u < p_draft

    # accepted prefix length a_i: drafts of request i before its first rejection
    rejected_so_far = torch.cumsum((~accept).to(torch.int64), 0)
    before = torch.where(starts > 0, rejected_so_far[(starts - 1).clamp(min=0)], 0)
    alive = rejected_so_far == before[req]
    accepted = torch.bincount(req[alive], minlength=batch)

    out[req[alive], pos[alive]] = draft[alive].to(torch.int32)
    done = (accepted == counts).nonzero().squeeze(1)
    out[done, counts[done]] = bonus_token_ids.view(-1)[done].to(torch.int32)
    stopped = (accepted < counts).nonzero().squeeze(1)
    if stopped.numel():
        rows = starts[stopped] + accepted[stopped]
        recovered = correction[rows]
        rand = (~known[rows]).nonzero().squeeze(1)
        if rand.numel():
            in_weights = torch.cumsum((~known).to(torch.int64), 0) - 1  # target row -> row of weights
            recovered[rand] = _recovered(weights.index_select(0, in_weights[rows[rand]]), draft[rows[rand]],
                                         stopped[rand], sampling_metadata.generators)
        out[stopped, accepted[stopped]] = recovered.to(torch.int32)
    return out


def _draw_keyed_until_rejection(target_logits: torch.Tensor, keys: torch.Tensor, draft: torch.Tensor,
                                req: torch.Tensor, first_rows: torch.Tensor, correction: torch.Tensor,
                                accept: torch.Tensor) -> None:
    """Keyed draws position by position, from the keyed requests' first target rows (`first_rows`): a row is drawn
    only if every earlier draft of its request was accepted. Rows after a request's first rejection are never read
    (the accepted prefix stops there and only the first rejected row's correction is emitted), so they are left
    rejected, undrawn. In place: `correction` and `accept` of the rows drawn.

    Cost: one kernel pass over the vocabulary per row drawn, i.e. per request its accepted drafts plus one instead
    of all its drafts (~0.14 ms a row for SmolLM2's 49,152 entries, ~0.45 ms for Qwen2.5's 151,936, on this
    machine's two cores), plus one row copy and a few small tensor operations per position."""
    live = first_rows
    while live.numel():
        drawn = keyed_tokens(_rows(target_logits, live), keys[live])
        correction[live] = drawn
        hit = drawn == draft[live]
        accept[live] = hit
        taken = live[hit]
        following = taken + 1  # the request's next target row, if it has one (rows are request by request)
        inside = following < req.numel()
        taken, following = taken[inside], following[inside]
        live = following[req[following] == req[taken]]


def _recovered(weights: torch.Tensor, drafts: torch.Tensor, requests: torch.Tensor,
               generators: dict[int, torch.Generator]) -> torch.Tensor:
    """A token from each rejected row's distribution without its draft token: inverse CDF of one uniform over the
    row's float64 cumulative weights (O(vocab) per row). weights: [rejected rows, vocab] unnormalised."""
    w = weights.to(torch.float64)
    w.scatter_(1, drafts.unsqueeze(1), 0.0)
    cdf = torch.cumsum(w, -1)
    target = _uniforms(requests, generators) * cdf[:, -1]
    token = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1).clamp_(max=w.shape[1] - 1)
    # all of the row's mass on the draft token (it was rejected only by rounding): the draft is the only choice
    return torch.where(cdf[:, -1] > 0, token, drafts)


def logprobs_of_kept_cells(self: Any, max_num_logprobs: int, metadata: Any, logits: torch.Tensor,
                           target_logits: torch.Tensor, bonus_logits: torch.Tensor,
                           sampled_token_ids: torch.Tensor) -> Any:
    """`RejectionSampler._get_logprobs_tensors` for the cells parse_output keeps (token in [0, vocab)); every other
    row of the result is zero. Cell (i, j) was sampled from request i's target row j when j < its draft count,
    else from its bonus row. Cost: log_softmax and top-k over (accepted drafts + requests) rows."""
    from vllm.v1.outputs import LogprobsTensors

    batch, width = sampled_token_ids.shape
    counts = torch.tensor(metadata.num_draft_tokens, dtype=torch.int64)
    starts = torch.cumsum(counts, 0) - counts
    tokens = sampled_token_ids.flatten().to(torch.int64)
    kept = ((tokens >= 0) & (tokens < logits.shape[-1])).nonzero().squeeze(1)
    req, j = kept // width, kept % width
    from_target = j < counts[req]
    cells = torch.cat([kept[from_target], kept[~from_target]])
    kept_logits = torch.cat([
        target_logits.index_select(0, (starts[req] + j)[from_target]).to(torch.float32),
        bonus_logits.index_select(0, req[~from_target]).to(torch.float32)])
    kept_logprobs = kept_logits if self.is_logits_logprobs_mode else self.sampler.compute_logprobs(kept_logits)
    part = self.sampler.gather_logprobs(kept_logprobs, max_num_logprobs, tokens[cells])
    ids = part.logprob_token_ids.new_zeros((batch * width, part.logprob_token_ids.shape[1]))
    values = part.logprobs.new_zeros((batch * width, part.logprobs.shape[1]))
    ranks = part.selected_token_ranks.new_zeros(batch * width)
    ids[cells], values[cells], ranks[cells] = part.logprob_token_ids, part.logprobs, part.selected_token_ranks
    return LogprobsTensors(ids, values, ranks)
