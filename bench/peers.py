"""Peer drafters for the drafter replay benchmark (`das bench drafter`).

Each peer reproduces a speculative method that vLLM ships, driven the way vLLM v1 drives it, behind the
`ReplayDrafter` protocol that `das.bench.drafter_replay` calls:

- `ArcticSuffixDrafter`: vLLM's `suffix` method, ArcticInference's `SuffixDecodingCache` (one global tree of
  recent responses plus one prompt tree per active request).
- `NgramDrafter`: vLLM's `ngram` method (prompt lookup over the request's own prompt and output).

Token ids are int32 throughout, times are the replay's to measure, sizes are in bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from arctic_inference.suffix_decoding import SuffixDecodingCache

_EMPTY = np.empty(0, dtype=np.int32)
_EMPTY.flags.writeable = False  # shared by every empty draft


@runtime_checkable
class ReplayDrafter(Protocol):
    """What the replay drives. Requests of one policy version are interleaved step by step, like a real batch."""

    name: str

    def begin_version(self, policy_version: int) -> None:
        """Called before the batch of `policy_version` is decoded."""

    def start_request(self, request_id: str, problem_id: str, prompt: np.ndarray) -> None:
        """A new request of `problem_id` with int32 `prompt` ids."""

    def propose(self, request_id: str, context: np.ndarray, max_tokens: int) -> np.ndarray:
        """Draft for the next tokens given `context` (prompt + output so far, int32); int32, length <= max_tokens."""

    def extend(self, request_id: str, tokens: np.ndarray) -> None:
        """`tokens` (int32) were just committed to the request's output."""

    def finish_request(self, request_id: str) -> None:
        """The request is done; it will not be proposed for or extended again."""

    def end_version(self, policy_version: int) -> None:
        """The batch of `policy_version` is done."""

    def memory_bytes(self) -> int:
        """Bytes held for history."""

    def stored_tokens(self) -> int:
        """Tokens of history held (prompts and responses, as the drafter stores them)."""


def _int32(tokens: np.ndarray) -> np.ndarray:
    """A 1-D contiguous int32 view of `tokens` (a copy only when dtype or layout differ)."""
    return np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)


# vLLM v1 defaults for the `suffix` method (vllm/config/speculative.py, SpeculativeConfig.suffix_decoding_*).
VLLM_SUFFIX_MAX_TREE_DEPTH = 24
VLLM_SUFFIX_MAX_CACHED_REQUESTS = 10000
VLLM_SUFFIX_MAX_SPEC_FACTOR = 1.0
VLLM_SUFFIX_MIN_TOKEN_PROB = 0.1


