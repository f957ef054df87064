"""The makespan simulator: bookkeeping against hand-computable cases, and the CLI's labelled output."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from das.service.cli import program
from das.drafter.history import StepDrafts, accepted_prefix
from das.drafter.records import RolloutRecord, write_rollouts
from das.scheduler.cost_model import CostModel
from das.scheduler.simulator import _accepted_prefixes, simulate

app = program()

FLAT = CostModel(name="flat", c_base_s=1.0, c_tok_s=0.0, source="test")


def records(lengths_by_version: dict[int, list[int]], problem: str = "p") -> list[RolloutRecord]:
    out = []
    for v, lengths in lengths_by_version.items():
        for i, n in enumerate(lengths):
            out.append(RolloutRecord(problem_id=f"{problem}{i % 2}", policy_version=v, sample_index=i,
                                     prompt_token_ids=(1, 2), output_token_ids=tuple(range(10, 10 + n))))
    return out


def test_no_speculation_makespan_is_the_longest_sample():
    recs = records({0: [5, 5, 5, 5], 1: [3, 9, 4, 2]})
    r = simulate(recs, FLAT, engines=2, policy_name="none")
    assert r.makespan_s == pytest.approx(9.0)  # one pass per token, a pass costs 1 s (prompts priced as c_tok = 0)
    # the first token of each sample is sampled by its prefill step, the rest are decoded
    assert r.tokens_verified == 2 + 8 + 3 + 1 and r.accepted_tokens == 0
    assert r.forward_passes >= 9


def test_every_group_alone_bounds_every_placement():
    """Problems p0 (samples 0, 2: 3 and 4 tokens) and p1 (samples 1, 3: 9 and 2 tokens), each on its own engine;
    with a per-token cost, steps shared with fewer requests are cheaper, so no placement on fewer engines beats
    it without drafting."""
    recs = records({0: [5, 5, 5, 5], 1: [3, 9, 4, 2]})
    per_token = CostModel(name="t", c_base_s=1.0, c_tok_s=0.5, source="test")
    alone = simulate(recs, per_token, engines=1, policy_name="none", engine_per_group=True)
    assert alone.tokens_verified == 2 + 8 + 3 + 1 and alone.forward_passes == 9 + 4
    # p1: its two prompts (2 tokens each at c_tok) in one step, two requests decoding for one step, then one
    assert alone.makespan_s == pytest.approx(3.0 + 2.0 + 7 * 1.5)
    for engines in (1, 2, 4):
        for placement in ("length-aware", "round-robin"):
            assert simulate(recs, per_token, engines, "none", placement).makespan_s >= alone.makespan_s


def test_oracle_lengths_place_by_the_true_lengths():
    """History says every problem writes 5 tokens; in the batch p0 writes 9 per sample, p1 and p2 write 1. Placed
    by the true lengths (LPT), p0 gets an engine to itself; placed by the prediction (all equal), p0 shares one."""
    def batch(version: int, lengths: dict[str, int]) -> list[RolloutRecord]:
        return [RolloutRecord(problem_id=p, policy_version=version, sample_index=i, prompt_token_ids=(1, 2),
                              output_token_ids=tuple(range(10, 10 + n))) for p, n in lengths.items() for i in (0, 1)]
    recs = batch(0, {"p0": 5, "p1": 5, "p2": 5}) + batch(1, {"p0": 9, "p1": 1, "p2": 1})
    per_token = CostModel(name="t", c_base_s=1.0, c_tok_s=0.5, source="test")
    oracle = simulate(recs, per_token, engines=2, policy_name="none", oracle_lengths=True)
    predicted = simulate(recs, per_token, engines=2, policy_name="none")
    assert oracle.makespan_s == pytest.approx(3.0 + 8 * 2.0)  # p0's two samples alone: prefill step, 8 decodes
    assert predicted.makespan_s == pytest.approx(5.0 + 8 * 2.0)  # p0 shares its prefill step with one group


def test_repeated_text_is_drafted_and_shortens_the_makespan():
    recs = records({0: [40, 40, 40, 40], 1: [40, 40, 40, 40]})  # every sample writes the same tokens
    none = simulate(recs, FLAT, engines=1, policy_name="none")
    uniform = simulate(recs, FLAT, engines=1, policy_name="uniform-8")
    assert uniform.accepted_tokens > 0
    assert uniform.makespan_s < 0.5 * none.makespan_s
    assert uniform.tokens_verified > none.tokens_verified  # drafts are verified work


def test_exact_drafts_take_k_max_plus_one_tokens_a_step_priced_in_full():
    """Samples of 3 and 9 tokens (one engine, K_max 4): the prefill step samples each one's first token, then the
    9-token sample drafts 4 + bonus, then its last 3 (2 drafted + bonus); the 3-token one ends in one decode."""
    recs = records({0: [5, 5], 1: [3, 9]})
    per_token = CostModel(name="t", c_base_s=1.0, c_tok_s=0.5, source="test", c_spec_s=0.25)
    exact = simulate(recs, per_token, engines=1, policy_name="none", k_max=4, exact_drafts=True)
    assert exact.accepted_tokens == 1 + 4 + 2 and exact.tokens_verified == (2 + 1 + 4) + (1 + 2)
    # prefill (4 prompt tokens), then (2 requests: 2 + 1 + 4 drafted), then (1 request: 1 + 2 drafted)
    assert exact.makespan_s == pytest.approx((1.0 + 2.0) + (1.0 + 3.5 + 0.25) + (1.0 + 1.5 + 0.25))
    assert exact.makespan_s < simulate(recs, per_token, engines=1, policy_name="none").makespan_s
    with pytest.raises(ValueError, match="policy 'none'"):
        simulate(recs, per_token, engines=1, policy_name="das", exact_drafts=True)


def test_bad_arguments():
    recs = records({0: [3], 1: [3]})
    with pytest.raises(ValueError, match="engines"):
        simulate(recs, FLAT, engines=0, policy_name="none")
    with pytest.raises(ValueError, match="an arm is none \\(no speculation\\) or a budget; unknown budget 'magic'"):
        simulate(recs, FLAT, engines=1, policy_name="magic")
    with pytest.raises(ValueError, match="placement"):
        simulate(recs, FLAT, engines=1, policy_name="none", placement="random")
    with pytest.raises(ValueError, match="two policy versions"):
        simulate(records({0: [3]}), FLAT, engines=1, policy_name="none")


def test_cli_labels_everything_as_simulated(tmp_path):
    path = tmp_path / "t.jsonl"
    write_rollouts(path, records({0: [20, 30, 20, 30], 1: [25, 35, 20, 30]}))
    result = CliRunner().invoke(app, ["bench", "simulate", "--traces", str(path), "--engines", "2", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["simulated"] is True and set(doc["arms"]) == {"none", "uniform-4", "uniform-8", "uniform-16",
                                                            "classes", "das-token", "das-lengths", "das"}
    assert set(doc["placement"]) == {"round-robin", "length-aware"}
    assert set(doc["references"]) == {"every_group_alone", "oracle_lengths", "drafts_free", "exact_drafts"}
    assert {"every-group-alone/round-robin", "oracle-lengths/das", "drafts-free/none", "exact-drafts/none",
            "das share of the exact drafts' saving"} <= set(doc["ratios"])
    assert doc["ratios"]["exact-drafts/none"] < 1.0
    free = doc["references"]["drafts_free"]
    assert free["tokens_verified"] >= doc["arms"]["uniform-16"]["tokens_verified"] > 0
    for arm in doc["arms"].values():
        assert {"makespan_s", "tail_share", "forward_passes", "tokens_verified"} <= set(arm)
    table = CliRunner().invoke(app, ["bench", "simulate", "--traces", str(path), "--engines", "2",
                                     "--policy", "das"])
    assert table.exit_code == 0 and "SIMULATED" in table.output
    bad = CliRunner().invoke(app, ["bench", "simulate", "--traces", str(path), "--cost-model", "nope"])
    assert bad.exit_code == 2


def test_drafts_are_scored_along_the_recorded_text_as_a_verifier_would():
    """The vectorised scoring gives each draft the longest prefix equal to its request's recorded text from where
    it stands, never past the text's end (as accepted_prefix does one draft at a time)."""
    rng = np.random.default_rng(3)
    table = rng.integers(0, 3, size=(6, 40)).astype(np.int32)
    ends = np.array([40, 30, 25, 40, 12, 40])
    rows, at = np.array([4, 0, 2, 5, 1]), np.array([10, 5, 20, 39, 0])
    drafts, expected = [], []
    for r, a in zip(rows, at):
        truth = table[r, a:ends[r]]
        tail = rng.integers(0, 3, size=rng.integers(0, 4))
        draft = np.concatenate([truth[:rng.integers(0, 6)], tail]).astype(np.int32)
        drafts.append(draft)
        expected.append(accepted_prefix(draft, truth))
    offsets = np.concatenate([[0], np.cumsum([d.size for d in drafts])])
    step = StepDrafts(np.concatenate(drafts), np.zeros(offsets[-1], np.float32), offsets, np.zeros(5, np.int32),
                      np.zeros(5, np.int32), np.zeros(5, bool))
    assert _accepted_prefixes(step, table, rows, at, ends[rows]).tolist() == expected
    assert max(expected) > 0 and any(e < d.size for e, d in zip(expected, drafts))  # both cases were drawn


