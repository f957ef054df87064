"""DasProposer against a stand-in for vLLM's model runner: the same calls vLLM makes, without an engine (the
engine tests in tests/service/engine/vllm/test_engine.py run it inside real vLLM)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

from das.drafter.records import RolloutRecord
from das.scheduler.budget import DraftPlan
from das.scheduler.draft_step import DraftStep
from das.scheduler.length import LengthCurve
from das.service.engine.vllm.extra_args import SAMPLE_KEY, RequestTags
from das.service.engine.vllm.proposer import DasProposer
from tests.service.engine.vllm.proposer_setup import PROMPT, RESPONSE, make_proposer


class FakeRunner:
    """The parts of vLLM's GPUModelRunner the proposer reads: input_batch.req_ids and requests[rid]."""

    def __init__(self, width: int = 64) -> None:
        self.input_batch = SimpleNamespace(req_ids=[])
        self.requests: dict[str, SimpleNamespace] = {}
        self.tokens: dict[str, list[int]] = {}
        self.width = width

    def add(self, rid: str, prompt: list[int], max_tokens: int = 32, tags: RequestTags | None = None,
            sample_key: int | None = None) -> None:
        extra = {**(tags.to_extra_args() if tags else {}), **({SAMPLE_KEY: sample_key} if sample_key is not None
                                                              else {})}
        params = SimpleNamespace(max_tokens=max_tokens, extra_args=extra or None)
        self.requests[rid] = SimpleNamespace(prompt_token_ids=list(prompt), sampling_params=params)
        self.tokens[rid] = list(prompt)
        self.input_batch.req_ids.append(rid)

    def remove(self, rid: str) -> None:
        self.input_batch.req_ids.remove(rid)
        del self.requests[rid], self.tokens[rid]

    def step(self, proposer: DasProposer, committed: dict[str, list[int]]) -> dict[str, list[int]]:
        """Commits tokens, then calls propose the way vLLM does (rows in input-batch order)."""
        for rid, toks in committed.items():
            self.tokens[rid].extend(toks)
        rows = self.input_batch.req_ids
        table = np.zeros((len(rows), self.width), np.int32)
        counts = np.zeros(len(rows), np.int32)
        for i, rid in enumerate(rows):
            table[i, :len(self.tokens[rid])] = self.tokens[rid]
            counts[i] = len(self.tokens[rid])
        drafts = proposer.propose([committed.get(rid, []) for rid in rows], counts, table)
        return dict(zip(rows, drafts))


def attached(**kwargs) -> tuple[DasProposer, FakeRunner]:
    proposer, runner = make_proposer(**kwargs), FakeRunner()
    proposer.attach(runner)
    return proposer, runner


def run_sample(proposer: DasProposer, runner: FakeRunner, rid: str, tags: RequestTags,
               response: list[int], sample_key: int | None = None) -> dict[str, list[int]]:
    """Decodes `response` one verified step at a time: each step commits the accepted draft prefix plus one."""
    runner.add(rid, PROMPT, tags=tags, sample_key=sample_key)
    drafts = runner.step(proposer, {})
    pos = 0
    while pos < len(response):
        draft = drafts[rid]
        accepted = 0
        while accepted < len(draft) and pos + accepted < len(response) - 1 \
                and draft[accepted] == response[pos + accepted]:
            accepted += 1
        commit = response[pos:pos + accepted + 1]
        pos += len(commit)
        drafts = runner.step(proposer, {rid: commit})
    runner.remove(rid)
    return drafts


def test_without_the_runner_it_proposes_nothing():
    proposer = make_proposer()
    assert proposer.propose([[1], [2]], np.array([3, 3]), np.zeros((2, 8), np.int32)) == [[], []]


@pytest.mark.parametrize("budget, least_accepted", [
    # K_i from counts: a draft of up to 4 tokens per step, all right: 12 tokens in ceil(12 / 5) + a few steps
    ({"confidence": False}, 8),
    # the default: a cold calibrator rates a continuation seen once at 1/3 a token, so 1-3 tokens a step at first,
    # and a step verifies them only where they pay the generic prior's drafted-step price (half a step)
    ({}, 4)])