class ArcticSuffixDrafter:
    """vLLM's `suffix` speculative method: ArcticInference's `SuffixDecodingCache`, called as vLLM v1 calls it.

    As in vLLM's `SuffixDecodingProposer`: `start_request` builds the request's prompt tree and reserves its slot
    in the global response tree (FIFO eviction beyond `max_cached_requests`); every committed chunk goes to
    `add_active_response` (prompt tree and global tree); `speculate` gets the last `max_depth` tokens of the
    context as the pattern, `max_spec_tokens` = the replay's budget, vLLM's `max_spec_factor` and
    `min_token_prob`, the cache's default `max_spec_offset` (0) and linear drafts (`use_tree_spec` off);
    `stop_request` at finish drops the prompt tree while the response stays in the global tree. Policy versions
    mean nothing to it: history is the last `max_cached_requests` responses, whatever their problem or version.

    Memory is the sum of the native trees' own `estimate_memory()` (global tree + live prompt trees). That
    estimate walks every node (O(nodes), so it is not for a hot path) and counts each stored sequence as
    `sizeof(std::vector<int32_t>) * capacity`, i.e. 24 bytes per token of capacity where 4 are used: it is the
    library's figure, reported as is. Stored tokens are the tokens inserted into the trees that still hold them:
    responses still cached in the global tree, plus prompt + response of each live request's prompt tree.
    """

    def __init__(self, max_depth: int = VLLM_SUFFIX_MAX_TREE_DEPTH, *,
                 max_cached_requests: int = VLLM_SUFFIX_MAX_CACHED_REQUESTS,
                 max_spec_factor: float = VLLM_SUFFIX_MAX_SPEC_FACTOR,
                 min_token_prob: float = VLLM_SUFFIX_MIN_TOKEN_PROB) -> None:
        # Imported here so that the rest of the drafter package works without arctic-inference installed.
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.name = f"arctic-d{max_depth}"
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._cache: SuffixDecodingCache = SuffixDecodingCache(max_tree_depth=max_depth,
                                                               max_cached_requests=max_cached_requests)
        self._prompt_len: dict[str, int] = {}     # live requests: prompt tokens in their prompt tree
        self._response_len: dict[str, int] = {}   # started, not yet evicted: response tokens inserted

    def begin_version(self, policy_version: int) -> None:
        """No-op: the cache has no notion of policy versions."""

    def start_request(self, request_id: str, problem_id: str, prompt: np.ndarray) -> None:
        """Builds the prompt tree (O(len(prompt) * max_depth)); `problem_id` is unused, the cache is global."""
        prompt = _int32(prompt)
        self._cache.start_request(request_id, prompt)
        self._prompt_len[request_id] = len(prompt)
        # Re-inserted, not overwritten: a reused id moves to the back of the cache's FIFO order, and so here.
        self._response_len.pop(request_id, None)
        self._response_len[request_id] = 0
        self._forget_evicted()

    def _forget_evicted(self) -> None:
        """Drops the lengths of responses the cache has evicted, so the map stays as bounded as the cache.

        The cache evicts in start order and `_response_len` is in start order too, so evicted entries gather at
        its front; popping them there costs O(evicted) per call.
        """
        cached = self._cache.cached_requests
        while self._response_len:
            oldest = next(iter(self._response_len))
            if oldest in cached or oldest in self._prompt_len:
                break
            del self._response_len[oldest]

    def propose(self, request_id: str, context: np.ndarray, max_tokens: int) -> np.ndarray:
        """Best of the prompt tree's and the global tree's drafts for the last `max_depth` context tokens."""
        if max_tokens <= 0:
            return _EMPTY
        pattern = _int32(context[-self.max_depth:])
        draft = self._cache.speculate(request_id, pattern, max_spec_tokens=max_tokens,
                                      max_spec_factor=self.max_spec_factor, min_token_prob=self.min_token_prob)
        return np.asarray(draft.token_ids, dtype=np.int32)

    def extend(self, request_id: str, tokens: np.ndarray) -> None:
        """Appends to the prompt tree and the global tree: O(len(tokens) * max_depth)."""
        tokens = _int32(tokens)
        self._cache.add_active_response(request_id, tokens)
        self._response_len[request_id] += len(tokens)

    def finish_request(self, request_id: str) -> None:
        """Drops the prompt tree; the response stays in the global tree until FIFO eviction."""
        self._cache.stop_request(request_id)
        del self._prompt_len[request_id]

    def end_version(self, policy_version: int) -> None:
        """No-op: the cache has no notion of policy versions."""

    def memory_bytes(self) -> int:
        """Native `estimate_memory()` of the global tree plus every live prompt tree, in bytes."""
        # The cache exposes its trees only as private attributes; the native estimate is the one figure the
        # library itself offers, so it is read there rather than guessed from outside.
        trees = [self._cache._global_tree, *self._cache._local_trees.values()]
        return sum(int(tree.estimate_memory()) for tree in trees)

    def stored_tokens(self) -> int:
        """Tokens held: cached responses in the global tree + prompt and response of each live prompt tree."""
        cached = sum(self._response_len[r] for r in self._cache.cached_requests)
        live = sum(n + self._response_len[r] for r, n in self._prompt_len.items())
        return cached + live


# vLLM v1 defaults for the `ngram` method when neither prompt_lookup_min nor prompt_lookup_max is given
# (vllm/config/speculative.py, SpeculativeConfig.__post_init__).
VLLM_PROMPT_LOOKUP_MIN = 5
VLLM_PROMPT_LOOKUP_MAX = 5