def test_the_host_price_is_paid_by_every_arm_that_drafts_and_not_by_none(tmp_path):
    """With host_s, each step of an engine that drafts costs host_s more (no async scheduling), so a drafting arm
    that takes as many passes as none ends later by passes x host_s; none (async scheduling) pays nothing."""
    from das.scheduler.simulator import run_simulation_bench

    recs = records({0: [20, 30, 20, 30], 1: [25, 35, 20, 30]})
    cost = CostModel(name="t", c_base_s=1.0, c_tok_s=0.1, source="test")
    free = run_simulation_bench(recs, "t", cost, engines=2, arms=["none", "uniform-4"], placement_policy="uniform-4",
                                progress=False)
    priced = run_simulation_bench(recs, "t", cost, engines=2, arms=["none", "uniform-4"],
                                  placement_policy="uniform-4", progress=False, host_s=0.25)
    assert priced.arms["none"].makespan_s == free.arms["none"].makespan_s
    assert priced.arms["uniform-4"].forward_passes == free.arms["uniform-4"].forward_passes  # uniform: same plan
    # the batch's makespan is its longest engine's: at most every pass of the arm, at least its slowest batch's
    extra = priced.arms["uniform-4"].makespan_s - free.arms["uniform-4"].makespan_s
    assert 0.25 * max(free.arms["uniform-4"].forward_passes // 4, 1) <= extra <= 0.25 * free.arms["uniform-4"].forward_passes
    for name in ("every_group_alone", "oracle_lengths", "drafts_free", "exact_drafts"):
        assert priced.references[name].makespan_s > free.references[name].makespan_s
    assert priced.config["host_ms_per_step"] == 250.0
    with pytest.raises(ValueError, match="host seconds"):
        cost.with_host(-0.001)
    assert cost.with_host(0.0) is cost and cost.with_host(0.002).c_base_s == pytest.approx(1.002)


def test_cli_reads_the_host_price_from_a_number_or_a_report(tmp_path):
    path = tmp_path / "t.jsonl"
    write_rollouts(path, records({0: [20, 30, 20, 30], 1: [25, 35, 20, 30]}))
    report = tmp_path / "gpu-check.json"
    report.write_text(json.dumps({"arms": [{"arm": "none", "host_ms_per_step": 0.5},
                                           {"arm": "das", "host_ms_per_step": 1.25}]}))
    base = ["bench", "simulate", "--traces", str(path), "--engines", "2", "--policy", "uniform-4", "--json"]
    for given, ms in (("2", 2.0), (str(report), 1.25)):
        result = CliRunner().invoke(app, [*base, "--host-ms", given])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["config"]["host_ms_per_step"] == ms
    report.write_text(json.dumps({"arms": [{"arm": "das", "host_ms_per_step": None}]}))
    for bad in (str(report), "-1", str(tmp_path / "missing.json")):
        result = CliRunner().invoke(app, [*base, "--host-ms", bad])
        assert result.exit_code == 2 and "--host-ms" in result.output


def test_arm_list_expands_ranges_and_the_fixed_policies():
    from das.scheduler.simulator import arm_list

    assert arm_list("none,uniform-2..4,das", 16) == ["none", "uniform-2", "uniform-3", "uniform-4", "das"]
    fixed = arm_list("fixed", 3)
    assert fixed == ["uniform-1", "uniform-2", "uniform-3", "classes", "das-token", "das-lengths"]
    assert arm_list("das,fixed,das", 1) == ["das", "uniform-1", "classes", "das-token", "das-lengths"]
    for bad in ("uniform-4..2", "uniform-a..3", "oracle", ",,", "das:h100-7b"):
        with pytest.raises(ValueError):
            arm_list(bad, 16)


def test_an_arm_is_none_or_a_name_of_the_budget_grammar():
    from das.scheduler.policies import parse_budget
    from das.scheduler.simulator import ARMS, arm_settings, make_policy

    assert arm_settings("none") is None and make_policy("none", 16) is None
    for arm in ARMS[1:]:
        assert arm_settings(arm) == parse_budget(arm) and make_policy(arm, 16).name == arm
    assert make_policy("uniform", 6).name == "uniform-6"  # the grammar's uniform: K_max
    with pytest.raises(ValueError, match="prices every arm by its --cost-model"):
        arm_settings("das:h100-7b")


def test_cli_runs_the_arms_given_and_compares_das_with_the_best_fixed_one(tmp_path):
    path = tmp_path / "t.jsonl"
    write_rollouts(path, records({0: [20, 30, 20, 30], 1: [25, 35, 20, 30]}))
    result = CliRunner().invoke(app, ["bench", "simulate", "--traces", str(path), "--engines", "2", "--k-max", "2",
                                      "--arms", "none,uniform-1..2,das", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert list(out["arms"]) == ["none", "uniform-1", "uniform-2", "das"]
    best = min(("uniform-1", "uniform-2"), key=lambda n: out["arms"][n]["makespan_s"])
    assert out["ratios"][f"das/best-fixed ({best})"] == pytest.approx(
        out["arms"]["das"]["makespan_s"] / out["arms"][best]["makespan_s"])
    assert out["ratios"]["das/drafts-free"] == pytest.approx(
        out["arms"]["das"]["makespan_s"] / out["references"]["drafts_free"]["makespan_s"])
    both = CliRunner().invoke(app, ["bench", "simulate", "--traces", str(path), "--policy", "das", "--arms", "das"])
    assert both.exit_code == 2 and "not both" in both.output


def test_drafts_free_prices_each_request_s_own_token_but_not_its_drafts():
    """One sample whose text repeats its history: it drafts and most drafts hold; every pass after the prompt's
    costs c_base + c_tok (its one token), whatever it drafted."""
    recs = [RolloutRecord(problem_id="p", policy_version=v, sample_index=0, prompt_token_ids=(1, 2),
                          output_token_ids=tuple(range(10, 50))) for v in (0, 1)]
    cost = CostModel(name="t", c_base_s=1.0, c_tok_s=0.5, source="test", c_spec_s=3.0)
    free = simulate(recs, cost, engines=1, policy_name="uniform-8", k_max=8, free_drafts=True)
    priced = simulate(recs, cost, engines=1, policy_name="uniform-8", k_max=8)
    assert free.accepted_tokens > 0 and free.forward_passes < 40
    assert free.makespan_s == pytest.approx(2.0 + (free.forward_passes - 1) * 1.5)  # the prompt's pass: 1 + 2 * 0.5
    assert priced.makespan_s > free.makespan_s


def test_the_bench_runs_only_the_references_asked_for():
    from das.scheduler.simulator import run_simulation_bench

    recs = records({0: [20, 30, 20, 30], 1: [25, 35, 20, 30]})
    bench = run_simulation_bench(recs, "t", FLAT, 2, arms=["none", "das"], progress=False,
                                 references=("exact_drafts",), placements=False)
    assert set(bench.references) == {"exact_drafts"} and bench.placement == {}
    assert "exact-drafts/none" in bench.ratios()
    with pytest.raises(ValueError, match="unknown references"):
        run_simulation_bench(recs, "t", FLAT, 2, arms=["none"], progress=False, references=("nope",))


def test_a_trace_with_sample_keys_drafts_each_keys_previous_sample():
    from das.scheduler.cost_model import load_cost_model

    rng = np.random.default_rng(3)
    shared = rng.integers(10, 500, size=4).tolist()
    outputs = [shared + rng.integers(10, 500, size=40).tolist() for _ in range(8)]  # 8 keys part after 4 tokens

    def trace(keyed: bool) -> list[RolloutRecord]:
        return [RolloutRecord("p", v, i, (1, 2, 3), tuple(outputs[i]), sample_key=i if keyed else None)
                for v in range(3) for i in range(8)]

    cost = load_cost_model("h200-7b")
    plain, keyed = (simulate(trace(k), cost, 1, "das") for k in (False, True))
    assert keyed.accepted_tokens > plain.accepted_tokens and keyed.makespan_s < plain.makespan_s