def test_a_second_sample_of_a_problem_drafts_the_first_and_counts_what_was_accepted(budget, least_accepted):
    proposer, runner = attached(budget=budget)
    run_sample(proposer, runner, "a", RequestTags("p", key="a"), RESPONSE)
    first = proposer.pop_counts(["a"])["a"]
    run_sample(proposer, runner, "b", RequestTags("p", key="b"), RESPONSE)
    second = proposer.pop_counts(["b"])["b"]
    assert first.accepted == 0
    assert second.accepted >= least_accepted and second.proposed >= second.accepted
    assert second.steps < first.steps
    assert proposer.pop_counts(["b"]) == {}  # returned once


def test_a_probe_tagged_not_to_draft_decodes_plainly_beside_a_sibling_that_drafts():
    proposer, runner = attached()
    run_sample(proposer, runner, "a", RequestTags("p", key="a"), RESPONSE)
    run_sample(proposer, runner, "probe", RequestTags("p", key="probe", draft=False), RESPONSE)
    probe = proposer.pop_counts(["probe"])["probe"]
    assert probe.proposed == 0 and probe.accepted == 0 and probe.steps > 0
    run_sample(proposer, runner, "b", RequestTags("p", key="b"), RESPONSE)
    assert proposer.pop_counts(["b"])["b"].accepted >= 8  # the same history drafts for an ordinary sample
    tags = RequestTags("p", key="probe", draft=False)
    assert RequestTags.from_extra_args(tags.to_extra_args(), PROMPT) == tags


def test_cost_probes_verify_a_junk_draft_every_other_step_that_only_the_cost_fit_sees():
    """Two cost probes and an ordinary sample: on alternate steps the first probe with room drafts its last token
    again; the steps reach the budget marked as probe steps with that draft counted, and no acceptance estimate,
    draft count or source count sees it."""
    proposer, runner = attached()
    seen = []
    proposer.budget.observe = seen.append
    probe = RequestTags("warm", key="p1", draft=False, cost_probe=True)
    assert RequestTags.from_extra_args(probe.to_extra_args(), PROMPT) == probe
    runner.add("p1", PROMPT, max_tokens=5, tags=probe)
    runner.add("p2", PROMPT, max_tokens=6, tags=RequestTags("warm", key="p2", draft=False, cost_probe=True))
    runner.add("s", PROMPT, tags=RequestTags("other", key="s"))
    drafts = runner.step(proposer, {})
    history = []
    for token in range(30, 35):
        history.append(drafts)
        drafts = runner.step(proposer, {rid: [token] for rid in ("p1", "p2", "s")})
    probe_drafts = [[d[rid] for rid in ("p1", "p2")] for d in history]
    assert probe_drafts[0] == [[PROMPT[-1]], []] and probe_drafts[1] == [[], []]
    assert probe_drafts[2] == [[31], []] and probe_drafts[3] == [[], []]
    assert probe_drafts[4] == [[], [33]]  # p1 has one token of room left, too little to verify a draft: p2 drafts
    steps = [(step.drafted, step.probe) for step in seen]
    assert steps == [(1, True), (0, False), (1, True), (0, False), (1, True)]
    assert proposer.acceptance.params(np.array([0, 1, 2])).measured == 0
    counts = proposer.pop_counts(["p1", "p2"])
    assert all(c.proposed == 0 for c in counts.values()) and proposer.by_source == {}


def test_accepted_tokens_of_explorations_drafts_reach_the_budget_as_such():
    """A sample whose problem's history holds its continuation: drafts the plan marks as exploration come back as
    `explored_accepted` (refunded to the exploration credit), the same drafts planned by the optimum do not."""
    for explored in (True, False):
        proposer, runner = attached()
        proposer.bank.add_rollouts([RolloutRecord("p", 0, 0, tuple(PROMPT), tuple(RESPONSE))])
        seen = []
        proposer.budget.observe = seen.append
        proposer.budget.plan = lambda views, drafter=None, explored=explored: DraftPlan(
            np.full(len(views), 2, np.int32), np.zeros(len(views)), np.full(len(views), explored))
        run_sample(proposer, runner, "r", RequestTags("p", key="r"), RESPONSE)
        accepted = [step.accepted for step in seen]
        assert sum(accepted) > 0
        assert [step.explored_accepted for step in seen] == (accepted if explored else [0] * len(seen))


