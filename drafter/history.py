"""Per-problem windowed rollout history and draft selection across its sources.

For each problem the bank keeps:
  * sealed segments, one suffix index per policy version, for the last `window` versions (evicted whole);
  * one live segment for the current version: the in-flight outputs of all sibling samples, fed token by token,
    so siblings see each other's text as it is generated (a request's own output is one of its sequences);
  * the problem's prompt(s).
A global index holds a bounded share of recent outputs of all problems (shared phrasing; the only history a new
problem has). Memory is bounded by a total token budget; the oldest sealed versions go first.

A proposal drafts from every source of the request's problem in one native call; a SourceChooser, which learns
online from the tokens that were really committed, picks the candidate expected to get the most tokens accepted.

A shadow draft (`HistoryBank.shadow`) is a proposal nobody verifies, followed over the next steps' committed tokens
until its first wrong one: what the request would have had accepted. vLLM verifies a drafted token (a point draft,
probability one) by accepting it with exactly the probability that plain decoding samples it, so a shadow draft's
outcome is distributed as a verified one's, and measures acceptance where the budget drafts nothing, at no cost to
the engine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from das.drafter._suffix_index import Choice, SuffixIndex
from das.drafter.records import RolloutRecord
from das.drafter.source_choice import SourceChooser


@dataclass(frozen=True)
class DrafterConfig:
    """Drafter settings. Sizes and budgets are in tokens."""

    max_depth: int = 32          # suffix index depth D: longest match + draft that can be followed
    window: int = 4              # sealed policy versions kept per problem
    min_prob: float = 0.0        # stop a draft when its cumulative probability falls below this
    match_factor: float = 0.0    # draft at most match_factor * matched-context tokens (0: no cap)
    prior: float = 2.0           # pseudo-count added to a node's continuations: discounts thin evidence
    choice_pseudo_count: float = 5.0  # weight of a candidate's own score before feedback arrives
    choice_horizon: float = 2000.0    # observations per calibration cell before old ones fade
    token_budget: int = 50_000_000   # all stored history tokens, all problems
    global_tokens: int = 2_000_000   # share of the budget for the cross-problem fallback
    shadow_gap: int = 8              # tokens a request commits between a settled shadow draft and its next

    def __post_init__(self) -> None:
        checks = {
            "max_depth": 1 <= self.max_depth <= 255,
            "window": self.window >= 1,
            "min_prob": 0.0 <= self.min_prob <= 1.0,
            "match_factor": 0.0 <= self.match_factor,
            "prior": 0.0 <= self.prior,
            "choice_pseudo_count": self.choice_pseudo_count > 0,
            "choice_horizon": self.choice_horizon >= 1,
            "token_budget": self.token_budget >= 1,
            "global_tokens": 0 <= self.global_tokens <= self.token_budget,
            "shadow_gap": self.shadow_gap >= 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid drafter config field(s): {', '.join(bad)} ({self})")


@dataclass
class Segment:
    """One suffix index and the ids of the sequences stored in it."""

    index: SuffixIndex
    seq_ids: list[int] = field(default_factory=list)

    @classmethod
    def new(cls, max_depth: int) -> Segment:
        return cls(SuffixIndex(max_depth))

    def add(self, tokens: np.ndarray, sealed: bool) -> int:
        seq = self.index.new_sequence()
        self.index.extend(seq, tokens)
        if sealed:
            self.index.seal(seq)
        self.seq_ids.append(seq)
        return seq

    def sequences(self) -> list[list[int]]:
        return [self.index.sequence(s) for s in self.seq_ids]

    @property
    def tokens(self) -> int:
        return self.index.num_tokens


@dataclass
class ProblemHistory:
    """Everything the drafter holds for one problem id."""

    problem_id: str
    max_depth: int
    prompts: Segment
    sealed: dict[int, Segment] = field(default_factory=dict)  # policy version -> segment, ascending
    live: Segment | None = None
    live_version: int = -1
    prompt_keys: set[bytes] = field(default_factory=set)

    def add_prompt(self, prompt: np.ndarray) -> None:
        key = prompt.tobytes()
        if key not in self.prompt_keys:
            self.prompt_keys.add(key)
            self.prompts.add(prompt, sealed=True)

    def tokens(self) -> int:
        live = self.live.tokens if self.live else 0
        return self.prompts.tokens + live + sum(s.tokens for s in self.sealed.values())

    def memory_bytes(self) -> int:
        segments = [self.prompts, *self.sealed.values(), *([self.live] if self.live else [])]
        return sum(s.index.memory_bytes() for s in segments)


@dataclass(slots=True)
class Proposal:
    """A draft for one request: token ids, cumulative acceptance probabilities, and where it came from."""

    tokens: np.ndarray      # int32
    probs: np.ndarray       # float32, probs[i] = P(tokens[:i+1] all accepted) as estimated by the source
    source: str             # "live", "prompt", "sealed-age-<a>", "global", or "" when nothing matched
    match_len: int


def _no_proposal() -> Proposal:
    return Proposal(np.zeros(0, np.int32), np.zeros(0, np.float32), "", 0)


@dataclass(frozen=True, slots=True)
class ShadowOutcome:
    """A shadow draft's result: of its `drafted` tokens, the first `accepted` were the tokens committed next."""

    drafted: int
    accepted: int


