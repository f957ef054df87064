"""The trained policies scored on fresh draws: what each arm learnt, apart from the samples it trained on.

A GRPO step's reward is measured on the samples it trains on. With coupled epochs (the `-coupled` arms) those
samples draw from the same noise at every visit of a problem, and the updates raise exactly the draws that scored:
under the same noise a rewarded sample comes back, a punished one changes. So a coupled arm's training reward is
measured on noise the policy was fitted to, and can rise faster than the policy's expected reward does. This scores
every run's final policy (OUT/<arm>/weights/step-N, the last checkpoint `WeightSync` keeps) and the starting model
on draws no arm trained on: each problem sampled `--samples` times with an evaluation seed (OpenAI `seed`, a function
of `--seed` and the problem) that is the same for every policy, so the policies are compared on the same noise.

    .venv/bin/python -m examples.grpo.evaluate --runs runs/coupled/seed0,runs/coupled/seed1 --arms das-coupled,das

One `das serve --speculation none` in float32 serves every policy in turn (`/update_weights` to each checkpoint,
its version one more than the last). Writes OUT/evaluation.json; prints each policy's mean reward (the training's
weights: correct + 0.5 formatted) and, for the two arms, the difference with two sign-flip tests (`report.py`): over
the runs (independent; 0.25 at the least with 3 runs) and over (run, problem) pairs.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Annotated, Any

import httpx
import numpy as np
import typer
from openai import AsyncOpenAI
from rich.console import Console
from rich.table import Table

from das.service.client.prompt_sets import Problem, reasoning_gym_problems
from das.service.wire.sample_keys import derive
from examples.grpo.report import paired_sign_flip_p
from examples.grpo.rewards import Rewards
from examples.grpo.rollout import ServiceConfig
from examples.grpo.run import REWARD_WEIGHTS, TOKEN, start_service, stop_service

console = Console(soft_wrap=True)
BASE = "base"  # the starting model's name among the policies


def final_checkpoint(arm_dir: Path) -> Path:
    """The last checkpoint an arm kept (OUT/<arm>/weights/step-N, the highest N)."""
    steps = sorted((arm_dir / "weights").glob("step-*"))
    if not steps:
        raise FileNotFoundError(f"{arm_dir}: no weights/step-* checkpoint (trained with --sync push?)")
    return steps[-1]


async def _sample(url: str, problems: list[Problem], samples: int, max_tokens: int, seed: int) -> list[list[str]]:
    """Every problem's `samples` completions at T = 1, the problem's evaluation seed derive(seed, its index)."""
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key=TOKEN, timeout=1800, max_retries=2) as client:
        answers = await asyncio.gather(*(
            client.chat.completions.create(model=ServiceConfig.model, messages=list(p.messages), n=samples,
                                           max_tokens=max_tokens, temperature=1.0, seed=derive(seed, i))
            for i, p in enumerate(problems)))
    return [[c.message.content or "" for c in sorted(a.choices, key=lambda c: c.index)] for a in answers]


def score(problems: list[Problem], completions: list[list[str]]) -> dict[str, Any]:
    """Mean reward (the training's weights), correct and formatted, overall and per problem."""
    rewards = Rewards(problems)
    per_problem = []
    for problem, texts in zip(problems, completions, strict=True):
        correct = np.array(rewards.correct(texts, [problem.problem_id] * len(texts)))
        formatted = np.array(rewards.formatted(texts))
        per_problem.append({"reward": float(np.mean(REWARD_WEIGHTS[0] * correct + REWARD_WEIGHTS[1] * formatted)),
                            "correct": float(correct.mean()), "formatted": float(formatted.mean())})
    return {"reward": float(np.mean([p["reward"] for p in per_problem])),
            "correct": float(np.mean([p["correct"] for p in per_problem])),
            "formatted": float(np.mean([p["formatted"] for p in per_problem])),
            "per_problem": per_problem}


def compare_arms(scores: dict[str, dict[str, Any]], runs: list[Path], arms: tuple[str, str]) -> dict[str, Any]:
    """The two arms' evaluation rewards, first - second: per run, and per (run, problem)."""
    first, second = arms
    per_run = np.array([scores[f"{r}/{first}"]["reward"] - scores[f"{r}/{second}"]["reward"] for r in runs])
    pairs = np.array([a["reward"] - b["reward"] for r in runs
                      for a, b in zip(scores[f"{r}/{first}"]["per_problem"], scores[f"{r}/{second}"]["per_problem"])])
    return {"difference": f"{first} - {second}", "per_run": per_run.tolist(), "mean": float(per_run.mean()),
            "run_sign_flip_p": paired_sign_flip_p(per_run), "pairs": len(pairs),
            "pair_sign_flip_p": paired_sign_flip_p(pairs)}


def main(
    runs: Annotated[str, typer.Option(help="Runs of run.py, comma-separated (one seed each).")],
    arms: Annotated[str, typer.Option(help="The two arms to score, comma-separated: first - second.")] =
        "das-coupled,das",
    samples: Annotated[int, typer.Option(min=1, help="Draws per problem per policy.")] = 32,
    problems: Annotated[int, typer.Option(min=1, help="Problems (the runs' --problems).")] = 8,
    max_tokens: Annotated[int, typer.Option(min=8, help="Completion cap (the runs' --max-tokens).")] = 128,
    seed: Annotated[int, typer.Option(help="Evaluation seed: the same draws' noise for every policy.")] = 1_000_003,
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8041,
    out: Annotated[Path, typer.Option(help="Where evaluation.json goes.")] = Path("runs/grpo-evaluation"),
) -> None:
    """Scores the starting model and every run's two arms' final policies on fresh draws (module docstring)."""
    names = tuple(a.strip() for a in arms.split(",") if a.strip())
    if len(names) != 2:
        raise typer.BadParameter(f"--arms takes two arms, got {arms!r}", param_hint="--arms")
    run_dirs = [Path(r.strip()).resolve() for r in runs.split(",") if r.strip()]
    checkpoints = {f"{r}/{arm}": final_checkpoint(r / arm) for r in run_dirs for arm in names}
    root = Path(os.path.commonpath([str(p) for p in checkpoints.values()]))  # the service's --weights-root
    problem_set = reasoning_gym_problems(problems)
    out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    scores: dict[str, dict[str, Any]] = {}
    process = start_service("none", port, root, out / "serve.log", timeout_s=900)
    try:
        for version, (name, path) in enumerate([(BASE, None), *checkpoints.items()]):
            if path is not None:
                response = httpx.post(f"{url}/update_weights", json={"path": str(path), "version": version},
                                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=900)
                if response.status_code != 200:
                    raise RuntimeError(f"/update_weights {path}: {response.status_code} {response.text}")
            completions = asyncio.run(_sample(url, problem_set, samples, max_tokens, seed))
            scores[name] = {"checkpoint": None if path is None else str(path), **score(problem_set, completions)}
            console.print(f"{name}: reward {scores[name]['reward']:.3f} (correct {scores[name]['correct']:.3f}, "
                          f"formatted {scores[name]['formatted']:.3f})")
    finally:
        stop_service(process)
    summary = {"samples": samples, "problems": problems, "max_tokens": max_tokens, "seed": seed, "policies": scores,
               "comparison": compare_arms(scores, run_dirs, (names[0], names[1]))}
    (out / "evaluation.json").write_text(json.dumps(summary, indent=2) + "\n")
    table = Table(title=f"final policies on fresh draws ({samples} a problem, {problems} problems, seed {seed})")
    for column in ("policy", "reward", "correct", "formatted"):
        table.add_column(column, justify="right")
    for name, s in scores.items():
        table.add_row(name, f"{s['reward']:.3f}", f"{s['correct']:.3f}", f"{s['formatted']:.3f}")
    console.print(table)
    c = summary["comparison"]
    console.print(f"{c['difference']}: per run {', '.join(f'{d:+.3f}' for d in c['per_run'])} (mean {c['mean']:+.3f}, "
                  f"sign-flip over runs p = {c['run_sign_flip_p']:.3f}; over {c['pairs']} (run, problem) pairs "
                  f"p = {c['pair_sign_flip_p']:.3f})")


if __name__ == "__main__":
    typer.run(main)
