"""The draft step the engine's proposer and the simulator share (scheduler/draft_step.py), and the simulator's
seams (scheduler/simulator.py: a batch's length signal and placement)."""

from __future__ import annotations

import numpy as np
import pytest

from das.drafter.history import DrafterConfig, HistoryBank
from das.drafter.records import RolloutRecord
from das.scheduler.acceptance import AcceptanceCounts
from das.scheduler.budget import DraftPlan, UniformPolicy
from das.scheduler.budget_hook import BatchView, PolicyBudget
from das.scheduler.cost_model import CostModel
from das.scheduler.draft_step import DraftStep
from das.scheduler.placement import round_robin
from das.scheduler.simulator import BatchSimulation, PredictedLengths, TrueLengths, simulate_batch

COST = CostModel("test", c_base_s=1.0, c_tok_s=0.001, source="test")
TEXT = np.array([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]], np.int32)


def _step(k: int = 4) -> DraftStep:
    bank = HistoryBank(DrafterConfig.for_drafts(k))
    bank.add_rollouts([RolloutRecord("p", 0, 0, (1, 2, 3), tuple(range(4, 13)), "stop")])
    return DraftStep(bank, PolicyBudget(UniformPolicy(k), k, COST, online=False, guard=False), AcceptanceCounts(k), k)


def _view(n: int = 1) -> BatchView:
    return BatchView(np.zeros(n, np.int64), np.full(n, 9.0), np.full(n, 100), np.full(n, np.nan))


def test_drafts_are_capped_by_the_room_and_settled_into_the_acceptance_counts():
    step = _step()
    slot = np.array([step.acceptance.start("r")])
    bank_slot = np.array([step.bank.start_request("r", "p", TEXT[0, :3], 1)], np.int32)
    drafts, plan = step.draft(slot, bank_slot, _view(), TEXT, np.array([4]), draft_room=np.array([2]))
    assert plan.lengths.tolist() == [4]  # the budget's K ...
    assert drafts.lists() == [[5, 6]]  # ... cut to the request's room, from the history the bank holds
    settled = step.settle(slot, bank_slot, TEXT, np.array([4]), np.array([7]))  # 5, 6 accepted, then 7
    assert (settled.drafted, settled.accepted, settled.verified.tolist()) == (2, 2, [0])
    assert step.acceptance.params(slot).acceptance[0, 0] > step.acceptance.params(slot).acceptance[0, 3]


def test_a_verifier_that_knows_the_accepted_tokens_overrides_the_banks_count():
    step = _step()
    slot = np.array([step.acceptance.start("r")])
    bank_slot = np.array([step.bank.start_request("r", "p", TEXT[0, :3], 1)], np.int32)
    step.draft(slot, bank_slot, _view(), TEXT, np.array([4]), draft_room=np.array([4]))
    # the sample ends on the draft's last token: the bank takes that one for the verifier's own token
    settled = step.settle(slot, bank_slot, TEXT, np.array([4]), np.array([8]), verified_accepted=np.array([4]))
    assert settled.accepted == 4 and settled.commit.accepted.tolist() == [3]


class _PricedHook:
    """A budget hook whose plan lets every draft token through and prices the step: an accepted token saves
    `value` seconds, a drafted step costs `step_s` more."""

    name, reads_acceptance = "priced", False

    def __init__(self, value: float, step_s: float) -> None:
        self.value, self.step_s = value, step_s

    def plan(self, batch, drafter=None):
        n = len(batch)
        return DraftPlan(np.full(n, 4, np.int32), np.zeros(n), value=np.full(n, self.value), token_s=0.0,
                         step_s=self.step_s)


def test_a_step_whose_drafts_do_not_pay_its_fixed_price_verifies_none_and_shadows_them():
    def run(step_s: float):
        bank = HistoryBank(DrafterConfig.for_drafts(4))
        bank.add_rollouts([RolloutRecord("p", 0, 0, (1, 2, 3), tuple(range(4, 13)), "stop")])
        step = DraftStep(bank, _PricedHook(1.0, step_s), AcceptanceCounts(4), 4)
        slot = np.array([step.acceptance.start("r")])
        bank_slot = np.array([step.bank.start_request("r", "p", TEXT[0, :3], 1)], np.int32)
        drafts, plan = step.draft(slot, bank_slot, _view(), TEXT, np.array([4]), draft_room=np.array([4]))
        settled = step.settle(slot, bank_slot, TEXT, np.array([4]), np.array([5]))
        return drafts, plan, settled

    # the history's continuation, 4 tokens of which each may save a second: worth a step that costs 0.01 s more
    drafts, plan, settled = run(0.01)
    assert drafts.lists() == [[5, 6, 7, 8]] and plan.lengths.tolist() == [4] and settled.drafted == 4
    # the same drafts cannot save the 100 s a drafted step would cost: none verified, a shadow draft measures them
    dear, plan, settled = run(100.0)
    assert dear.lists() == [[]] and dear.shadowed.tolist() == [True]
    assert plan.lengths.tolist() == [0] and settled.drafted == 0


def test_no_room_means_no_draft_and_no_shadow_draft():
    step = _step()
    slot = np.array([step.acceptance.start("r")])
    bank_slot = np.array([step.bank.start_request("r", "p", TEXT[0, :3], 1)], np.int32)
    drafts, _ = step.draft(slot, bank_slot, _view(), TEXT, np.array([4]), draft_room=np.array([0]))
    assert drafts.lists() == [[]] and not drafts.shadowed.any()


def _batch(version: int, lengths: dict[str, int]) -> list[RolloutRecord]:
    return [RolloutRecord(p, version, i, (1, 2), tuple(range(10, 10 + n)), "stop")
            for p, n in lengths.items() for i in (0, 1)]


def test_the_simulator_drafts_through_the_shared_step(monkeypatch):
    calls = {"draft": 0, "settle": 0}
    for name in calls:
        original = getattr(DraftStep, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(DraftStep, name, counted)
    history, batch = _batch(0, {"p": 20, "q": 20}), _batch(1, {"p": 20, "q": 20})
    out = simulate_batch(batch, history, COST, 2, UniformPolicy(4), "length-aware", 4)
    assert calls["draft"] == calls["settle"] > 0
    assert out[4] > 0  # the drafts from the earlier version's identical text were accepted


def test_the_length_signal_and_placement_are_seams():
    history, batch = _batch(0, {"p": 5, "q": 5, "r": 5}), _batch(1, {"p": 9, "q": 1, "r": 1})

    class Recording(TrueLengths):
        def __init__(self) -> None:
            super().__init__(batch)
            self.ended: list[int] = []

        def finished(self, rows: np.ndarray) -> None:
            self.ended.extend(rows.tolist())

    signal = Recording()
    oracle = BatchSimulation(batch, history, COST, 2, None, 4, signal=signal).run()
    assert sorted(signal.ended) == list(range(len(batch)))  # every request ends once
    assert oracle == BatchSimulation(batch, history, COST, 2, None, 4, signal=TrueLengths(batch)).run()
    assert oracle.makespan_s == pytest.approx(simulate_batch(batch, history, COST, 2, None, "length-aware", 4,
                                                             oracle_lengths=True)[0])
    # by the prediction every problem looks alike; round robin then puts p with q, and p's 9 tokens with a sibling
    predicted = BatchSimulation(batch, history, COST, 2, None, 4, signal=PredictedLengths(batch, history),
                                place=round_robin).run()
    assert predicted.makespan_s >= oracle.makespan_s
