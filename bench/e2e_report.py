"""How `das bench e2e` shows its result: rich tables on the console, a markdown report, a PNG plot.

All three read an `E2EResult` (`das.bench.e2e`) and show the same figures: per epoch and arm the medians
over repeats (with every repeat's makespan when there are several), each arm's output tests against the baseline,
and the goals.

`das bench validate` (`validate_rollouts`) reads the rollouts file of a run instead (`--rollouts-out`) and replays
it through the simulator, to say how far simulated makespans are from the measured ones.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from das.bench.e2e import (
    ALPHA,
    ARM_BUDGETS,
    ARM_SPECULATION,
    BASELINE,
    E2EResult,
    ORACLE_ARMS,
    RolloutsSidecar,
    machine_info,
    rollout_tag,
    sum_by_source,
)
from das.scheduler.policies import parse_budget

# A makespan ratio against the baseline: arm / none, below 1 is faster.
_RATIO = "x{:.2f}"


def _fmt(value: float | int | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _rows(result: E2EResult) -> list[list[str]]:
    """Per epoch and arm, the table cells: epoch, arm, makespan (every repeat's in parentheses when several),
    vs none, longest sample, tail share, tokens/s, drafted, accepted, acceptance length, reward, errors."""
    rows = []
    for e, arms in enumerate(result.medians()):
        base = arms.get(BASELINE, {}).get("makespan_s")
        for arm, m in arms.items():
            makespan = _fmt(m["makespan_s"], "{:.1f}")
            if len(result.runs) > 1:
                makespan += " (" + ", ".join(f"{run[e][arm].makespan_s:.1f}" for run in result.runs) + ")"
            ratio = _RATIO.format(m["makespan_s"] / base) if base and arm != BASELINE and m["makespan_s"] else ""
            if arm in result.tests and result.tests[arm].flagged:
                ratio += " (output changed)"  # reported, not a win
            rows.append([str(e + 1), arm, makespan, ratio, _fmt(m["longest_tokens"], "{:.0f}"),
                         _fmt(m["tail_share"], "{:.2f}"),
                         _fmt(m["tokens_per_s"], "{:.1f}"), _fmt(m["draft_tokens"], "{:,.0f}"),
                         _fmt(m["accepted_tokens"], "{:,.0f}"), _fmt(m["acceptance_length"], "{:.2f}"),
                         _fmt(m["reward_mean"], "{:.3f}"), _fmt(m["errors"], "{:.0f}")])
    return rows


_COLUMNS = ("epoch", "arm", "makespan s", "vs none", "longest", "tail share", "tok/s", "drafted", "accepted",
            "accept len", "reward", "errors")


def _test_rows(result: E2EResult) -> list[list[str]]:
    """Per arm: reward difference [95% CI], its p, KS distance, its p, verdict."""
    rows = []
    for arm, t in result.tests.items():
        r = t.reward
        reward = f"{r.difference:+.3f} [{r.ci_low:+.3f}, {r.ci_high:+.3f}]" if r else "-"
        verdict = ", ".join(x for x, on in (("rewards differ", t.changes_rewards),
                                             ("lengths differ", t.changes_lengths)) if on) or "same"
        rows.append([arm, reward, _fmt(r.p_value if r else None, "{:.3f}"), f"{t.length.ks_distance:.3f}",
                     f"{t.length.p_value:.3f}", verdict])
    return rows


_TEST_COLUMNS = ("arm", "reward - none [95% CI]", "p", "length KS D", "p", "verdict")


def _profile_rows(result: E2EResult) -> list[list[str]]:
    """Per epoch and profiled arm: steps, mean requests, tokens and drafts per step, then milliseconds per step
    of forward, sample, propose, rest, gap and the whole step, the forward pass alone (device work) and the rest
    (host work), and the fitted cost line."""
    rows = []
    for e, arms in enumerate(result.profile_medians()):
        for arm, p in arms.items():
            fit = (f"{p['fit_base_ms']:.1f} + {p['fit_ms_per_token']:.3f} n"
                   if p["fit_base_ms"] is not None and p["fit_ms_per_token"] is not None else "-")
            rows.append([str(e + 1), arm, _fmt(p["steps"], "{:.0f}"), _fmt(p["requests"], "{:.1f}"),
                         _fmt(p["tokens"], "{:.1f}"), _fmt(p["drafts"], "{:.1f}"),
                         *(_fmt(p.get(k), "{:.2f}") for k in ("forward_ms", "sample_ms", "propose_ms", "rest_ms",
                                                               "gap_ms", "step_ms", "model_ms", "host_ms")),
                         _fmt(p["drafted_steps"], "{:.0f}"),
                         f"{_fmt(p['sample_ms_drafted'], '{:.1f}')} / {_fmt(p['sample_ms_plain'], '{:.1f}')}", fit])
    return rows


_PROFILE_COLUMNS = ("epoch", "arm", "steps", "requests", "tokens/step", "drafts/step", "forward ms", "sample ms",
                    "propose ms", "rest ms", "gap ms", "step ms", "forward pass ms", "host ms", "drafted steps",
                    "sample ms drafted / plain",
                    "forward+sample ms, n tokens")
_PROFILE_TITLE = "where an engine step's time goes (mean per step; medians over repeats)"


def _oracle_rows(result: E2EResult) -> list[list[str]]:
    """Per epoch (medians over repeats): makespans of none, das, oracle, oracle-k (the arms run), the bound, das's
    saving as a share of the oracle's and oracle / bound (E2EResult.oracle_table)."""
    if not result.bounds:
        return []
    return [[str(row["epoch"]), *(_fmt(row.get(arm), "{:.2f}") for arm in (BASELINE, "das", *ORACLE_ARMS)),
             _fmt(row["bound_s"], "{:.2f}"), _fmt(row["das_share_of_oracle_saving"], "{:.3f}"),
             _fmt(row["oracle_over_bound"], "{:.3f}")] for row in result.oracle_table()]


_ORACLE_COLUMNS = ("epoch", f"{BASELINE} s", "das s", "oracle s", "oracle-k s", "bound s",
                   "das saving / oracle saving", "oracle / bound")
_ORACLE_TITLE = ("the limit: oracle drafts (the exact future) through the same proposer and budget, and the "
                 "bound (critical path at K + 1 tokens a step, priced by the measured step cost)")


def _oracle_identity(result: E2EResult) -> str:
    return "oracle outputs identical to none's: " + ", ".join(
        f"{arm} {same}" for arm, same in result.oracle_identical.items())


def _goal_lines(result: E2EResult) -> list[str]:
    lines = []
    for g in result.goals():
        status = "" if g.passed is None else (" PASS" if g.passed else " FAIL")
        counted = "" if g.counted else f" (not counted: {g.note})"
        per_token = f" (per token of the longest sample: {g.per_longest_token:.3f})" if g.per_longest_token else ""
        lines.append(f"{g.name}: {g.ratio:.3f}{per_token}{status}{counted}")
    return lines


def _title(result: E2EResult) -> str:
    c = result.config
    repeats = f", medians of {c.repeats} repeats" if c.repeats > 1 else ""
    eos = ", ignore_eos" if c.ignore_eos else ""
    drift = f", drift over {len(c.drift)} checkpoints" if c.drift else ""
    order = ", arms one after another" if c.sequential else ""
    return (f"{Path(c.model).name}: {c.prompts} x {c.samples} samples, {c.epochs} epochs, T={c.temperature}, "
            f"max {c.max_tokens} tokens, K={c.num_speculative_tokens}{eos}{drift}{order}{repeats}")


def _rich_table(title: str, columns: tuple[str, ...], rows: list[list[str]]) -> Any:
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*row)
    return table


