"""Per-problem windowed rollout history and draft selection across its sources.

For each problem the bank keeps:
  * sealed segments, one suffix index per policy version, for the last `window` versions (evicted whole);
  * one live segment for the current version: the in-flight outputs of all sibling samples, fed token by token,
    so siblings see each other's text as it is generated (a request's own output is one of its sequences);
  * the problem's prompt(s);
  * per agent session (a request tagged with a session id), its context: one sequence extended by each turn's new
    tokens (the previous turn's output, a tool's output), so a turn costs its new tokens, not its whole context
    again, and drafts from what the trajectory has read and written (source kind "context");
  * per sampling key, the latest finished sample drawn with it (source kind "same-key"). Under keyed sampling a
    sample's draws are a function of its key and position, so a trainer that gives a problem the same seed at
    every visit (coupled epochs) draws sample i from the same noise each time: it repeats its previous visit's
    sample token for token until the policy's updates flip a draw. Its own index (the prompt's last max_depth
    tokens and that output) is built when a request with the key starts, so a key that never comes back (every
    key, without coupling) costs only its output's copy at finish.
A global index holds a bounded share of recent outputs of all problems (shared phrasing; the only history a new
problem has). Memory is bounded by a total token budget; the oldest sealed versions go first.

A proposal drafts from every source of the request's problem in one native call; a SourceChooser, which learns
online from the tokens that were really committed, picks the candidate expected to get the most tokens accepted.

The per-step work for a whole batch (feeding committed tokens, scoring the last drafts, drafting) is one native
call each (`HistoryBank.commit_step`, `HistoryBank.draft_step`; the native `RequestTable`); `extend`, `propose`
and `shadow` are the same calls for one request.

A shadow draft (`HistoryBank.shadow`) is a proposal nobody verifies, followed over the next steps' committed tokens
until its first wrong one: what the request would have had accepted. vLLM verifies a drafted token (a point draft,
probability one) by accepting it with exactly the probability that plain decoding samples it, so a shadow draft's
outcome is distributed as a verified one's, and measures acceptance where the budget drafts nothing, at no cost to
the engine.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from das.drafter._suffix_index import RequestTable, SourceList, SuffixIndex
from das.drafter.config import DrafterConfig
from das.drafter.records import RolloutRecord
from das.drafter.source_choice import SourceChooser

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
    running: set[str] = field(default_factory=set)  # ids of its in-flight requests
    keyed: dict[int, KeyedSample] = field(default_factory=dict)  # sampling key -> its latest finished sample

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
        return sum(s.index.memory_bytes() for s in segments) + sum(k.memory_bytes() for k in self.keyed.values())

    def drop_keyed(self, through_version: int) -> None:
        """Forgets the keyed samples of `through_version` or older (their version left the window)."""
        for key in [k for k, sample in self.keyed.items() if sample.version <= through_version]:
            del self.keyed[key]


@dataclass
class KeyedSample:
    """A finished sample that carried a sampling key: `tokens` its prompt's last max_depth tokens then its output
    (int32), drawn under policy `version`; `segment` their index, built the first time a request with the same key
    drafts from it (None until then). Requests that hold the segment keep it alive when a newer sample replaces
    this one."""

    version: int
    tokens: np.ndarray
    segment: Segment | None = None

    def index(self, max_depth: int) -> Segment:
        if self.segment is None:
            self.segment = Segment.new(max_depth)
            self.segment.add(self.tokens, sealed=True)
        return self.segment

    def memory_bytes(self) -> int:
        return self.tokens.nbytes + (self.segment.index.memory_bytes() if self.segment is not None else 0)


@dataclass(slots=True)
class Proposal:
    """A draft for one request: token ids, cumulative acceptance probabilities, and where it came from."""

    tokens: np.ndarray      # int32
    probs: np.ndarray       # float32, probs[i] = P(tokens[:i+1] all accepted), calibrated (`SourceChooser`)
    source: str             # "live", "prompt", "sealed-age-<a>", "global", or "" when nothing matched
    match_len: int


def _no_proposal() -> Proposal:
    return Proposal(np.zeros(0, np.int32), np.zeros(0, np.float32), "", 0)


@dataclass(frozen=True, slots=True)
class ShadowOutcome:
    """A shadow draft's result: of its `drafted` tokens, the first `accepted` were the tokens committed next."""

    drafted: int
    accepted: int