@dataclass
class _Request:
    problem: ProblemHistory
    live_seq: int
    # every candidate of the last proposal, scored against the tokens committed next
    pending: Choice | None = None
    # the shadow draft being compared with the committed tokens, and how many of its tokens agreed so far
    shadow: np.ndarray | None = None
    shadow_matched: int = 0
    shadow_wait: int = 0  # tokens to commit before the next shadow draft may start


class HistoryBank:
    """All problems' drafter history on one engine. Not thread-safe: one owner thread (the engine loop)."""

    def __init__(self, config: DrafterConfig | None = None) -> None:
        self.config = config or DrafterConfig()
        self.problems: dict[str, ProblemHistory] = {}
        self._requests: dict[str, _Request] = {}
        self._seal_order: deque[tuple[str, int]] = deque()  # (problem, version), oldest first
        self._global = Segment.new(self.config.max_depth)  # seq_ids oldest first
        self._sources: dict[str, tuple[list[SuffixIndex], list[int]]] = {}
        kinds = ["prompt", "live", *[f"sealed-age-{a}" for a in range(1, self.config.window + 1)], "global"]
        self.chooser = SourceChooser(kinds, self.config.choice_pseudo_count,
                                           self.config.choice_horizon)

    # ---- problems and requests ----

    def problem(self, problem_id: str) -> ProblemHistory:
        history = self.problems.get(problem_id)
        if history is None:
            history = ProblemHistory(problem_id, self.config.max_depth, Segment.new(self.config.max_depth))
            self.problems[problem_id] = history
        return history

    def start_request(self, request_id: str, problem_id: str, prompt: np.ndarray, policy_version: int) -> None:
        """Registers an in-flight sample; its output will feed the problem's live segment for `policy_version`."""
        # Everything is checked before anything changes.
        prompt = _tokens(prompt)
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already running")
        if not isinstance(problem_id, str) or not problem_id:
            raise ValueError(f"problem_id must be a non-empty string, got {problem_id!r}")
        if policy_version < 0:
            raise ValueError(f"policy_version must be >= 0, got {policy_version}")
        known = self.problems.get(problem_id)
        if known is not None and known.live is not None and policy_version < known.live_version:
            raise ValueError(f"problem {problem_id!r}: policy version {policy_version} is older than the live "
                             f"version {known.live_version}")
        history = self.problem(problem_id)
        if history.live is not None and history.live_version != policy_version:
            self._seal_problem(history)
        if history.live is None:
            history.live = Segment.new(self.config.max_depth)
            history.live_version = policy_version
        history.add_prompt(prompt)
        self._requests[request_id] = _Request(history, history.live.add(np.zeros(0, np.int32), sealed=False))
        self._sources.pop(problem_id, None)

    def extend(self, request_id: str, tokens: np.ndarray) -> ShadowOutcome | None:
        """Feeds tokens just committed to a request's output into its live segment (O(max_depth) per token), and
        scores the request's last candidates against them for the calibrator. Returns the outcome of the
        request's shadow draft where these tokens settled it (its first wrong token or its end reached)."""
        req = self._request(request_id)
        if not (isinstance(tokens, np.ndarray) and tokens.dtype == np.int32):
            tokens = _tokens(tokens)
        if req.pending is not None:
            self.chooser.observe(req.pending, tokens)
            req.pending = None
        req.problem.live.index.extend(req.live_seq, tokens)  # type: ignore[union-attr]
        if req.shadow is None:
            req.shadow_wait -= tokens.size
            return None
        return self._follow_shadow(req, tokens) if tokens.size else None

    def _follow_shadow(self, req: _Request, tokens: np.ndarray) -> ShadowOutcome | None:
        draft, matched = req.shadow, req.shadow_matched
        assert draft is not None
        ahead = draft[matched:matched + tokens.size]
        wrong = np.flatnonzero(ahead != tokens[:ahead.size])
        if not wrong.size and matched + ahead.size < draft.size:
            req.shadow_matched = matched + ahead.size
            return None
        req.shadow, req.shadow_wait = None, self.config.shadow_gap
        return ShadowOutcome(int(draft.size), matched + (int(wrong[0]) if wrong.size else int(ahead.size)))

    def finish_request(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None and req.problem.live is not None:
            req.problem.live.index.seal(req.live_seq)

    def propose(self, request_id: str, context: np.ndarray, max_tokens: int, min_prob: float = 0.0) -> Proposal:
        """Best draft of at most max_tokens tokens for a request whose prompt + output so far is `context`; every
        source's walk stops before a token whose cumulative probability is under max(min_prob, config.min_prob)
        (a per-request floor, e.g. the budget's token price; above 1 no token can pass, so nothing is proposed)."""
        req = self._request(request_id)
        if max_tokens <= 0 or min_prob > 1.0:
            return _no_proposal()
        req.pending = choice = self._choose(req, context, max_tokens, min_prob)
        if choice.best < 0:
            return _no_proposal()
        kinds = self._source_list(req.problem)[1]  # cached by _choose's call
        return Proposal(choice.tokens, choice.probs, self.chooser.kinds[kinds[choice.best]], choice.match_len)

    def shadow(self, request_id: str, context: np.ndarray, max_tokens: int) -> bool:
        """Starts a shadow draft of at most max_tokens tokens for a request that verifies none this step (module
        docstring); `extend` reports its outcome. Does nothing while the request's previous shadow draft is
        unsettled (one at a time: at most max_tokens + 1 steps each), until the request has committed
        `config.shadow_gap` tokens since it settled, or when no source has a draft. Returns whether one was
        started. O(a proposal) when it drafts, O(1) otherwise; the source chooser does not learn from it.

        The gap bounds the cost: without it a batch of 60 requests whose drafts mostly fail at once started ~33
        shadow drafts a step, +0.5 ms of the proposer's ~1.3 ms a step on the 2-core CPU; with 8 tokens the
        simulated makespans kept most of the gain (docs/results/2026-11-26-shadow-drafts.md)."""
        req = self._request(request_id)
        if req.shadow is not None or req.shadow_wait > 0 or max_tokens <= 0:
            return False
        choice = self._choose(req, np.ascontiguousarray(context, np.int32), max_tokens, 0.0)
        if choice.best < 0:
            return False
        req.shadow, req.shadow_matched = choice.tokens, 0
        return True

    def _choose(self, req: _Request, context: np.ndarray, max_tokens: int, min_prob: float) -> Choice:
        """Every source's draft for the request and the chooser's pick (native), under max(min_prob,
        config.min_prob)."""
        indices, kinds = self._source_list(req.problem)
        cfg = self.config
        return self.chooser.choose(indices, kinds, context, max_tokens, max(cfg.min_prob, min_prob), cfg.match_factor,
                                   cfg.prior)

    def _request(self, request_id: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request {request_id!r}")
        return req

    def _source_list(self, history: ProblemHistory) -> tuple[list[SuffixIndex], list[int]]:
        """The indices a request of this problem drafts from, and their calibrator kinds (cached until it changes)."""
        cached = self._sources.get(history.problem_id)
        if cached is not None:
            return cached
        kind = self.chooser.kind_index
        indices, kinds = [history.prompts.index], [kind("prompt")]
        if history.live is not None:
            indices.append(history.live.index)
            kinds.append(kind("live"))
        newest = history.live_version if history.live is not None else max(history.sealed, default=0) + 1
        for version, segment in sorted(history.sealed.items(), reverse=True):
            indices.append(segment.index)
            kinds.append(kind(f"sealed-age-{min(self.config.window, max(1, newest - version))}"))
        if self._global.seq_ids:
            indices.append(self._global.index)
            kinds.append(kind("global"))
        self._sources[history.problem_id] = (indices, kinds)
        return indices, kinds

    # ---- versions, import, budget ----

    def seal(self, policy_version: int) -> None:
        """Ends a policy version: every live segment of that version or older becomes a sealed segment."""
        for history in self.problems.values():
            if history.live is not None and history.live_version <= policy_version:
                self._seal_problem(history)

    def _seal_problem(self, history: ProblemHistory) -> None:
        segment, version = history.live, history.live_version
        assert segment is not None
        for seq in segment.seq_ids:
            if segment.index.contains(seq):
                segment.index.seal(seq)
        history.live, history.live_version = None, -1
        self._requests = {k: r for k, r in self._requests.items() if r.problem is not history}
        self.install_sealed(history, version, segment)

    def install_sealed(self, history: ProblemHistory, version: int, segment: Segment) -> None:
        """Adds a finished segment as `version` of `history`, applies the window and the token budget. A version
        that is already sealed (imported history, then live samples of the same version) gets the new segment's
        sequences added to it: O(max_depth) per token."""
        existing = history.sealed.get(version)
        if existing is not None:
            for seq in segment.seq_ids:
                tokens = np.asarray(segment.index.sequence(seq), np.int32)
                if len(tokens):
                    existing.add(tokens, sealed=True)
        else:
            history.sealed = dict(sorted({**history.sealed, version: segment}.items()))
            self._seal_order.append((history.problem_id, version))
        for old in [v for v in history.sealed if v <= version - self.config.window]:
            del history.sealed[old]
        self._feed_global(segment)
        self._sources.pop(history.problem_id, None)
        self._enforce_budget()

    def _feed_global(self, segment: Segment) -> None:
        """Copies a sealed segment's outputs into the cross-problem index, oldest evicted first (FIFO by sequence).
        Costs one more O(max_depth) insertion per token, at seal time."""
        if self.config.global_tokens == 0:
            return
        had_sources = bool(self._global.seq_ids)
        for seq in segment.seq_ids:
            tokens = np.asarray(segment.index.sequence(seq), np.int32)
            if len(tokens):
                self._global.add(tokens, sealed=True)
        while self._global.tokens > self.config.global_tokens and self._global.seq_ids:
            self._global.index.remove(self._global.seq_ids.pop(0))
        if not had_sources and self._global.seq_ids:
            self._sources.clear()  # every problem gains the global source

    def _enforce_budget(self) -> None:
        while self.stored_tokens() > self.config.token_budget and self._seal_order:
            problem_id, version = self._seal_order.popleft()
            history = self.problems.get(problem_id)
            if history is not None and history.sealed.pop(version, None) is not None:
                self._sources.pop(problem_id, None)

    def add_rollouts(self, records: Iterable[RolloutRecord]) -> int:
        """Imports finished rollouts as sealed segments, grouped by (problem, policy version). Returns the count."""
        groups: dict[tuple[str, int], list[RolloutRecord]] = {}
        for rec in records:
            groups.setdefault((rec.problem_id, rec.policy_version), []).append(rec)
        for (problem_id, version), recs in sorted(groups.items(), key=lambda kv: kv[0][1]):
            history = self.problem(problem_id)
            segment = Segment.new(self.config.max_depth)
            for rec in sorted(recs, key=lambda r: r.sample_index):
                history.add_prompt(_tokens(rec.prompt_token_ids))
                segment.add(_tokens(rec.output_token_ids), sealed=True)
            self.install_sealed(history, version, segment)
        return sum(len(v) for v in groups.values())

    # ---- accounting ----

    def stored_tokens(self) -> int:
        return self._global.tokens + sum(h.tokens() for h in self.problems.values())

    def memory_bytes(self) -> int:
        return self._global.index.memory_bytes() + sum(h.memory_bytes() for h in self.problems.values())


def _tokens(values: Iterable[int] | np.ndarray) -> np.ndarray:
    """Token ids as a contiguous int32 array; anything outside [0, 2**31 - 1] is a ValueError, not a wrap-around."""
    arr = np.asarray(values)
    if arr.dtype == np.int32 and (arr.size == 0 or arr.min() >= 0):
        return np.ascontiguousarray(arr)
    if arr.size and (arr.dtype.kind not in "iu" or arr.ndim != 1):
        raise ValueError(f"token ids must be a 1-D sequence of integers, got dtype {arr.dtype} shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 2**31 - 1):
        raise ValueError("token id outside [0, 2147483647]")
    return np.ascontiguousarray(arr, dtype=np.int32)


def accepted_prefix(draft: np.ndarray, truth: np.ndarray) -> int:
    """Tokens a verifier accepts along a recorded path: the common prefix of the draft and the truth."""
    n = min(len(draft), len(truth))
    if n == 0:
        return 0
    miss = np.flatnonzero(draft[:n] != truth[:n])
    return int(miss[0]) if miss.size else n