def print_tables(result: E2EResult, console: Any) -> None:
    console.print(_rich_table(_title(result), _COLUMNS, _rows(result)))
    if result.tests:
        console.print(_rich_table(f"output against {BASELINE} (stratified permutation tests, flagged at p < {ALPHA})",
                                  _TEST_COLUMNS, _test_rows(result)))
    profile = _profile_rows(result)
    if profile:
        console.print(_rich_table(_PROFILE_TITLE, _PROFILE_COLUMNS, profile))
    oracle = _oracle_rows(result)
    if oracle:
        console.print(_rich_table(_ORACLE_TITLE, _ORACLE_COLUMNS, oracle))
        console.print(_oracle_identity(result))
    for line in _goal_lines(result):
        console.print(line)
    if result.identical_outputs is not None:
        console.print(f"identical outputs across arms: {result.identical_outputs}")
        shares = ", ".join(f"{arm} {share:.1%}" for arm, share in result.divergence.items())
        console.print(f"samples that differ from {result.arms[0]}: {shares}")
    if result.noise_floor is not None:
        console.print(f"noise floor: {result.noise_floor:.1%} of {result.arms[0]}'s samples differ between its own "
                      f"epochs 1 and 2 (same prompts, other batch timing)")
    if result.proposer:
        p = result.proposer
        console.print(f"das proposer per decode step: p50 {p['step_us_p50']:.0f} us, p99 {p['step_us_p99']:.0f} us "
                      f"at {p['mean_batch']:.1f} requests on average; history {p['stored_tokens']} tokens")
        if "cost" in p:
            console.print(cost_fit_line(p["cost"]))
    for line in _source_lines(result):
        console.print(line)