def test_counts_are_claimed_by_the_callers_key_while_still_registered():
    proposer, runner = attached()
    runner.add("internal-1", PROMPT, tags=RequestTags("p", key="mine"))
    runner.step(proposer, {})
    runner.step(proposer, {"internal-1": [10]})
    counts = proposer.pop_counts(["mine"])
    assert counts["mine"].steps == 1
    assert "internal-1" not in proposer._running  # finished in the bank too


def test_requests_that_leave_the_runner_are_finished_and_preempted_ones_kept():
    proposer, runner = attached()
    runner.add("x", PROMPT, tags=RequestTags("p", key="x"))
    runner.add("y", PROMPT, tags=RequestTags("p", key="y"))
    runner.step(proposer, {})
    runner.input_batch.req_ids.remove("y")   # preempted: out of the batch, still in runner.requests
    runner.remove("x")                         # finished
    runner.step(proposer, {})
    assert set(proposer._running) == {"y"}
    assert "x" in proposer.pop_counts(["x"])


def test_drafts_stay_inside_the_vocabulary_the_room_and_k_max():
    # a drafted step priced like a plain one, so that a single draft token is worth verifying
    proposer, runner = attached(k=8, vocab=15, budget={"c_base_s": 20e-3, "c_tok_s": 0.5e-3})
    # imported history with ids the model does not have (>= 15) after a few valid ones
    proposer.bank.add_rollouts([RolloutRecord("p", 0, 0, tuple(PROMPT), (10, 11, 12, 40, 41, 42))])
    runner.add("r", PROMPT, max_tokens=3, tags=RequestTags("p", key="r"))
    drafts = runner.step(proposer, {})
    drafts = runner.step(proposer, {"r": [10]})
    assert drafts["r"] == [11]  # room: 3 - 1 generated - 1 (the verified step's own token) = 1
    runner.remove("r")
    runner.add("s", PROMPT, max_tokens=30, tags=RequestTags("p", key="s"))
    runner.step(proposer, {})
    drafts = runner.step(proposer, {"s": [10]})
    assert drafts["s"] == [11, 12]  # stops before the first id outside the vocabulary


def test_uniform_budget_setting_limits_the_draft_length():
    proposer, runner = attached(k=8, budget={"policy": "uniform", "k": 2})
    run_sample(proposer, runner, "a", RequestTags("p", key="a"), RESPONSE)
    runner.add("b", PROMPT, tags=RequestTags("p", key="b"))
    runner.step(proposer, {})
    assert len(runner.step(proposer, {"b": [10]})["b"]) == 2


def test_a_drafter_failure_costs_the_step_its_drafts_not_the_engine(monkeypatch):
    proposer, runner = attached()
    run_sample(proposer, runner, "a", RequestTags("p", key="a"), RESPONSE)
    runner.add("b", PROMPT, tags=RequestTags("p", key="b"))

    def broken(*args, **kwargs):
        raise RuntimeError("index corrupted")

    monkeypatch.setattr(proposer.bank, "draft_step", broken)
    assert runner.step(proposer, {}) == {"b": []}
    assert proposer.stats()["failures"] == 1


def test_policy_versions_only_move_forward_and_seal_the_live_history():
    proposer, runner = attached()
    run_sample(proposer, runner, "a", RequestTags("p", key="a"), RESPONSE)
    assert proposer.bank.problems["p"].live is not None
    proposer.set_policy_version(1)
    history = proposer.bank.problems["p"]
    assert history.live is None and 0 in history.sealed
    with pytest.raises(ValueError, match="older"):
        proposer.set_policy_version(0)


def test_untagged_requests_share_history_by_prompt():
    tags_a = RequestTags.from_extra_args(None, PROMPT)
    tags_b = RequestTags.from_extra_args({"das": {}}, PROMPT)
    assert tags_a.problem_id == tags_b.problem_id != RequestTags.from_extra_args(None, [1]).problem_id
    tags = RequestTags("q", key="k", sample_index=3, predicted_tokens=120.0)
    assert RequestTags.from_extra_args(tags.to_extra_args(), PROMPT) == tags
    curved = RequestTags("q", key="k", predicted_tokens=120.0,
                         length_curve=LengthCurve((0, 50), (90.0, 130.0), 200, 1.0))
    assert RequestTags.from_extra_args(curved.to_extra_args(), PROMPT) == curved