@dataclass(frozen=True, slots=True)
class StepCommit:
    """What the committed tokens of one step settled, per batch row (int32 arrays of the batch's length).

    drafted / accepted: the row's last proposal (`draft_step` or `propose`) and how many of its tokens the
    committed ones confirm (the common prefix, at most all but the last committed token: a verification step
    commits the accepted draft tokens plus one of its own); 0 / 0 without one. source: the proposal's source kind
    (`HistoryBank.chooser.kinds` index), -1 without one. shadow_drafted / shadow_accepted: a shadow draft these
    tokens settled, 0 / 0 where none did."""

    drafted: np.ndarray
    accepted: np.ndarray
    source: np.ndarray
    shadow_drafted: np.ndarray
    shadow_accepted: np.ndarray


@dataclass(frozen=True, slots=True)
class StepDrafts:
    """The drafts of one step: row r's is tokens[offsets[r]:offsets[r + 1]] (int32) with their cumulative
    acceptance probabilities probs (float32); sources: its source kind (-1: no draft); match_lens: its matched
    context tokens; shadowed: whether a shadow draft started for the row (bool)."""

    tokens: np.ndarray
    probs: np.ndarray
    offsets: np.ndarray
    sources: np.ndarray
    match_lens: np.ndarray
    shadowed: np.ndarray

    def lists(self) -> list[list[int]]:
        """Each row's draft as a list of token ids."""
        flat, bounds = self.tokens.tolist(), self.offsets.tolist()
        return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


@dataclass(frozen=True, slots=True)
class _Sources:
    """The indexes a request of one problem drafts from, their calibrator kinds, and the native list of both that
    the problem's running requests hold."""

    indices: list[SuffixIndex]
    kinds: list[int]
    native: SourceList


@dataclass
class SessionContext:
    """One agent session's context as the drafter holds it: `tokens` (the latest turn's prompt) indexed as one
    unsealed sequence of its own segment, extended turn by turn. `running`: its requests in flight."""

    problem_id: str
    segment: Segment
    seq: int
    tokens: np.ndarray
    running: int = 0


@dataclass(slots=True)
class _Request:
    problem: ProblemHistory
    live_seq: int
    slot: int  # its row in the native request table
    context: SessionContext | None = None  # its session's, drafted from beside its problem's sources
    sample_key: int | None = None  # its sampling key: its output is kept under it when it finishes
    prompt_tail: np.ndarray | None = None  # its prompt's last max_depth tokens, with a key
    same_key: Segment | None = None  # the index of the latest finished sample with its key, drafted from