def cost_fit_line(cost: dict[str, Any]) -> str:
    """The das engine's live step-cost fit, its never-a-loss guard and exploration, as the budget hook reports
    them (`PolicyBudget.stats`), in one line."""
    fit = (f"das live cost fit (last repeat): c_base {cost['c_base_s'] * 1e3:.1f} ms, "
           f"c_tok {cost['c_tok_s'] * 1e3:.3f} ms/token, c_spec {cost['c_spec_s'] * 1e3:.1f} ms "
           f"+ {cost.get('c_spec_req_s', 0.0) * 1e3:.2f} ms/request from prior {cost['prior']}")
    if cost.get("fit_error") is not None:
        fit += f", {cost['steps']} steps, fit error {cost['fit_error']:.1%}"
    if "guard_price" in cost:
        gain = cost.get("guard_gain")
        fit += (f"; guard price {cost['guard_price']:.2f} (raised {cost['guard_raised']}x"
                f"{f', gain {gain:.3f}' if gain is not None else ''})")
    if "explore_tokens" in cost:
        fit += f"; {cost['explore_tokens']} exploration tokens granted"
    return fit


def _source_lines(result: E2EResult) -> list[str]:
    """Per drafting arm of ours, its draft tokens accepted / proposed by source kind, summed over the repeats."""
    lines = []
    for arm, repeats in result.drafts_by_source.items():
        cells = [f"{kind} {c['accepted']:,}/{c['proposed']:,}"
                 + (f" ({c['accepted'] / c['proposed']:.0%})" if c["proposed"] else "")
                 for kind, c in sum_by_source(repeats).items()]
        if cells:
            lines.append(f"{arm} draft tokens accepted/proposed by source: " + ", ".join(cells))
    return lines


def _markdown_table(columns: tuple[str, ...], rows: list[list[str]]) -> list[str]:
    align = ["---" if col == "arm" else "---:" for col in columns]  # names left, figures right
    return ["| " + " | ".join(columns) + " |", "| " + " | ".join(align) + " |",
            *("| " + " | ".join(row) + " |" for row in rows)]


