from das.bench.e2e_report import cost_fit_line
from das.service.engine.budget_hook import StepSample, budget_hook_from_config


def test_the_cost_fit_line_reads_what_the_budget_hook_reports():
    hook = budget_hook_from_config({"policy": "das", "prior": {"name": "p", "c_base_s": 0.05, "c_tok_s": 0.001,
                                                                 "source": "test"}}, 8)
    for n in (8, 16, 32, 64) * 10:
        hook.observe(StepSample(0.0756 + 0.00585 * n, n, n, 0, 0))
    line = cost_fit_line(hook.stats())
    assert "c_base 75.6 ms" in line and "c_tok 5.850 ms/token" in line and "prior p" in line
    assert "guard floor 0.00" in line and "0 exploration tokens" in line
    plain = cost_fit_line(budget_hook_from_config({"policy": "uniform"}, 8).stats())
    assert "guard" not in plain and "fit error" not in plain