def test_a_malformed_length_curve_is_dropped_not_fatal(caplog):
    raw = RequestTags("q", key="k", predicted_tokens=120.0).to_extra_args()
    raw["das"]["length_curve"] = {"starts": [3], "ends": [1.0], "tail_from": 0, "tail_ratio": 1.0}
    with caplog.at_level("WARNING"):
        tags = RequestTags.from_extra_args(raw, PROMPT)
    assert tags == RequestTags("q", key="k", predicted_tokens=120.0) and "length curve ignored" in caplog.text


def test_stats_report_the_per_step_cost():
    proposer, runner = attached()
    run_sample(proposer, runner, "a", RequestTags("p", key="a"), RESPONSE)
    stats = proposer.stats()
    assert stats["steps"] > 5 and 0 < stats["step_us_p50"] <= stats["step_us_p99"]
    assert stats["stored_tokens"] > 0


def test_drafts_are_counted_by_source_kind():
    proposer, runner = attached()
    for key in ("a", "b"):  # the second sample of the problem drafts from the first
        run_sample(proposer, runner, key, RequestTags("p", key=key), RESPONSE)
    per_request = proposer.pop_counts(["a", "b"])
    by_source = proposer.stats()["by_source"]
    assert by_source and all(kind in {"live", "prompt", "global"} or re.fullmatch(r"sealed-age-[1-4]", kind)
                             for kind in by_source)
    assert sum(c["proposed"] for c in by_source.values()) == sum(c.proposed for c in per_request.values()) > 0
    assert sum(c["accepted"] for c in by_source.values()) == sum(c.accepted for c in per_request.values()) > 0


def test_drafts_from_an_earlier_policy_are_counted_by_its_age():
    proposer, runner = attached()
    run_sample(proposer, runner, "a", RequestTags("p", key="a"), RESPONSE)
    proposer.set_policy_version(1)  # seals "a" as version 0: one version back from what now samples
    before = proposer.stats()["by_source"].get("sealed-age-1", {"accepted": 0})["accepted"]
    run_sample(proposer, runner, "b", RequestTags("p", key="b"), RESPONSE)
    assert proposer.stats()["by_source"]["sealed-age-1"]["accepted"] > before
    assert not any(kind == "sealed" for kind in proposer.stats()["by_source"])


def test_measured_acceptance_by_position_is_recorded_per_request_and_pooled():
    proposer, runner = attached(k=4)
    run_sample(proposer, runner, "a", RequestTags("p", key="a"), RESPONSE)
    run_sample(proposer, runner, "b", RequestTags("p", key="b"), RESPONSE)
    counts = proposer.pop_counts(["b"])["b"]
    pooled, shadow = proposer.acceptance, proposer.stats()["shadow"]
    # every proposed position of b's drafts, and of the shadow drafts of steps it drafted nothing, was checked;
    # position 1 is counted once per draft
    assert pooled.pool_proposed.sum() == counts.proposed + shadow["proposed"]
    assert pooled.pool_accepted.sum() == counts.accepted + shadow["accepted"]
    assert pooled.pool_accepted[0] > 0 and np.all(np.diff(pooled.pool_accepted) <= 0)


