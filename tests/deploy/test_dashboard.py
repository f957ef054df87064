"""The Grafana straggler dashboard (deploy/grafana/das-stragglers.json) asks only for series the service exports.

One batch runs through the real gateway over a stub engine (in-process, TestClient), then /metrics is scraped and
parsed with prometheus-client's parser. Every PromQL expression of the dashboard (panel targets and variable
queries) is parsed with a real PromQL parser (promql-parser); every vector selector's metric name must be a
series in the scrape, every label it matches on must be one of that series' labels (or a label Prometheus adds
to a scraped target), and so must every label a `by (...)` groups on or a legend shows.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import promql_parser as promql
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from das.service.cluster.rollout_backend import BackendStats
from das.service.engine.stub_engine import StubEngine, StubEngineConfig
from das.service.http.gateway import create_app
from das.service.config import GatewayConfig
from tests.deploy.manifests import ROOT
from tests.service.stub_backend import RecordingBackend

DASHBOARD = ROOT / "deploy" / "grafana" / "das-stragglers.json"
# Labels Prometheus (and the prometheus-operator's ServiceMonitor relabelling) attach to every scraped series.
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "service", "endpoint", "container"})
# Grafana's interval macros, replaced by a duration before parsing (they only appear as range durations).
_MACRO = re.compile(r"\$(?:__rate_interval|__interval|__range)\b|\$\{(?:__rate_interval|__interval|__range)\}")
_LABEL_VALUES = re.compile(r"^label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\)$", re.DOTALL)
_LEGEND_LABEL = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


@dataclass
class Query:
    """One PromQL expression of the dashboard and where it is."""

    where: str
    expr: str
    legend: str = ""
    # Labels the result must carry (a variable query's label), beyond those of its legend.
    needs: tuple[str, ...] = ()


@dataclass
class Usage:
    """What an expression asks of the scrape: metric names, labels matched per metric, labels grouped on."""

    metrics: set[str] = field(default_factory=set)
    matched: dict[str, set[str]] = field(default_factory=dict)
    grouped: list[tuple[set[str], set[str]]] = field(default_factory=list)  # (labels, metrics under the grouping)


def dashboard_queries(dashboard: dict[str, Any]) -> list[Query]:
    """Every PromQL expression: panel targets (rows' nested panels too) and query variables."""
    queries = []

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            queries.append(Query(f"panel {panel['title']!r} target {target['refId']}", target["expr"],
                                 target.get("legendFormat", "")))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable["type"] != "query":
            continue
        text = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        match = _LABEL_VALUES.match(text.strip())
        if match is None:
            raise ValueError(f"variable {variable['name']}: only label_values(selector, label) is checked: {text}")
        queries.append(Query(f"variable {variable['name']}", match.group(1), needs=(match.group(2),)))
    return queries


def usage(expr: str) -> Usage:
    """Parses `expr` (Grafana macros replaced by 5m) and collects what it asks of the scrape. A syntax error or a
    metric name picked by regex raises ValueError: neither can be checked against a scrape."""
    found = Usage()
    try:
        tree = promql.parse(_MACRO.sub("5m", expr))
    except Exception as exc:  # the parser raises its own error type
        raise ValueError(f"not PromQL: {expr}: {exc}") from exc
    _collect(tree, found)
    return found


def _selector_name(selector: promql.VectorSelector) -> str:
    if selector.name:
        return str(selector.name)
    for matcher in selector.matchers.matchers:
        if matcher.name == "__name__":
            if matcher.op != promql.MatchOp.Equal:
                raise ValueError(f"metric name chosen by {matcher.op} {matcher.value!r}: cannot be checked")
            return str(matcher.value)
    raise ValueError("a selector with no metric name")


def _collect(node: Any, found: Usage) -> set[str]:
    """Adds what `node` asks for to `found`; returns the metric names under `node`."""
    if isinstance(node, promql.VectorSelector):
        name = _selector_name(node)
        found.metrics.add(name)
        labels = {m.name for m in node.matchers.matchers if m.name != "__name__"}
        found.matched.setdefault(name, set()).update(labels)
        return {name}
    if isinstance(node, promql.MatrixSelector):
        return _collect(node.vector_selector, found)
    if isinstance(node, promql.AggregateExpr):
        under = _collect(node.expr, found)
        if node.param is not None:
            under |= _collect(node.param, found)
        modifier = node.modifier
        if modifier is not None and modifier.type == promql.AggModifierType.By:
            found.grouped.append((set(modifier.labels), under))
        return under
    if isinstance(node, promql.BinaryExpr):
        return _collect(node.lhs, found) | _collect(node.rhs, found)
    if isinstance(node, promql.Call):
        return set().union(*(_collect(arg, found) for arg in node.args)) if node.args else set()
    if isinstance(node, (promql.ParenExpr, promql.UnaryExpr, promql.SubqueryExpr)):
        return _collect(node.expr, found)
    if isinstance(node, (promql.NumberLiteral, promql.StringLiteral)):
        return set()
    raise ValueError(f"unhandled PromQL node {type(node).__name__}")


def scrape_labels(metrics_text: str) -> dict[str, set[str]]:
    """Series name -> label names, from a Prometheus text exposition (histograms give their _bucket, _sum and
    _count series, counters their _total)."""
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def problems(queries: list[Query], exported: dict[str, set[str]]) -> list[str]:
    """Everything the dashboard asks for that the scrape does not have; empty when all is served."""
    found = []
    for query in queries:
        try:
            used = usage(query.expr)
        except ValueError as exc:
            found.append(f"{query.where}: {exc}")
            continue
        missing = used.metrics - exported.keys()
        found += [f"{query.where}: metric {name} is not exported" for name in sorted(missing)]
        # Label checks only where every series involved exists (a missing metric is reported once, above).
        for name, labels in sorted(used.matched.items()):
            if name not in missing:
                found += [f"{query.where}: {name} has no label {label}"
                          for label in sorted(labels - exported[name] - TARGET_LABELS)]
        for labels, under in used.grouped:
            if not under & missing:
                available = set().union(*(exported[m] for m in under)) | TARGET_LABELS
                found += [f"{query.where}: by ({label}) but no series under it has that label"
                          for label in sorted(labels - available)]
        if not missing:
            available = set().union(*(exported[m] for m in used.metrics)) | TARGET_LABELS
            found += [f"{query.where}: label {label} (legend or variable) is on none of its series"
                      for label in sorted({*_LEGEND_LABEL.findall(query.legend), *query.needs} - available)]
    return found


class EveryEngineFigure(RecordingBackend):
    """The stub engine's backend with the engine figures an in-process engine has no source for filled in
    (proposer times and drafts by source, an engine actor's memory, placed tokens), so every engine series of
    /metrics exists."""

    def stats(self) -> BackendStats:
        stats = super().stats()
        engines = tuple(replace(load, speculate_p50_s=0.0, speculate_p99_s=0.0, drafts_by_source={"live": (0, 0)})
                        for load in stats.engines)
        return replace(stats, engines=engines, resident_bytes={"node_engine": 0},
                       engine_placed_tokens={load.engine: 0.0 for load in engines})


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """The series /metrics exports after one batch through the gateway (stub engine, its figures filled in), one of
    its groups a session's turn."""
    with TestClient(create_app(EveryEngineFigure(StubEngine(StubEngineConfig(tokens=24))), GatewayConfig())) as client:
        body = {"groups": [{"problem_id": "p0", "n": 4, "prompt_token_ids": [1, 2, 3],
                            "sampling": {"max_tokens": 32}},
                           {"problem_id": "p1", "n": 2, "prompt_token_ids": [4, 5], "sampling": {"max_tokens": 16}},
                           {"problem_id": "p2", "session_id": "s0", "prompt_token_ids": [6], "sampling": {}}]}
        with client.stream("POST", "/v1/rollouts", json=body) as response:
            assert response.status_code == 200
            lines = [json.loads(line) for line in response.iter_lines() if line]
        assert len(lines) == 8 and lines[-1]["summary"]["status"] == "done"  # 7 samples, then the summary
        metrics = client.get("/metrics")
        assert metrics.status_code == 200
        return scrape_labels(metrics.text)


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def test_every_dashboard_series_is_exported(exported: dict[str, set[str]]) -> None:
    queries = dashboard_queries(load_dashboard())
    assert len(queries) >= 30
    assert problems(queries, exported) == []


def test_dashboard_shows_what_straggler_monitoring_needs() -> None:
    """The views the issue asks for are there, each with the metric (and grouping) that makes it."""
    dashboard = load_dashboard()
    by_panel: dict[str, list[tuple[str, Usage]]] = {}
    for query in dashboard_queries(dashboard):
        by_panel.setdefault(query.where.split(" target")[0], []).append((query.expr, usage(query.expr)))

    def shown(metric: str, grouped_by: str | None = None, panel_type: str | None = None) -> bool:
        types = {f"panel {p['title']!r}": p["type"] for p in _all_panels(dashboard)}
        for where, entries in by_panel.items():
            if panel_type is not None and types.get(where) != panel_type:
                continue
            for _, used in entries:
                if metric in used.metrics and (grouped_by is None or any(
                        grouped_by in labels and metric in under for labels, under in used.grouped)):
                    return True
        return False

    assert shown("das_batch_makespan_seconds_bucket")
    assert shown("das_batch_tail_share_ratio_bucket")
    assert shown("das_batch_straggler_ratio_bucket")
    assert shown("das_generated_length_tokens_bucket", "le", panel_type="heatmap")
    assert shown("das_current_batch_longest_tokens")
    assert shown("das_acceptance_length_tokens_sum", "length_class")
    assert shown("das_draft_tokens_proposed_total", "length_class")
    assert shown("das_draft_tokens_accepted_total", "length_class")
    assert shown("das_engine_requests_running", "engine")
    assert shown("das_engine_requests_waiting", "engine")
    assert shown("das_engine_placed_tokens", "engine")
    assert shown("das_samples_redispatched_total") and shown("das_samples_given_up_total")
    assert shown("das_history_tokens_stored")
    assert shown("das_weight_reload_seconds_bucket")
    assert shown("das_session_open") and shown("das_session_turns_total")
    assert shown("das_session_moves_total", "reason") and shown("das_session_makespan_seconds_bucket", "le")
    assert shown("das_engine_prompt_tokens_cached_total", "engine")
    assert shown("das_engine_busy_seconds_total", "engine") and shown("das_engine_steps_total", "engine")
    assert shown("das_engine_draft_tokens_accepted_total", "engine")
    assert shown("das_session_reserved_tokens", "engine")


def _all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def test_dashboard_is_well_formed() -> None:
    """What Grafana's provisioning needs: a stable uid, unique panel ids, a grid that fits, every query on the
    dashboard's data source variable (so it works with any Prometheus data source name)."""
    dashboard = load_dashboard()
    assert dashboard["uid"] == "das-stragglers" and dashboard["title"]
    panels = _all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "job", "engine"} <= variables
    for panel in panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