def markdown(result: E2EResult, command: str | None = None) -> str:
    """The result as markdown: the command and machine, the per-epoch table, the tests and the goals."""
    m = machine_info()
    lines = [f"### {_title(result)}", ""]
    if command:
        lines += ["```bash", command, "```", ""]
    lines += [f"Machine: {m['cpu']}, {m['cores']} cores, {m['os']}; Python {m['python']}, vLLM {m['vllm']}. "
              f"Wall time {result.wall_s / 60:.0f} min.", ""]
    lines += _markdown_table(_COLUMNS, _rows(result)) + [""]
    if len(result.runs) > 1:
        lines += [f"Medians over {len(result.runs)} repeats (fresh engines each); makespans of every repeat in "
                  f"parentheses.", ""]
    if result.tests:
        lines += [f"Output against `{BASELINE}`, pooled over repeats and epochs (stratified permutation tests by "
                  f"repeat, epoch and problem; an arm is flagged at p < {ALPHA} and its speed is not counted):", ""]
        lines += _markdown_table(_TEST_COLUMNS, _test_rows(result)) + [""]
    profile = _profile_rows(result)
    if profile:
        lines += [f"{_PROFILE_TITLE[0].upper()}{_PROFILE_TITLE[1:]}: forward = input preparation and the forward "
                  f"pass over every scheduled token (drafts included), sample = sampler or rejection sampler, "
                  f"propose = the drafter, rest = the runner's bookkeeping, gap = scheduler and output handling "
                  f"between steps:", ""]
        lines += _markdown_table(_PROFILE_COLUMNS, profile) + [""]
    oracle = _oracle_rows(result)
    if oracle:
        lines += [f"{_ORACLE_TITLE[0].upper()}{_ORACLE_TITLE[1:]}; {_oracle_identity(result)}:", ""]
        lines += _markdown_table(_ORACLE_COLUMNS, oracle) + [""]
    goals = _goal_lines(result)
    if goals:
        lines += ["Goals (ratios of median makespans; below 1 is faster):", ""]
        lines += [f"- {g}" for g in goals] + [""]
    sources = _source_lines(result)
    if sources:
        lines += [f"- {line}" for line in sources] + [""]
    if result.identical_outputs is not None:
        shares = ", ".join(f"{arm} {share:.1%}" for arm, share in result.divergence.items())
        lines += [f"Identical outputs across arms (keyed sampling, T = {result.config.temperature}): "
                  f"{result.identical_outputs}; samples that differ from "
                  f"`{result.arms[0]}`: {shares}" + (f"; noise floor {result.noise_floor:.1%}"
                                                        if result.noise_floor is not None else ""), ""]
    return "\n".join(lines)