def test_a_request_without_drafts_is_measured_by_shadow_drafts_vllm_never_sees():
    """The plan drafts nothing; the sample's continuation is in its problem's history. Its shadow drafts (up to
    K_max tokens, settled over the next plain steps) are all right, and their outcomes reach the acceptance
    counts the budget reads (das-lengths: the confidence plan reads none), per request and pooled, while every draft
    handed to vLLM is empty."""
    proposer, runner = attached(k=4, drafter={"shadow_gap": 0}, budget={"confidence": False})
    proposer.bank.add_rollouts([RolloutRecord("p", 0, 0, tuple(PROMPT), tuple(RESPONSE))])
    plans = []

    def plan_nothing(views, drafter=None):
        plans.append(drafter)
        return DraftPlan(np.zeros(len(views), np.int32), np.zeros(len(views)))

    proposer.budget.plan = plan_nothing
    runner.add("r", PROMPT, tags=RequestTags("p", key="r"))
    drafts = [runner.step(proposer, {})["r"]]
    for token in RESPONSE[:9]:
        drafts.append(runner.step(proposer, {"r": [token]})["r"])
    assert all(d == [] for d in drafts)
    shadow = proposer.stats()["shadow"]
    assert shadow["drafts"] == 2 and shadow["proposed"] == shadow["accepted"] == 8  # two drafts of 4, all right
    measured = plans[-1].acceptance[0]
    assert measured[3] > plans[1].acceptance[0][3]  # the fourth position, never verified, is now trusted more
    assert proposer.acceptance.pool_accepted.tolist() == [2, 2, 2, 2]
    assert proposer.pop_counts(["r"])["r"].proposed == 0  # nothing was proposed to the engine


def test_the_das_floor_cuts_drafts_the_drafter_itself_doubts(monkeypatch):
    """The length-aware plan gives a probability floor; the proposer drafts only the tokens whose estimated
    probability is at or above it."""
    proposer, runner = attached(k=8, budget={"policy": "das", "c_base_s": 44e-3, "c_tok_s": 0.49e-3,
                                             "per_token": True})
    proposer.bank.add_rollouts([RolloutRecord("p", 0, 0, tuple(PROMPT), tuple(RESPONSE))])
    runner.add("r", PROMPT, tags=RequestTags("p", key="r"))
    runner.step(proposer, {})
    real_plan = proposer.budget.plan

    def floor_at(value: float):
        def plan(views, drafter=None):
            p = real_plan(views, drafter)
            return type(p)(np.full(len(views), 8, np.int32), np.full(len(views), value))
        return plan

    probs = proposer.bank.propose("r", np.asarray(PROMPT + [10], np.int32), 8).probs
    assert np.all(np.diff(probs) <= 0) and probs[0] > probs[-1]  # cumulative: falls along the draft
    # keeps exactly the first three tokens: a floor between the third's and the fourth's probability (probs are
    # float32 copies of the walk's float64 products, so a floor equal to one of them sits on a rounding edge)
    floor = float(probs[2] + probs[3]) / 2
    monkeypatch.setattr(proposer.budget, "plan", floor_at(floor))
    drafts = runner.step(proposer, {"r": [10]})
    assert drafts["r"] == RESPONSE[1:1 + int(np.sum(probs >= floor))]
    monkeypatch.setattr(proposer.budget, "plan", floor_at(np.inf))
    assert runner.step(proposer, {"r": [11]})["r"] == []


def test_the_budget_sees_every_requests_curve_prediction_and_cap_as_requests_come_go_and_reuse_slots():
    proposer, runner = attached(k=4, max_model_len=512)
    seen = []
    plan = proposer.budget.plan

    def recording(view, drafter=None):
        seen.append(view)
        return plan(view, drafter)
    proposer.budget.plan = recording
    curve_a = LengthCurve((0, 3), (5.0, 40.0), 20, 0.5)
    curve_c = LengthCurve((0,), (9.0,), 6, 1.0)
    runner.add("a", PROMPT, max_tokens=100, tags=RequestTags("p", key="a", length_curve=curve_a))
    runner.add("b", PROMPT, max_tokens=50, tags=RequestTags("p", key="b", predicted_tokens=40.0))
    expected = {"a": (curve_a, np.nan, 100), "b": (None, 40.0, 50)}
    runner.step(proposer, {})
    for step in range(30):
        previous = list(runner.input_batch.req_ids)  # each commits one token a step from its second step on
        if step == 4:
            runner.remove("b")  # b leaves; c arrives a step later and takes its slot
            del expected["b"]
        if step == 5:
            runner.add("c", PROMPT, max_tokens=60, tags=RequestTags("p", key="c", length_curve=curve_c))
            expected["c"] = (curve_c, np.nan, 60)
        if step == 12:  # c leaves and d arrives in the same step: a batch of the same size, other requests
            runner.remove("c")
            del expected["c"]
            runner.add("d", PROMPT, max_tokens=70, tags=RequestTags("p", key="d", predicted_tokens=33.0))
            expected["d"] = (None, 33.0, 70)
        runner.step(proposer, {rid: [10] for rid in previous if rid in runner.requests})
        view = seen[-1]
        rows = runner.input_batch.req_ids
        generated = [len(runner.tokens[rid]) - len(PROMPT) for rid in rows]
        assert view.generated.tolist() == generated
        want_final = [np.nan if expected[r][0] is None else expected[r][0].at(g) for r, g in zip(rows, generated)]
        np.testing.assert_array_equal(view.curve_final, want_final)
        np.testing.assert_array_equal(view.predicted_tokens, [expected[r][1] for r in rows])
        assert view.max_tokens.tolist() == [expected[r][2] for r in rows]
    counts = proposer.pop_counts(["a", "b", "c", "d"])
    assert [counts[key].steps for key in "abcd"] == [30, 4, 6, 17]