# The checker itself must be able to fail: each deliberately wrong expression is reported.
WRONG = {
    "misspelled metric": ('sum(rate(das_batch_makespan_second_bucket{job=~"$job"}[$__rate_interval]))',
                          "metric das_batch_makespan_second_bucket is not exported"),
    "counter without _total": ("sum(rate(das_output_tokens[5m]))", "metric das_output_tokens is not exported"),
    "histogram without _bucket": ("histogram_quantile(0.9, sum by (le) (rate(das_batch_straggler_ratio[5m])))",
                                  "metric das_batch_straggler_ratio is not exported"),
    "label the series lacks": ('das_engine_requests_running{component="gateway"}',
                               "das_engine_requests_running has no label component"),
    "grouping on a missing label": ("sum by (length_class) (das_engine_requests_waiting)",
                                    "by (length_class) but no series under it"),
    "legend of a missing label": ("sum(das_history_tokens_stored)", "label engine (legend or variable)"),
    "regex metric name": ('{__name__=~"das_.*"}', "cannot be checked"),
    "not PromQL": ("sum(rate(das_output_tokens_total[5m])", "not PromQL"),
}


@pytest.mark.parametrize("case", WRONG)
def test_checker_reports_wrong_expressions(case: str, exported: dict[str, set[str]]) -> None:
    expr, message = WRONG[case]
    legend = "{{engine}}" if case == "legend of a missing label" else ""
    reported = problems([Query("test", expr, legend)], exported)
    assert len(reported) == 1 and message in reported[0], reported


