"""`das bench budgets`: das against every fixed policy per trace set, cost model and host price."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from das.bench.budget_table import Cell, Row, Summary, budget_table, run_cell
from das.service.cli import program
from das.drafter.records import RolloutRecord, write_rollouts
from das.scheduler.cost_model import load_cost_model

app = program()


def _traces(tmp_path):
    """Two problems whose samples repeat every version: the drafter's history predicts them exactly."""
    path = tmp_path / "t.jsonl"
    rows = [RolloutRecord(problem_id=f"p{i % 2}", policy_version=v, sample_index=i, prompt_token_ids=(1, 2),
                          output_token_ids=tuple(range(10 + i % 2, 10 + i % 2 + n)))
            for v in (0, 1) for i, n in enumerate((24, 40, 24, 40))]
    write_rollouts(path, rows)
    return path


def test_a_row_compares_das_with_each_fixed_policy(tmp_path):
    row = run_cell(Cell(str(_traces(tmp_path)), "h200-7b", 0.0, engines=2), k_max=2)
    assert set(row.against) == {"uniform-1", "uniform-2", "classes", "das-token", "das-lengths"}
    assert row.das_over_best_fixed == pytest.approx(max(row.against.values()))  # das / the fastest
    assert row.loses_to == sorted((n for n, r in row.against.items() if r > 1.0), key=row.against.get,
                                  reverse=True)
    assert row.passes == (not row.loses_to and row.das_over_drafts_free <= 1.10)
    assert row.das_over_none < 1.0  # repeated text under a GPU's prices: drafting pays
    assert row.cost_model == "h200-7b" and row.host_ms == 0.0 and row.engines == 2


def test_the_host_price_slows_das_but_not_none(tmp_path):
    path = str(_traces(tmp_path))
    free, priced = (run_cell(Cell(path, "h200-7b", host, engines=2), k_max=2) for host in (0.0, 5.0))
    assert priced.das_s > free.das_s
    assert priced.das_over_none > free.das_over_none


def test_cpu_means_the_bundled_sets_own_calibration(tmp_path):
    assert Cell("smollm2", "cpu", 0.0).model_name() == "cpu-smollm2"
    assert Cell("heldout-qwen2.5-coder-code", "cpu", 0.0).model_name() == "cpu-qwen2.5-coder-0.5b"
    with pytest.raises(ValueError, match="bundled"):
        Cell(str(tmp_path / "x.jsonl"), "cpu", 0.0).model_name()
    # a CPU fit is priced whole: no host price is added to it
    table = budget_table([str(_traces(tmp_path))], ["h200-7b"], [0.0, 2.0], engines=(2,), k_max=1, progress=False)
    assert [(r.cost_model, r.host_ms) for r in table.rows] == [("h200-7b", 0.0), ("h200-7b", 2.0)]


def test_h200_is_a_named_model():
    model = load_cost_model("h200-7b")
    assert model.c_base_s == pytest.approx(7.5655e-3) and model.c_tok_s == pytest.approx(31.55e-6)


def test_cli_prints_rows_and_exits_1_where_das_loses(tmp_path):
    path = str(_traces(tmp_path))
    result = CliRunner().invoke(app, ["bench", "budgets", "--traces", path, "--cost-models", "h200-7b",
                                      "--host-ms", "0", "--engines", "2", "--k-max", "2", "--json"])
    out = json.loads(result.stdout)
    assert len(out["rows"]) == 1 and out["rows"][0]["traces"] == path
    assert result.exit_code == (0 if out["passed"] else 1)
    bad = CliRunner().invoke(app, ["bench", "budgets", "--traces", path, "--cost-models", "cpu"])
    assert bad.exit_code == 2 and "bundled" in bad.output


def test_each_cell_s_end_is_a_line_on_stderr(tmp_path, capsys):
    budget_table([str(_traces(tmp_path))], ["h200-7b"], [0.0, 1.0], engines=(2,), k_max=1)
    err = capsys.readouterr().err
    assert "simulating 2 cells" in err and "[1/2]" in err and "[2/2]" in err and "host 1 ms" in err


def test_engine_counts_give_a_row_each_and_geometric_means_over_them(tmp_path):
    path = str(_traces(tmp_path))
    table = budget_table([path], ["h200-7b"], [0.0], engines=(1, 2), k_max=2, progress=False)
    one, two = table.rows
    assert (one.engines, two.engines) == (1, 2)
    (summary,) = table.summaries()
    assert summary.engines == [1, 2]
    for arm in one.against:  # each ratio's geometric mean over the counts
        assert summary.against[arm] == pytest.approx((one.against[arm] * two.against[arm]) ** 0.5)
    assert summary.das_over_none == pytest.approx((one.das_over_none * two.das_over_none) ** 0.5)
    assert summary.loses_to == sorted((n for n, r in summary.against.items() if r > 1.0), key=summary.against.get,
                                      reverse=True)
    out = table.to_dict()
    assert out["over_engines"][0]["engines"] == [1, 2] and out["passed_over_engines"] == summary.passes
    # one engine count: no summary, nothing to judge over counts
    single = budget_table([path], ["h200-7b"], [0.0], engines=(2,), k_max=2, progress=False)
    assert single.summaries() == [] and single.to_dict()["passed_over_engines"] is None


def test_a_summary_loses_where_a_mean_does():
    def row(engines, against):
        return Row("t", "h200-7b", 0.0, engines, 1.0, 0.8, "uniform-2", max(against.values()), 1.05, 0.7, 0.1,
                   against, [], True)

    summary = Summary.of([row(4, {"uniform-2": 1.04, "das-lengths": 0.97}),
                          row(8, {"uniform-2": 0.98, "das-lengths": 0.99})])
    assert summary.loses_to == ["uniform-2"] and not summary.passes  # 1.04 x 0.98 > 1: a loss on the mean