def test_the_proposers_index_depth_follows_its_draft_length_unless_configured():
    assert make_proposer(k=8).bank.config.max_depth == 16
    assert make_proposer(k=16).bank.config.max_depth == 24
    assert make_proposer(k=8, drafter={"max_depth": 32}).bank.config.max_depth == 32


def test_exploration_gets_its_accepted_tokens_back_on_a_step_the_cost_fit_skips():
    """A new request arriving makes the step a prefill step: the fit and the guard skip it, but the explored draft
    verified in it still refunds its accepted tokens."""
    proposer, runner = attached()
    proposer.bank.add_rollouts([RolloutRecord("p", 0, 0, tuple(PROMPT), tuple(RESPONSE))])
    observed, refunded = [], []
    proposer.budget.observe = observed.append
    proposer.budget.refund = lambda accepted, requests: refunded.append((accepted, requests))
    proposer.budget.plan = lambda views, drafter=None: DraftPlan(
        np.full(len(views), 2, np.int32), np.zeros(len(views)), np.ones(len(views), bool))
    runner.add("r", PROMPT, tags=RequestTags("p", key="r"))
    drafts = runner.step(proposer, {})
    drafts = runner.step(proposer, {"r": [RESPONSE[0]]})
    assert drafts["r"] == RESPONSE[1:3]
    before = len(observed)
    runner.add("s", PROMPT, tags=RequestTags("q", key="s"))  # arrives: this step prefills it
    runner.step(proposer, {"r": RESPONSE[1:4]})  # both draft tokens accepted, then the bonus token
    assert len(observed) == before  # not a decode step of its shape
    assert refunded[-1] == (2, 2)


def test_a_resumed_samples_delivered_tokens_count_as_its_output_not_its_prompt():
    proposer, runner = attached()
    runner.add("r", PROMPT + RESPONSE[:6], max_tokens=20, tags=RequestTags("p", key="r", resumed_tokens=6))
    runner.step(proposer, {})
    slot = proposer._running["r"].slot
    cols = proposer._columns
    assert cols.prompt_len[slot] == len(PROMPT)  # the prompt proper
    assert cols.max_tokens[slot] == 26  # the request's 20 plus the 6 delivered: the sample's own cap
    assert cols.fed[slot] == len(PROMPT) + 6  # the delivered tokens went to the live segment as output
    plain, plain_runner = attached()
    plain_runner.add("q", PROMPT + RESPONSE[:6], max_tokens=20, tags=RequestTags("p", key="q"))
    plain_runner.step(plain, {})
    assert plain._columns.prompt_len[plain._running["q"].slot] == len(PROMPT) + 6  # without the tag: all prompt


def test_a_sessions_turn_drafts_its_tool_output_from_the_sessions_context():
    tags = RequestTags("q", key="k", session_id="traj")
    assert RequestTags.from_extra_args(tags.to_extra_args(), PROMPT) == tags
    proposer, runner = attached(budget={"policy": "uniform"})
    tool = [60, 61, 62, 63, 64, 65, 66, 67]
    runner.add("turn2", [*PROMPT, 9, *tool], tags=RequestTags("q", key="turn2", session_id="traj"))
    runner.step(proposer, {})
    drafts = runner.step(proposer, {"turn2": [60, 61]})  # the model starts re-emitting the tool's output
    assert drafts["turn2"] and drafts["turn2"] == tool[2:2 + len(drafts["turn2"])]
    assert proposer.bank.context_tokens == len(PROMPT) + 1 + len(tool)


