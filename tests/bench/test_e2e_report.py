from das.bench.e2e_report import cost_fit_line
from das.scheduler.budget_hook import budget_hook_from_config


def test_the_cost_fit_line_reads_what_the_budget_hook_reports():
    prior = {"name": "p", "c_base_s": 0.0756, "c_tok_s": 0.00585, "c_spec_s": 0.002, "source": "test"}
    line = cost_fit_line(budget_hook_from_config({"policy": "das", "prior": prior, "online": False}, 8).stats())
    assert "c_base 75.6 ms" in line and "c_tok 5.850 ms/token" in line and "c_spec 2.0 ms" in line
    assert "prior p" in line and "guard price 0.00 (raised 0x)" in line and "0 exploration tokens granted" in line
    online = cost_fit_line(budget_hook_from_config({"policy": "das", "prior": prior}, 8).stats())
    assert "0 steps" not in online and "fit error" not in online  # no step measured yet: no fit error to show
    plain = cost_fit_line(budget_hook_from_config({"policy": "uniform"}, 8).stats())
    assert "guard" not in plain


def test_every_arm_replays_as_its_own_policy_or_not_at_all():
    from das.bench.e2e import ARMS
    from das.bench.e2e_report import simulated_arm

    assert {arm: simulated_arm(arm, 8) for arm in ARMS} == {
        "none": "none", "ngram": None, "suffix": None, "suffix-t": None, "das-uniform": "uniform-8", "das": "das",
        "das-service": "das", "none-service": "none", "oracle": None, "oracle-k": None}