def plot(result: E2EResult, path: Path) -> None:
    """A PNG: left, makespan per epoch per arm (median line, every repeat a dot); right, the output-length
    distribution of each arm pooled over repeats and epochs as a survival curve P(length > x) on a log scale, the
    tail (beyond the baseline's 90th percentile) shaded and max_tokens marked. Arms flagged as changing the
    output are drawn dashed."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    config = result.config
    medians = result.medians()
    epochs = np.arange(1, config.epochs + 1)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    colors = plt.get_cmap("tab10")
    for i, arm in enumerate(result.arms):
        style = "--" if arm in result.tests and result.tests[arm].flagged else "-"
        label = arm + (" (output changed)" if style == "--" else "")
        offset = (i - (len(result.arms) - 1) / 2) * 0.04  # repeats' dots side by side, not on top of each other
        left.plot(epochs, [m[arm]["makespan_s"] for m in medians], style, marker="o", color=colors(i), label=label)
        for run in result.runs:
            left.scatter(epochs + offset, [row[arm].makespan_s for row in run], s=10, color=colors(i), alpha=0.5)
        lengths = np.sort([n for run in result.runs for row in run for n in row[arm].lengths])
        if len(lengths):
            survival = 1.0 - np.arange(1, len(lengths) + 1) / len(lengths)
            right.step(lengths, np.maximum(survival, 0.5 / len(lengths)), style, where="post", color=colors(i),
                       label=label)
    left.set(xlabel="epoch", ylabel="makespan (s)", title="makespan per epoch (line: median, dots: repeats)",
             xticks=epochs)
    left.set_ylim(bottom=0)
    left.legend(fontsize=8)
    if BASELINE in result.arms:
        base = [n for run in result.runs for row in run for n in row[BASELINE].lengths]
        if base:
            p90 = float(np.percentile(base, 90))
            right.axvspan(p90, config.max_tokens, color="grey", alpha=0.15,
                          label=f"tail: beyond {BASELINE}'s p90 ({p90:.0f})")
    right.axvline(config.max_tokens, color="black", linestyle=":", label=f"max_tokens {config.max_tokens}")
    right.set(xlabel="output length (tokens)", ylabel="P(length > x)", yscale="log",
              title="output-length distribution, all epochs and repeats")
    right.legend(fontsize=8)
    fig.suptitle(_title(result), fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- `das bench validate`: the simulator against a measured run ----


def simulated_arm(arm: str, k: int) -> str | None:
    """The simulator's arm for an e2e arm at K = `k` (`simulator.arm_settings`): its own budget
    (`ARM_BUDGETS`, resolved at K), das or none; None for an arm it cannot model (vLLM's own drafters, the
    oracles)."""
    if arm in ORACLE_ARMS:  # drafts no simulated drafter can make
        return None
    if arm in ARM_BUDGETS:
        return parse_budget(ARM_BUDGETS[arm]).budget_policy(k).name
    return {"none": "none", "das": "das"}.get(ARM_SPECULATION.get(arm, ""))


@dataclass(frozen=True)
class EpochCheck:
    """One arm-epoch of one repeat, measured against its replay (prefill included, at the fit's c_prefill).
    `measured_steps` from the step profile, None without one."""

    arm: str
    repeat: int
    epoch: int
    measured_s: float
    simulated_s: float
    simulated_passes: int
    measured_steps: int | None
    simulated_accepted: int
    measured_accepted: int | None

    @property
    def ratio(self) -> float:
        return self.simulated_s / self.measured_s

    @property
    def error(self) -> float:
        """Signed relative error of the simulated makespan: positive where the simulator is too slow."""
        return self.ratio - 1.0


@dataclass
class Validation:
    """Every arm-epoch the simulator can model, and per arm the median |error| over its epochs (and repeats)
    against GOAL."""

    rollouts: str
    costs: dict[str, dict[str, Any]]  # "<arm>/r<repeat>" -> the cost fit replayed and where it came from
    checks: list[EpochCheck] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # arms the simulator cannot model

    GOAL: ClassVar[float] = 0.15

    def median_error(self, arm: str) -> float:
        return float(np.median([abs(c.error) for c in self.checks if c.arm == arm]))

    def arms(self) -> list[str]:
        return list(dict.fromkeys(c.arm for c in self.checks))

    def to_dict(self) -> dict[str, Any]:
        return {"simulated": True, "rollouts": self.rollouts, "goal": self.GOAL, "costs": self.costs,
                "skipped": self.skipped,
                "checks": [{**asdict(c), "ratio": round(c.ratio, 4), "error": round(c.error, 4)}
                           for c in self.checks],
                "median_abs_error": {a: round(self.median_error(a), 4) for a in self.arms()},
                "met": {a: self.median_error(a) <= self.GOAL for a in self.arms()}}

    def print(self, console: Any) -> None:
        columns = ("arm", "repeat", "epoch", "measured s", "SIMULATED s", "sim / measured", "steps measured",
                   "passes SIMULATED", "accepted measured", "accepted SIMULATED")
        rows = [[c.arm, str(c.repeat), str(c.epoch), f"{c.measured_s:.2f}", f"{c.simulated_s:.2f}",
                 f"{c.ratio:.3f}", _fmt(c.measured_steps, "{}"), str(c.simulated_passes),
                 _fmt(c.measured_accepted, "{}"), str(c.simulated_accepted)] for c in self.checks]
        console.print(_rich_table(f"SIMULATED against measured makespan: {self.rollouts}", columns, rows))
        for arm in self.arms():
            error = self.median_error(arm)
            console.print(f"{arm}: median |SIMULATED / measured - 1| {error:.1%} "
                          f"({'within' if error <= self.GOAL else 'outside'} {self.GOAL:.0%})")
        for key, cost in self.costs.items():
            fit = f", {cost['steps']} steps, fit error {cost['fit_error']:.1%}" if cost.get("fit_error") else ""
            console.print(f"{key} replayed under ({cost['source']}): c_base {cost['c_base_s'] * 1e3:.1f} ms, "
                          f"c_tok {cost['c_tok_s'] * 1e3:.3f} ms/token, c_spec {cost['c_spec_s'] * 1e3:.1f} ms "
                          f"+ {cost.get('c_spec_req_s', 0.0) * 1e3:.2f} ms/request, "
                          f"c_prefill {_prefill_ms(cost)}{fit}")
        if self.skipped:
            console.print(f"not modelled by the simulator: {', '.join(self.skipped)}")


def _prefill_ms(cost: dict[str, Any]) -> str:
    price = cost.get("c_prefill_s")
    return "as c_tok (not measured)" if price is None else f"{price * 1e3:.3f} ms/token"


CostSource = Literal["profile", "live"]


def profile_cost(profiles: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The run's step cost model from its step profiles (`StepProfile.cost_*`, one per epoch): the mean of the
    per-epoch fits, each coefficient clipped at 0; None without a profile or where an epoch has no fit. It is fitted
    to the same steps the replay is compared with, so a replay under it checks the schedule and pass model given
    the step costs (and the cost model's linear shape), not the cost estimate itself."""
    if not profiles or any(p.get("cost_base_ms") is None or p.get("cost_ms_per_token") is None for p in profiles):
        return None

    def mean_s(key: str) -> float | None:
        values = [p[key] for p in profiles if p.get(key) is not None]
        return max(float(np.mean(values)), 0.0) / 1e3 if values else None

    return {"c_base_s": mean_s("cost_base_ms"), "c_tok_s": mean_s("cost_ms_per_token"),
            "c_spec_s": mean_s("cost_spec_ms") or 0.0, "c_prefill_s": mean_s("cost_ms_per_prompt_token"),
            "steps": sum(int(p["steps"]) for p in profiles)}


def validate_rollouts(path: str | os.PathLike[str], window: int = 4, cost_source: CostSource = "profile"
                      ) -> Validation:
    """Replays each (arm, repeat) of a `das bench e2e --rollouts-out` file epoch by epoch, one batch per epoch on
    the run's engines, and sets the simulated makespans against the measured ones. Under `cost_source` "profile":
    the arm's own step cost fit from its step profile (`profile_cost`; runs with `--profile`), else the das
    engine's live fit at the end of its epochs (the `none` arm has none and takes the das arm's); "live": always the
    live fit. ValueError when the file has no run the simulator can model."""
    from das.drafter.records import load_rollouts
    from das.scheduler.cost_model import CostModel
    from das.scheduler.simulator import replay_versions

    sidecar = RolloutsSidecar.load(path)
    records = load_rollouts(path)
    result = Validation(str(path), {})
    for run in sidecar.runs:
        policy = simulated_arm(run.arm, sidecar.num_speculative_tokens)
        fitted = profile_cost(run.profile) if cost_source == "profile" else None
        costs = ({**fitted, "source": "its step profile's fit"} if fitted is not None
                 else {**run.cost, "source": run.cost_source} if run.cost is not None else None)
        if policy is None or costs is None:
            result.skipped.append(f"{run.arm} (r{run.repeat})" + ("" if policy else ": vLLM's drafter")
                                  + (": no cost fit" if costs is None else ""))
            continue
        prefix = rollout_tag(run.arm, run.repeat - 1, "")
        mine = [r for r in records if r.problem_id.startswith(prefix)]
        prefill = costs.get("c_prefill_s")
        cost = CostModel(f"{run.arm}/r{run.repeat} {costs['source']}", float(costs["c_base_s"]),
                         float(costs["c_tok_s"]), str(costs["source"]), c_spec_s=float(costs.get("c_spec_s", 0)),
                         c_prefill_s=None if prefill is None else float(prefill),
                         c_spec_req_s=float(costs.get("c_spec_req_s", 0)))
        result.costs[f"{run.arm}/r{run.repeat}"] = costs
        for batch in replay_versions(mine, cost, policy, sidecar.engines, sidecar.num_speculative_tokens, window):
            e = batch.version
            result.checks.append(EpochCheck(
                run.arm, run.repeat, e + 1, run.makespan_s[e], batch.makespan_s, batch.forward_passes,
                run.profile[e]["steps"] if run.profile else None, batch.accepted_tokens,
                run.accepted_tokens[e] if run.accepted_tokens else None))
    if not result.checks:
        raise ValueError(f"{path}: no arm the simulator can model (none, none-service, das, das-uniform, "
                         f"das-service) with a cost fit")
    return result