def test_checker_names_only_metrics_not_functions_or_labels() -> None:
    used = usage('histogram_quantile(0.99, sum by (le, engine) (rate(das_x_bucket{job=~"$job", quantile="0.5"}'
                 '[$__rate_interval]))) / on (engine) group_left max by (engine) (das_y) + scalar(das_z)'
                 ' or label_replace(das_w offset 5m, "a", "$1", "b", "(.*)")')
    assert used.metrics == {"das_x_bucket", "das_y", "das_z", "das_w"}
    assert used.matched["das_x_bucket"] == {"job", "quantile"}
    assert ({"le", "engine"}, {"das_x_bucket"}) in used.grouped and ({"engine"}, {"das_y"}) in used.grouped


def test_a_wrong_metric_in_the_real_dashboard_is_caught(exported: dict[str, set[str]]) -> None:
    dashboard = load_dashboard()
    panel = next(p for p in _all_panels(dashboard) if p["type"] == "heatmap")
    panel["targets"][0]["expr"] = panel["targets"][0]["expr"].replace("das_generated_length_tokens_bucket",
                                                                      "das_generated_length_token_bucket")
    reported = problems(dashboard_queries(dashboard), exported)
    assert reported == [f"panel {panel['title']!r} target A: metric das_generated_length_token_bucket is not "
                        "exported"]