def test_the_proposer_drafts_through_the_step_the_simulator_runs():
    """One draft step for the engine and for `das bench simulate` (scheduler/draft_step.py), over the proposer's own
    bank, budget hook and acceptance counts."""
    proposer = make_proposer()
    assert isinstance(proposer.step, DraftStep)
    assert (proposer.step.bank, proposer.step.budget, proposer.step.acceptance) == \
        (proposer.bank, proposer.budget, proposer.acceptance)


def test_an_oracle_request_drafts_its_recorded_future_through_the_budget_and_has_it_all_accepted():
    proposer, runner = attached(budget={"policy": "uniform"})
    tags = RequestTags("p", key="o", oracle=tuple(RESPONSE))
    assert RequestTags.from_extra_args(tags.to_extra_args(), PROMPT) == tags
    runner.add("o", PROMPT, tags=tags)
    drafts = runner.step(proposer, {})
    seen = []
    pos = 0
    while pos < len(RESPONSE):
        draft = drafts["o"]
        seen.append(draft)
        assert draft == RESPONSE[pos:pos + 4]  # the next K = 4 recorded tokens, none past the end
        commit = RESPONSE[pos:pos + len(draft) + 1]
        pos += len(commit)
        drafts = runner.step(proposer, {"o": commit})
    assert seen[0] == RESPONSE[:4] and seen[-1] == RESPONSE[10:]  # the last draft is cut at the recorded end
    runner.remove("o")
    runner.step(proposer, {})
    counts = proposer.pop_counts(["o"])["o"]
    # every draft token accepted but a draft's last token at the sample's end (the bank's rule: the last committed
    # token is the verifier's own)
    assert counts.proposed == sum(len(d) for d in seen) and counts.accepted >= counts.proposed - 1
    assert counts.steps == 3  # 12 tokens at 5 a step
    assert proposer.stats()["oracle"] == {"proposed": counts.proposed, "accepted": counts.accepted}
    assert proposer.stats()["by_source"] == {}  # the history bank drafted nothing for it


def test_an_oracle_request_beside_a_plain_one_leaves_the_plain_ones_drafts_to_the_bank():
    proposer, runner = attached(budget={"policy": "uniform"})
    run_sample(proposer, runner, "a", RequestTags("p", key="a"), RESPONSE)  # history for problem p
    runner.add("b", PROMPT, tags=RequestTags("p", key="b"))
    runner.add("o", PROMPT, tags=RequestTags("q", key="o", oracle=(90, 91, 92)))
    assert runner.step(proposer, {})["o"] == [90, 91, 92]
    drafts = runner.step(proposer, {"b": RESPONSE[:1], "o": [90]})
    assert drafts == {"b": RESPONSE[1:5], "o": [91, 92]}


def test_a_sample_drafts_from_its_keys_sample_of_the_previous_visit():
    proposer, runner = attached(budget={"policy": "uniform"})
    other = [10, 11, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39]  # the problem's history holds two continuations
    run_sample(proposer, runner, "a", RequestTags("p", key="a"), RESPONSE, sample_key=-5)
    run_sample(proposer, runner, "b", RequestTags("p", key="b"), other, sample_key=6)
    proposer.set_policy_version(1)
    before = proposer.by_source.get("same-key")
    run_sample(proposer, runner, "a2", RequestTags("p", key="a2"), RESPONSE, sample_key=-5)
    run_sample(proposer, runner, "b2", RequestTags("p", key="b2"), other, sample_key=6)
    counts = proposer.by_source["same-key"]
    assert before is None and counts.accepted >= 4 and counts.accepted >= 0.8 * counts.proposed
    unkeyed, unkeyed_runner = attached(budget={"policy": "uniform"})
    run_sample(unkeyed, unkeyed_runner, "a", RequestTags("p", key="a"), RESPONSE)
    unkeyed.set_policy_version(1)
    run_sample(unkeyed, unkeyed_runner, "a2", RequestTags("p", key="a2"), RESPONSE)
    assert "same-key" not in unkeyed.by_source
