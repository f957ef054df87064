"""The comparison of the GRPO example's arms: OUT/summary.json, OUT/grpo.png and a printed table.

The tests are stated here so the figures can be read without the code:
- Curves agree: a paired sign-flip permutation test on the per-step mean reward, das - none, step by step (same
  seeds, same problems each step). Under "the arms train alike" each step's difference is as likely + as -; the
  p-value is the share of the 2^n sign assignments (all of them up to n = 16, else 20,000 drawn) whose |mean| is
  at least the observed one. Agreement within noise: p >= 0.05.
- The reward moves: per arm, the least-squares slope of mean reward on step, with a permutation p-value (20,000
  shuffles of the step order): the share of shuffles with a slope at least as large (one-sided, reward rising).
  Both tests also per reward function (TRL's `rewards/<name>/mean`): a step's problems differ in difficulty, so
  one function's curve can move while the total is dominated by which problems the step drew.
- Rollout cost: each arm's rollout seconds summed over steps and their ratio das / none, the median of the per-step
  ratios, tokens per second, and seconds per token of the step's longest sample (a step's rollout ends with its
  longest sample, which differs between arms at T = 1).
- Seconds per step (checkpoint, push, overlapped: one run each, `--out` apart): each arm's median wall seconds a
  step and the median seconds of it the trainer waited for rollouts, with its sync mode and overlap.
- Across seeds (`python -m examples.grpo.report --runs OUT1,OUT2,... --arms A,B`, one run per seed): the mean
  reward curve of each arm over the seeds, and the difference A - B two ways. Per seed, the mean over its steps:
  a sign-flip test over the seeds (the unit that is independent; with n seeds its smallest p is 2 / 2^n, 0.25 at
  3). Per (seed, step) pair: the same test over every pair, which takes the steps of one run as exchangeable
  (they are not quite: a run's steps share its trajectory), so it is the sharper and the more optimistic of the two.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

DRAWS = 20_000


def read_steps(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def paired_sign_flip_p(differences: np.ndarray, seed: int = 0) -> float:
    """Two-sided p-value of a paired sign-flip permutation test of mean(differences) = 0 (module docstring)."""
    n = len(differences)
    observed = abs(differences.mean())
    if n <= 16:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=n)))
    else:
        signs = np.random.default_rng(seed).choice((1.0, -1.0), size=(DRAWS, n))
    return float(np.mean(np.abs(signs @ differences / n) >= observed - 1e-12))


def slope_permutation_p(values: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """(least-squares slope of values on 0..n-1, one-sided permutation p-value of a slope that large)."""
    x = np.arange(len(values), dtype=float)
    x -= x.mean()
    slope = float(x @ (values - values.mean()) / (x @ x))
    rng = np.random.default_rng(seed)
    shuffled = np.array([x @ rng.permutation(values) for _ in range(DRAWS)]) / (x @ x)
    return slope, float(np.mean(shuffled >= slope - 1e-12))


def _arm_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    rollouts = [s["rollout"] for s in steps]
    rewards = np.array([s["reward"] for s in steps])
    slope, slope_p = slope_permutation_p(rewards)
    versions = [r["policy_versions"] for r in rollouts]
    by_source: dict[str, dict[str, int]] = {}
    for r in rollouts:
        for source, counts in r["drafts_by_source"].items():
            total = by_source.setdefault(source, {"proposed": 0, "accepted": 0})
            for kind in total:
                total[kind] += counts.get(kind, 0)
    seconds = sum(r["seconds"] for r in rollouts)
    tokens = sum(r["completion_tokens"] for r in rollouts)
    components = sorted({k.split("/")[1] for s in steps for k in s if k.startswith("rewards/") and k.endswith("/mean")})
    by_component = {}
    for name in components:
        values = np.array([s[f"rewards/{name}/mean"] for s in steps])
        component_slope, component_p = slope_permutation_p(values)
        by_component[name] = {"mean": values.tolist(), "slope_per_step": component_slope, "slope_p": component_p}
    return {
        "steps": len(steps),
        "reward": rewards.tolist(),
        "rewards_by_function": by_component,
        "reward_first_half": float(rewards[: len(rewards) // 2].mean()),
        "reward_second_half": float(rewards[len(rewards) // 2:].mean()),
        "reward_slope_per_step": slope, "reward_slope_p": slope_p,
        "policy_versions": versions,
        "policy_version_advances_every_step": all(
            len(v) == 1 and v[0] == i for i, v in enumerate(versions)),
        "rollout_seconds": [r["seconds"] for r in rollouts], "rollout_seconds_total": seconds,
        "tokens_per_s": tokens / seconds,
        "seconds_per_longest_token": float(np.median([r["seconds"] / r["longest_tokens"] for r in rollouts])),
        "draft_tokens": sum(r["draft_tokens"] for r in rollouts),
        "accepted_tokens": sum(r["accepted_tokens"] for r in rollouts),
        "drafts_by_source": by_source,
        "accepted_from_earlier_policies": sum(c["accepted"] for s, c in by_source.items()
                                              if s.startswith("sealed-age-")),
        "weight_push_seconds": [s["sync"]["reload_s"] for s in steps],
        "step_seconds": [s["step_s"] for s in steps if "step_s" in s],
        "rollout_wait_seconds": [s["rollout"]["wait_s"] for s in steps if "wait_s" in s["rollout"]],
        "sync_mode": steps[0].get("sync_mode"), "overlap": steps[0].get("overlap"),
    }


def compare(out: Path, arms: list[str], console: Console) -> dict[str, Any]:
    """Reads OUT/<arm>/steps.jsonl for each arm; writes OUT/summary.json and OUT/grpo.png; returns the summary."""
    steps = {arm: read_steps(out / arm / "steps.jsonl") for arm in arms}
    summary: dict[str, Any] = {"arms": {arm: _arm_summary(s) for arm, s in steps.items()}}
    if "das" in steps and "none" in steps:
        n = min(len(steps["das"]), len(steps["none"]))
        das, none = summary["arms"]["das"], summary["arms"]["none"]
        differences = np.array(das["reward"][:n]) - np.array(none["reward"][:n])
        per_step = np.array(das["rollout_seconds"][:n]) / np.array(none["rollout_seconds"][:n])
        summary["paired"] = {
            "steps": n, "reward_difference_mean": float(differences.mean()),
            "reward_difference_sd": float(differences.std(ddof=1)) if n > 1 else 0.0,
            "sign_flip_p": paired_sign_flip_p(differences),
            "sign_flip_p_by_function": {
                name: paired_sign_flip_p(np.array(das["rewards_by_function"][name]["mean"][:n])
                                         - np.array(none["rewards_by_function"][name]["mean"][:n]))
                for name in das["rewards_by_function"] if name in none["rewards_by_function"]},
            "rollout_seconds_ratio": das["rollout_seconds_total"] / none["rollout_seconds_total"],
            "rollout_seconds_ratio_median_per_step": float(np.median(per_step)),
            "tokens_per_s_ratio": das["tokens_per_s"] / none["tokens_per_s"],
            "seconds_per_longest_token_ratio": das["seconds_per_longest_token"] / none["seconds_per_longest_token"],
        }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(summary, out / "grpo.png")
    _print(summary, console)
    return summary


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (reward, seconds, sources) = plt.subplots(1, 3, figsize=(15, 4.2))
    for arm, s in summary["arms"].items():
        x = np.arange(1, s["steps"] + 1)
        reward.plot(x, s["reward"], marker="o", label=arm)
        seconds.plot(x, s["rollout_seconds"], marker="o", label=arm)
    reward.set(title="mean reward per step", xlabel="optimizer step", ylabel="reward")
    seconds.set(title="rollout seconds per step", xlabel="optimizer step", ylabel="s")
    reward.legend()
    seconds.legend()
    das = summary["arms"].get("das")
    if das and das["drafts_by_source"]:
        names = sorted(das["drafts_by_source"])
        proposed = [das["drafts_by_source"][k]["proposed"] for k in names]
        accepted = [das["drafts_by_source"][k]["accepted"] for k in names]
        at = np.arange(len(names))
        sources.bar(at - 0.2, proposed, 0.4, label="proposed")
        sources.bar(at + 0.2, accepted, 0.4, label="accepted")
        sources.set_xticks(at, names, rotation=30)
        sources.legend()
    sources.set(title="das: draft tokens by source", ylabel="tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare_seeds(runs: list[Path], arms: tuple[str, str], out: Path, console: Console) -> dict[str, Any]:
    """Reads RUN/<arm>/steps.jsonl for both arms of every run (one seed each); writes OUT/seeds.json and
    OUT/seeds.png; returns the summary (module docstring). Each run's arms are cut to their common steps."""
    first, second = arms
    per_run = []
    for run in runs:
        a, b = (np.array([s["reward"] for s in read_steps(run / arm / "steps.jsonl")]) for arm in arms)
        n = min(len(a), len(b))
        if n == 0:
            raise ValueError(f"{run}: no steps in both arms")
        per_run.append((run, a[:n], b[:n]))
    steps = min(len(a) for _, a, _ in per_run)
    curves = {arm: np.array([r[i + 1][:steps] for r in per_run]) for i, arm in enumerate(arms)}
    seed_differences = np.array([a.mean() - b.mean() for _, a, b in per_run])
    pair_differences = np.concatenate([a - b for _, a, b in per_run])
    summary: dict[str, Any] = {
        "arms": list(arms), "runs": [str(r) for r, _, _ in per_run], "steps": steps,
        "mean_curve": {arm: c.mean(axis=0).tolist() for arm, c in curves.items()},
        "per_run_mean_reward": {arm: [float(r[i + 1].mean()) for r in per_run] for i, arm in enumerate(arms)},
        "per_run_slope": {arm: [slope_permutation_p(r[i + 1])[0] for r in per_run] for i, arm in enumerate(arms)},
        "difference": f"{first} - {second}",
        "seed_difference_mean": float(seed_differences.mean()),
        "seed_differences": seed_differences.tolist(),
        "seed_sign_flip_p": paired_sign_flip_p(seed_differences),
        "pair_difference_mean": float(pair_differences.mean()),
        "pair_difference_sd": float(pair_differences.std(ddof=1)) if len(pair_differences) > 1 else 0.0,
        "pair_sign_flip_p": paired_sign_flip_p(pair_differences),
        "pairs": len(pair_differences),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "seeds.json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot_seeds(curves, out / "seeds.png")
    table = Table(title=f"GRPO across {len(per_run)} seeds: {first} against {second}")
    for column in ("arm", "mean reward per seed", "slope per seed", "mean curve, first -> last step"):
        table.add_column(column, justify="right")
    for arm in arms:
        curve = summary["mean_curve"][arm]
        table.add_row(arm, " / ".join(f"{v:.3f}" for v in summary["per_run_mean_reward"][arm]),
                      " / ".join(f"{v:+.4f}" for v in summary["per_run_slope"][arm]),
                      f"{curve[0]:.3f} -> {curve[-1]:.3f}")
    console.print(table)
    console.print(f"{first} - {second}: per seed {summary['seed_difference_mean']:+.4f} (sign-flip over "
                  f"{len(per_run)} seeds p = {summary['seed_sign_flip_p']:.3f}); per (seed, step) "
                  f"{summary['pair_difference_mean']:+.4f} (sd {summary['pair_difference_sd']:.3f}, "
                  f"{summary['pairs']} pairs, p = {summary['pair_sign_flip_p']:.3f})")
    return summary


def _plot_seeds(curves: dict[str, np.ndarray], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for (arm, runs), color in zip(curves.items(), ("tab:blue", "tab:orange")):
        x = np.arange(1, runs.shape[1] + 1)
        for run in runs:
            ax.plot(x, run, color=color, alpha=0.3, linewidth=1)
        ax.plot(x, runs.mean(axis=0), color=color, marker="o", linewidth=2, label=f"{arm} (mean of {len(runs)})")
    ax.set(title="mean reward per step, each seed and their mean", xlabel="optimizer step", ylabel="reward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(
    runs: Annotated[str, typer.Option(help="The runs to compare, comma-separated: each an --out of run.py, one "
                                           "seed each.")],
    arms: Annotated[str, typer.Option(help="The two arms, comma-separated: first - second.")] = "das-coupled,das",
    out: Annotated[Path, typer.Option(help="Where seeds.json and seeds.png go.")] = Path("runs/grpo-seeds"),
) -> None:
    """Compares two arms over runs of several seeds (module docstring)."""
    names = tuple(a.strip() for a in arms.split(",") if a.strip())
    if len(names) != 2:
        raise typer.BadParameter(f"--arms takes two arms, got {arms!r}")
    compare_seeds([Path(r.strip()) for r in runs.split(",") if r.strip()], (names[0], names[1]), out, Console())


def _print(summary: dict[str, Any], console: Console) -> None:
    table = Table(title="GRPO through the rollout service")
    for column in ("arm", "reward 1st / 2nd half", "slope (p)", "versions advance", "rollout s", "tok/s",
                   "accepted / drafted", "from earlier policies"):
        table.add_column(column, justify="right")
    for arm, s in summary["arms"].items():
        table.add_row(arm, f"{s['reward_first_half']:.3f} / {s['reward_second_half']:.3f}",
                      f"{s['reward_slope_per_step']:+.4f} ({s['reward_slope_p']:.3f})",
                      str(s["policy_version_advances_every_step"]), f"{s['rollout_seconds_total']:.1f}",
                      f"{s['tokens_per_s']:.1f}", f"{s['accepted_tokens']} / {s['draft_tokens']}",
                      str(s["accepted_from_earlier_policies"]))
    console.print(table)
    for arm, s in summary["arms"].items():
        if s["step_seconds"]:  # steps.jsonl written before step_s was recorded have none
            console.print(f"{arm} ({s['sync_mode']}{', overlapped' if s['overlap'] else ''}): "
                          f"{float(np.median(s['step_seconds'])):.1f} s a step (median), "
                          f"{float(np.median(s['rollout_wait_seconds'])):.1f} s of it waiting for rollouts")
        for name, c in s["rewards_by_function"].items():
            console.print(f"{arm} {name}: {c['mean'][0]:.3f} -> {c['mean'][-1]:.3f}, slope "
                          f"{c['slope_per_step']:+.4f}/step (p = {c['slope_p']:.4f})")
    if "paired" in summary:
        p = summary["paired"]
        console.print(f"paired over {p['steps']} steps: reward das - none {p['reward_difference_mean']:+.3f} "
                      f"(sd {p['reward_difference_sd']:.3f}), sign-flip p = {p['sign_flip_p']:.3f} ("
                      + ", ".join(f"{k} {v:.3f}" for k, v in p["sign_flip_p_by_function"].items()) + "); rollout "
                      f"seconds das / none {p['rollout_seconds_ratio']:.3f} (median per step "
                      f"{p['rollout_seconds_ratio_median_per_step']:.3f}), tokens/s {p['tokens_per_s_ratio']:.3f}, "
                      f"seconds per longest token {p['seconds_per_longest_token_ratio']:.3f}")


if __name__ == "__main__":
    typer.run(main)