class _TokenBuffer:
    """A growable int32 array: amortized O(1) per appended token (capacity doubles)."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.data = np.empty(max(16, 2 * len(tokens)), dtype=np.int32)
        self.data[:len(tokens)] = tokens
        self.size = len(tokens)

    def append(self, tokens: np.ndarray) -> None:
        end = self.size + len(tokens)
        if end > len(self.data):
            grown = np.empty(max(end, 2 * len(self.data)), dtype=np.int32)
            grown[:self.size] = self.data[:self.size]
            self.data = grown
        self.data[self.size:end] = tokens
        self.size = end

    def view(self) -> np.ndarray:
        return self.data[:self.size]


class NgramDrafter:
    """vLLM's `ngram` speculative method (prompt lookup) over each request's own prompt + output.

    Finds the longest n in [min_n, max_n] such that the last n context tokens occur earlier in the context (an
    occurrence ending before the last token; it may overlap the suffix), and proposes the tokens that followed
    that occurrence, up to `max_tokens` and the end of the context. Among occurrences of that n, vLLM v1 takes the
    earliest (its KMP scan over the reversed context keeps the last hit, i.e. the first in context order);
    `prefer="latest"` takes the most recent one instead. No history across requests.

    Cost of `propose` for a context of L tokens: one vectorized O(L) comparison of the context against its last
    token, then at most max_n - 1 gathers over the surviving candidate positions (each O(candidates)), so
    O(L + max_n * c) time with c <= L, and O(L) bytes of temporary masks. `extend` is an amortized O(len(tokens))
    append to the request's buffer.

    Memory is the allocated capacity of the live requests' context buffers (int32, so 4 bytes per slot); stored
    tokens are the tokens in them. Both drop to zero as requests finish.
    """

    def __init__(self, min_n: int = VLLM_PROMPT_LOOKUP_MIN, max_n: int = VLLM_PROMPT_LOOKUP_MAX, *,
                 prefer: Literal["earliest", "latest"] = "earliest") -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if prefer not in ("earliest", "latest"):
            raise ValueError(f"prefer must be 'earliest' or 'latest', got {prefer!r}")
        self.name = "ngram" if prefer == "earliest" else "ngram-latest"
        self.min_n = min_n
        self.max_n = max_n
        self.prefer = prefer
        self._contexts: dict[str, _TokenBuffer] = {}

    def begin_version(self, policy_version: int) -> None:
        """No-op: prompt lookup keeps no history across requests."""

    def start_request(self, request_id: str, problem_id: str, prompt: np.ndarray) -> None:
        """Copies the prompt into the request's context buffer."""
        self._contexts[request_id] = _TokenBuffer(_int32(prompt))

    def propose(self, request_id: str, context: np.ndarray, max_tokens: int) -> np.ndarray:
        """Prompt-lookup draft from the request's held context, which must be `context` (checked by length)."""
        held = self._contexts[request_id]
        if len(context) != held.size:
            raise ValueError(f"request {request_id!r}: context has {len(context)} tokens, "
                             f"the drafter holds {held.size} (prompt + extended tokens)")
        return ngram_lookup(held.view(), self.min_n, self.max_n, max_tokens, latest=self.prefer == "latest")

    def extend(self, request_id: str, tokens: np.ndarray) -> None:
        """Appends the committed tokens to the request's context buffer."""
        self._contexts[request_id].append(_int32(tokens))

    def finish_request(self, request_id: str) -> None:
        """Frees the request's context buffer."""
        del self._contexts[request_id]

    def end_version(self, policy_version: int) -> None:
        """No-op: prompt lookup keeps no history across requests."""

    def memory_bytes(self) -> int:
        """Allocated bytes of the live context buffers."""
        return sum(b.data.nbytes for b in self._contexts.values())

    def stored_tokens(self) -> int:
        """Tokens in the live context buffers."""
        return sum(b.size for b in self._contexts.values())


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, max_tokens: int, *, latest: bool = False) -> np.ndarray:
    """Prompt lookup on int32 `tokens`: see `NgramDrafter`. Returns the draft (int32, possibly empty).

    Candidates are the end positions e <= L-2 of earlier occurrences; matching grows one token backwards per step
    (suffix token L-1-j against tokens[e-j]), so the survivors after step j are the occurrences of the last j+1
    tokens, and the last non-empty set (capped at max_n) is the set for the longest n.
    """
    total = len(tokens)
    longest_possible = min(max_n, total - 1)  # an earlier occurrence of n tokens must end by position L-2
    if max_tokens <= 0 or longest_possible < min_n:
        return _EMPTY
    ends = np.flatnonzero(tokens[:total - 1] == tokens[total - 1])
    if ends.size == 0:
        return _EMPTY
    matched, best = 1, ends
    for j in range(1, longest_possible):
        ends = ends[np.searchsorted(ends, j):]  # need e - j >= 0; ends stays sorted
        ends = ends[tokens[ends - j] == tokens[total - 1 - j]]
        if ends.size == 0:
            break
        matched, best = j + 1, ends
    if matched < min_n:
        return _EMPTY
    start = int(best[-1] if latest else best[0]) + 1
    return tokens[start:start + max_tokens].copy()