class HistoryBank:
    """All problems' drafter history on one engine. Not thread-safe: one owner thread (the engine loop)."""

    def __init__(self, config: DrafterConfig | None = None) -> None:
        self.config = config or DrafterConfig()
        self.problems: dict[str, ProblemHistory] = {}
        self._requests: dict[str, _Request] = {}
        self._seal_order: deque[tuple[str, int]] = deque()  # (problem, version), oldest first
        self._global = Segment.new(self.config.max_depth)  # seq_ids oldest first
        self._sources: dict[str, _Sources] = {}  # per problem, cached until they change (`_sources_changed`)
        kinds = ["prompt", "live", *[f"sealed-age-{a}" for a in range(1, self.config.window + 1)], "global",
                 "context", "same-key"]
        self.chooser = SourceChooser(kinds, self.config.choice_pseudo_count, self.config.choice_horizon)
        self._table = RequestTable(self.chooser, self.config.shadow_gap)
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._contexts: OrderedDict[str, SessionContext] = OrderedDict()  # by session, least recently used first
        self._context_tokens = 0

    # ---- problems and requests ----

    def problem(self, problem_id: str) -> ProblemHistory:
        history = self.problems.get(problem_id)
        if history is None:
            history = ProblemHistory(problem_id, self.config.max_depth, Segment.new(self.config.max_depth))
            self.problems[problem_id] = history
        return history

    def start_request(self, request_id: str, problem_id: str, prompt: np.ndarray, policy_version: int,
                      session_id: str | None = None, sample_key: int | None = None) -> int:
        """Registers an in-flight sample; its output will feed the problem's live segment for `policy_version`.
        Returns its slot, the request's name in `commit_step` and `draft_step` (reused once it finishes). A turn of
        session `session_id` indexes its prompt as that session's context (extended by the tokens beyond the last
        turn's prompt when that is a prefix of this one; anew otherwise), not among the problem's prompts. A
        request with a `sample_key` (its keyed-sampling key, an int64) also drafts from the latest finished sample
        of its problem with that key, and its output is kept under the key when it finishes (`finish_request`)."""
        # Everything is checked before anything changes.
        prompt = _tokens(prompt)
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already running")
        if not isinstance(problem_id, str) or not problem_id:
            raise ValueError(f"problem_id must be a non-empty string, got {problem_id!r}")
        if policy_version < 0:
            raise ValueError(f"policy_version must be >= 0, got {policy_version}")
        if sample_key is not None and not (isinstance(sample_key, (int, np.integer))
                                           and not isinstance(sample_key, bool) and -2**63 <= sample_key < 2**63):
            raise ValueError(f"sample_key must be an int64 or None, got {sample_key!r}")
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
            self._sources_changed(history)
        context = None
        if session_id is None:
            history.add_prompt(prompt)
        else:
            context = self._session_context(session_id, problem_id, prompt)
        seq = history.live.add(np.zeros(0, np.int32), sealed=False)
        slot = self._free_slots.pop() if self._free_slots else self._next_slot
        self._next_slot = max(self._next_slot, slot + 1)
        req = _Request(history, seq, slot, context)
        if sample_key is not None:
            req.sample_key, req.prompt_tail = int(sample_key), prompt[-self.config.max_depth:].copy()
            earlier = history.keyed.get(req.sample_key)
            req.same_key = earlier.index(self.config.max_depth) if earlier is not None else None
        self._table.add(slot, history.live.index, seq, self._request_sources(history, req))
        self._requests[request_id] = req
        history.running.add(request_id)
        return slot

    def commit_step(self, slots: np.ndarray, table: np.ndarray, start: np.ndarray, end: np.ndarray,
                    rows: np.ndarray | None = None) -> StepCommit:
        """One step's committed tokens for a batch: request slots[r] committed table[rows[r], start[r]:end[r]]
        (table: int32, a row per request; rows: None for row r; none where end[r] <= start[r]). Feeds them into
        the live segments (O(max_depth) per token), scores the last candidates for the source chooser and the last
        proposals and shadow drafts. Checked before anything changes (ValueError)."""
        out = self._table.commit(np.ascontiguousarray(slots, np.int32), _token_table(table), _rows(rows, len(slots)),
                                 np.ascontiguousarray(start, np.int64), np.ascontiguousarray(end, np.int64))
        return StepCommit(*out)

    def draft_step(self, slots: np.ndarray, table: np.ndarray, end: np.ndarray, k: np.ndarray, min_prob: np.ndarray,
                   shadow_room: np.ndarray, vocab_size: int = 0, rows: np.ndarray | None = None) -> StepDrafts:
        """One step's drafts for a batch: request slots[r], whose prompt + output so far is table[rows[r], :end[r]]
        (rows: None for row r), gets the chooser's pick of at most k[r] tokens (every source's walk stopping before
        a token whose own cumulative probability is under config.min_prob), cut before its first token whose
        calibrated cumulative probability is under max(min_prob[r], config.min_prob) (above 1: nothing) and before
        its first token >= vocab_size (0: no cut); a request with k[r] == 0 and shadow_room[r] > 0 may start
        a shadow draft of at most that many tokens (`shadow`). Checked before anything changes (ValueError)."""
        cfg = self.config
        out = self._table.draft(np.ascontiguousarray(slots, np.int32), _token_table(table), _rows(rows, len(slots)),
                                np.ascontiguousarray(end, np.int64),
                                np.ascontiguousarray(k, np.int32), np.ascontiguousarray(min_prob, np.float64),
                                np.ascontiguousarray(shadow_room, np.int32), cfg.min_prob, cfg.match_factor,
                                cfg.prior, cfg.max_depth, vocab_size)
        tokens, probs, offsets, sources, match_lens, shadowed = out
        return StepDrafts(tokens, probs, offsets, sources, match_lens, shadowed.astype(bool))

    def extend(self, request_id: str, tokens: np.ndarray) -> ShadowOutcome | None:
        """Feeds tokens just committed to one request's output (`commit_step` for one row). Returns the outcome of
        its shadow draft where these tokens settled it (its first wrong token or its end reached)."""
        req = self._request(request_id)
        if not (isinstance(tokens, np.ndarray) and tokens.dtype == np.int32):
            tokens = _tokens(tokens)
        drafted, accepted = self._table.commit_one(req.slot, tokens)[3:]
        return ShadowOutcome(drafted, accepted) if drafted else None

    def finish_request(self, request_id: str) -> None:
        """Ends a request (finished or aborted); its output stays in the live segment, and, with a sampling key,
        becomes the key's latest sample (an aborted one's output is a prefix of what its draw would have been)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        if req.sample_key is not None and req.problem.live is not None and req.prompt_tail is not None:
            output = np.asarray(req.problem.live.index.sequence(req.live_seq), np.int32)
            if len(output):
                req.problem.keyed[req.sample_key] = KeyedSample(req.problem.live_version,
                                                                np.concatenate([req.prompt_tail, output]))
        self._drop(request_id, req)

    def _drop(self, request_id: str, req: _Request) -> None:
        self._table.remove(req.slot)
        self._free_slots.append(req.slot)
        req.problem.running.discard(request_id)
        if req.problem.live is not None:
            req.problem.live.index.seal(req.live_seq)
        if req.context is not None:
            req.context.running -= 1
            self._evict_contexts()

    def _session_context(self, session_id: str, problem_id: str, prompt: np.ndarray) -> SessionContext:
        """The session's context, brought up to `prompt` at the cost of its new tokens when the context held is a
        prefix of it (a later turn), else indexed anew (a first turn, or a trajectory that rewrote its past)."""
        context = self._contexts.pop(session_id, None)
        held = len(context.tokens) if context is not None else 0
        if (context is not None and context.problem_id == problem_id and len(prompt) >= held
                and np.array_equal(prompt[:held], context.tokens)):
            if len(prompt) > held:
                context.segment.index.extend(context.seq, prompt[held:])
                context.tokens = prompt.copy()
                self._context_tokens += len(prompt) - held
        else:
            self._context_tokens -= held  # a request still reading the old one keeps its index alive until it ends
            segment = Segment.new(self.config.max_depth)
            context = SessionContext(problem_id, segment, segment.add(prompt, sealed=False), prompt.copy())
            self._context_tokens += len(prompt)
        context.running += 1
        self._contexts[session_id] = context
        self._evict_contexts()
        return context

    def _evict_contexts(self) -> None:
        """Drops the least recently used idle session contexts while they hold over `context_tokens`."""
        if self._context_tokens <= self.config.context_tokens:
            return
        for session_id in [s for s, c in self._contexts.items() if c.running == 0]:
            self._context_tokens -= len(self._contexts.pop(session_id).tokens)
            if self._context_tokens <= self.config.context_tokens:
                return

    def propose(self, request_id: str, context: np.ndarray, max_tokens: int, min_prob: float = 0.0) -> Proposal:
        """Best draft of at most max_tokens tokens for a request whose prompt + output so far is `context`
        (`draft_step` for one row), cut before its first token whose calibrated cumulative probability is under
        max(min_prob, config.min_prob) (a per-request floor, e.g. the budget's token price; above 1 no token can
        pass, so nothing is proposed)."""
        if max_tokens <= 0 or min_prob > 1.0:
            self._request(request_id)
            return _no_proposal()
        tokens, probs, source, match_len, _ = self._draft_one(request_id, context, max_tokens, min_prob, 0)
        if source < 0:
            return _no_proposal()
        return Proposal(tokens, probs, self.chooser.kinds[source], match_len)

    def shadow(self, request_id: str, context: np.ndarray, max_tokens: int) -> bool:
        """Starts a shadow draft of at most max_tokens tokens for a request that verifies none this step (module
        docstring); `extend` reports its outcome. Does nothing while the request's previous shadow draft is
        unsettled (one at a time: at most max_tokens + 1 steps each), until the request has committed
        `config.shadow_gap` tokens since it settled, or when no source has a draft. Returns whether one was
        started. O(a proposal) when it drafts, O(1) otherwise; the source chooser does not learn from it.

        The gap bounds the cost: without it a batch whose drafts mostly fail at once starts a shadow draft for most
        of its requests every step (measured: docs/design "From the optimum to a step")."""
        return self._draft_one(request_id, context, 0, 0.0, max(0, max_tokens))[4]

    def _draft_one(self, request_id: str, context: np.ndarray, k: int, min_prob: float, shadow_room: int
                   ) -> tuple[np.ndarray, np.ndarray, int, int, bool]:
        """`draft_step` for one row: (tokens, probs, source kind or -1, match length, whether a shadow draft
        started)."""
        req = self._request(request_id)
        if not (isinstance(context, np.ndarray) and context.dtype == np.int32):
            context = _tokens(context)
        cfg = self.config
        return self._table.draft_one(req.slot, np.ascontiguousarray(context), k, min_prob, shadow_room, cfg.min_prob,
                                     cfg.match_factor, cfg.prior, cfg.max_depth)

    def _request(self, request_id: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request {request_id!r}")
        return req

    def _source_list(self, history: ProblemHistory) -> _Sources:
        """The sources a request of this problem drafts from (cached until they change: `_sources_changed`)."""
        cached = self._sources.get(history.problem_id)
        if cached is None:
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
            cached = self._sources[history.problem_id] = _Sources(indices, kinds, SourceList(indices, kinds))
        return cached

    def _request_sources(self, history: ProblemHistory, req: _Request) -> SourceList:
        """The native source list of a request: its problem's, plus its session's context and its key's latest
        sample where it has them. The key's sample comes first: the chooser takes the first of equally rated
        candidates, and before it has learnt the kinds, a draft of the same draw's earlier sample is the likelier."""
        sources = self._source_list(history)
        if req.context is None and req.same_key is None:
            return sources.native
        indices, kinds = list(sources.indices), list(sources.kinds)
        if req.context is not None:
            indices.append(req.context.segment.index)
            kinds.append(self.chooser.kind_index("context"))
        if req.same_key is not None:
            indices.insert(0, req.same_key.index)
            kinds.insert(0, self.chooser.kind_index("same-key"))
        return SourceList(indices, kinds)

    def _sources_changed(self, history: ProblemHistory) -> None:
        """A problem's sources changed: its running requests draft from the new list from now on (the old one,
        and the indexes only it holds, are freed once no request refers to it)."""
        self._sources.pop(history.problem_id, None)
        if history.running:
            sources = self._source_list(history).native
            for request_id in history.running:
                req = self._requests[request_id]
                self._table.set_sources(req.slot, sources if req.context is None and req.same_key is None
                                        else self._request_sources(history, req))

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
        for request_id in list(history.running):
            self._drop(request_id, self._requests.pop(request_id))
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
        history.drop_keyed(version - self.config.window)
        self._feed_global(segment)
        self._sources_changed(history)
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
            for history in self.problems.values():  # every problem gains the global source
                self._sources_changed(history)

    def _enforce_budget(self) -> None:
        while self.stored_tokens() > self.config.token_budget and self._seal_order:
            problem_id, version = self._seal_order.popleft()
            history = self.problems.get(problem_id)
            if history is not None and history.sealed.pop(version, None) is not None:
                history.drop_keyed(version)
                self._sources_changed(history)

    def add_rollouts(self, records: Iterable[RolloutRecord]) -> int:
        """Imports finished rollouts as sealed segments, grouped by (problem, policy version), and those with a
        `sample_key` as their key's latest sample (unless a newer one is held). Returns the count."""
        groups: dict[tuple[str, int], list[RolloutRecord]] = {}
        for rec in records:
            groups.setdefault((rec.problem_id, rec.policy_version), []).append(rec)
        for (problem_id, version), recs in sorted(groups.items(), key=lambda kv: kv[0][1]):
            history = self.problem(problem_id)
            segment = Segment.new(self.config.max_depth)
            for rec in sorted(recs, key=lambda r: r.sample_index):
                prompt, output = _tokens(rec.prompt_token_ids), _tokens(rec.output_token_ids)
                history.add_prompt(prompt)
                segment.add(output, sealed=True)
                kept = history.keyed.get(rec.sample_key) if rec.sample_key is not None else None
                if rec.sample_key is not None and len(output) and (kept is None or kept.version <= version):
                    history.keyed[rec.sample_key] = KeyedSample(
                        version, np.concatenate([prompt[-self.config.max_depth:], output]))
            self.install_sealed(history, version, segment)
        return sum(len(v) for v in groups.values())

    # ---- accounting ----

    def stored_tokens(self) -> int:
        """Tokens of every problem's history and the global index (what `token_budget` bounds); session contexts
        are bounded apart (`context_tokens`)."""
        return self._global.tokens + sum(h.tokens() for h in self.problems.values())

    @property
    def context_tokens(self) -> int:
        """Tokens of the session contexts held."""
        return self._context_tokens

    def memory_bytes(self) -> int:
        return (self._global.index.memory_bytes() + sum(h.memory_bytes() for h in self.problems.values())
                + sum(c.segment.index.memory_bytes() for c in self._contexts.values()))


def _token_table(table: np.ndarray) -> np.ndarray:
    """A 2-D int32 token table, read in place when it already is one (the engine's)."""
    if not (isinstance(table, np.ndarray) and table.dtype == np.int32 and table.ndim == 2):
        table = np.asarray(table, np.int32)
        if table.ndim != 2:
            raise ValueError(f"a token table has one row per request, got shape {table.shape}")
    return np.ascontiguousarray(table)


def _rows(rows: np.ndarray | None, n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int32) if rows is None else np.ascontiguousarray(rows, np.int32)


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
