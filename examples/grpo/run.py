"""GRPO on SmolLM2-135M-Instruct with TRL's GRPOTrainer, rollouts from the service: once against `das serve` (DAS,
the default) and once against `das serve --speculation none`, with the same seeds, then the comparison.

    .venv/bin/python -m examples.grpo.run      # TRL 1.16.0 comes with setup.sh

Per arm it starts the service (its log in OUT/<arm>/serve.log), trains `--steps` optimizer steps (each: one
rollout of `--prompts` problems x `--samples` samples through the official openai client, TRL's group-relative
advantages and clipped policy-gradient loss, an AdamW step, the weights pushed to the service as the next policy
version), writes one JSON line per step to OUT/<arm>/steps.jsonl and every sample to OUT/<arm>/rollouts.jsonl.gz
(the trace format) and stops the service. Then `report.py` writes OUT/summary.json and OUT/grpo.png and prints the
comparison. README.md here says what the task is and why.

An arm is the service's speculation (`das`, `none`), optionally with `-coupled`: each problem's rollouts carry one
seed for the whole run (`ServiceConfig.coupled`), so sample i of a problem repeats its previous visit's sample up to
the first token the updates flip (`das bench coupled` measures how far).

`--overlap` generates step t+1 while step t trains (rollout.py, `ServiceRollout.prefetch`): one step off-policy,
each sample with its policy version; steps.jsonl's `step_s` against `rollout.wait_s` shows what it saves.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console

from examples.grpo.report import compare
from examples.grpo.rewards import Rewards
from examples.grpo.rollout import ServiceConfig, ServiceRollout, WeightPush, WeightSync, trl_generation_batches

console = Console(soft_wrap=True)  # one line per step, also in a log file
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is TRL's experimental hook; we know
app = typer.Typer(add_completion=False)
TOKEN = "grpo-example-token"
REWARD_WEIGHTS = (1.0, 0.5)  # correct, formatted: a right answer counts most; its readable form helps


ARMS = ("das", "none", "das-coupled", "none-coupled")
COUPLED = "-coupled"


SYNCS = ("checkpoint", "push")


def start_service(arm: str, port: int, weights_root: Path, log_path: Path, timeout_s: float,
                  sync: str = "checkpoint") -> subprocess.Popen:
    """`das serve` for one arm, in a process group of its own; returns once /readyz answers 200. Served in float32
    (the trainer's dtype): keyed sampling then gives the two arms the same samples from the same weights, which in
    bfloat16 they would share only in distribution (docs/design.md, keyed sampling)."""
    das = Path(sys.executable).with_name("das")
    command = [str(das), "serve", "--port", str(port), "--speculation", arm.removesuffix(COUPLED),
               "--weights-root", str(weights_root),
               "--dtype", "float32", "--weight-transfer", "gloo" if sync == "push" else "none"]
    log = log_path.open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               env={**os.environ, "DAS_TOKEN": TOKEN})
    deadline = time.monotonic() + timeout_s
    with console.status(f"[{arm}] das serve starting (log: {log_path})"):
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"das serve exited with {process.returncode}; see {log_path}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200:
                    return process
            except httpx.TransportError:
                pass
            time.sleep(2)
    stop_service(process)
    raise RuntimeError(f"das serve not ready after {timeout_s:.0f} s; see {log_path}")


def stop_service(process: subprocess.Popen) -> None:
    """SIGINT to the whole group, as Ctrl-C would (das serve shuts Ray down in order); SIGKILL after 120 s."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def train_arm(arm: str, out: Path, *, steps: int, prompts: int, samples: int, problems: int, max_tokens: int,
              learning_rate: float, seed: int, port: int, sync_mode: str = "checkpoint",
              overlap: bool = False) -> None:
    """One arm: the service up, `steps` GRPO steps, the service down. Writes OUT/<arm>/steps.jsonl and
    OUT/<arm>/rollouts.jsonl.gz."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from das.drafter.records import RolloutRecord, write_rollouts
    from das.service.client.prompt_sets import reasoning_gym_problems
    from das.service.engine.vllm.models import prepare_model

    arm_dir = out / arm
    weights_root = arm_dir / "weights"
    weights_root.mkdir(parents=True, exist_ok=True)
    problem_set = reasoning_gym_problems(problems)
    dataset = Dataset.from_list([{"prompt": list(p.messages), "problem_id": p.problem_id} for p in problem_set])
    model_dir = prepare_model("smollm2")
    service = ServiceConfig(url=f"http://127.0.0.1:{port}", token=TOKEN, max_tokens=max_tokens, temperature=1.0,
                            seed=seed, coupled=arm.endswith(COUPLED))
    rollout = ServiceRollout(service)
    sync = WeightPush(service) if sync_mode == "push" else WeightSync(service, weights_root)
    steps_path = arm_dir / "steps.jsonl"
    steps_path.unlink(missing_ok=True)

    class StepLog(TrainerCallback):
        """One JSON line and one console line per optimizer step: TRL's logged figures with the step's rollout
        and weight push. `step_s`: wall seconds since the previous step's line (the first: since training began),
        rollout, training and push included; `policy_lag`: versions between the policy trained (step - 1) and the
        oldest one sampled (0 on-policy, 1 overlapped)."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._last = time.perf_counter()

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
                   **kwargs: Any) -> None:
            if not logs or "reward" not in logs:
                return
            now = time.perf_counter()
            step_s, self._last = now - self._last, now
            step = int(state.global_step)
            rollout_step = rollout.steps[-1].as_dict()
            record = {"arm": arm, "step": step, "sync_mode": sync_mode, "overlap": overlap, "step_s": step_s,
                      "policy_lag": step - 1 - min(rollout_step["policy_versions"]),
                      **{k: v for k, v in logs.items() if isinstance(v, (int, float))},
                      "rollout": rollout_step, "sync": sync.reloads[-1]}
            with steps_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            r = record["rollout"]
            console.print(
                f"[{arm}] step {step:>3}: reward {logs['reward']:.3f} (correct "
                f"{logs.get('rewards/correct/mean', float('nan')):.3f}, formatted "
                f"{logs.get('rewards/formatted/mean', float('nan')):.3f}), mean length "
                f"{logs.get('completions/mean_length', float('nan')):.0f}; rollout {r['seconds']:.1f} s, "
                f"{r['completion_tokens'] / r['seconds']:.0f} tok/s, longest {r['longest_tokens']}, drafts "
                f"{r['accepted_tokens']}/{r['draft_tokens']} accepted, policy {r['policy_versions']} (lag "
                f"{record['policy_lag']}{', prefetched' if r['prefetched'] else ''}); pushed "
                f"v{record['sync']['policy_version']} in {record['sync']['reload_s']:.1f} s; step {step_s:.1f} s, "
                f"{r['wait_s']:.1f} s of it waiting for rollouts")

    config = GRPOConfig(
        output_dir=str(arm_dir / "trainer"), max_steps=steps, per_device_train_batch_size=prompts * samples,
        num_generations=samples, max_completion_length=max_tokens, temperature=1.0, learning_rate=learning_rate,
        beta=0.0, reward_weights=list(REWARD_WEIGHTS), logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, bf16=False, gradient_checkpointing=False, seed=seed, data_seed=seed, dataloader_num_workers=0,
        disable_tqdm=False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # Eager attention: on the CPU, SDPA pays a first-call cost for every new sequence length (each step has its
    # own), several times the step's own compute here.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32", attn_implementation="eager")
    rewards = Rewards(problem_set)
    process = start_service(arm, port, weights_root, arm_dir / "serve.log", timeout_s=900, sync=sync_mode)
    try:
        trainer = GRPOTrainer(model=model, reward_funcs=[rewards.correct, rewards.formatted], args=config,
                              train_dataset=dataset, processing_class=tokenizer, rollout_func=rollout,
                              callbacks=[rollout, sync, StepLog()])  # the rollout's on_step_end before the push
        if overlap:
            rollout.prefetch(trl_generation_batches(trainer))
        trainer.train()
    finally:
        stop_service(process)
        write_rollouts(arm_dir / "rollouts.jsonl.gz", (RolloutRecord(**r) for r in rollout.records))


@app.command()
def main(
    out: Annotated[Path, typer.Option(help="Where each arm's steps.jsonl and the report go.")] = Path("runs/grpo"),
    arms: Annotated[str, typer.Option(help="Comma-separated: das, none (the service's --speculation), each with "
                                           "-coupled for one seed per problem for the whole run.")] = "das,none",
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps per arm.")] = 10,
    prompts: Annotated[int, typer.Option(min=1, help="Problems per step.")] = 4,
    samples: Annotated[int, typer.Option(min=2, help="Samples per problem (GRPO's group).")] = 4,
    problems: Annotated[int, typer.Option(min=1, help="Distinct problems; each comes back every "
                                                      "problems/prompts steps.")] = 8,
    max_tokens: Annotated[int, typer.Option(min=8, help="Completion length cap.")] = 128,
    learning_rate: Annotated[float, typer.Option(min=0.0)] = 5e-5,
    seed: Annotated[int, typer.Option(help="Trainer, data and rollout seed: every rollout request carries a "
                                           "seed of (seed, step, request), so under keyed sampling both arms "
                                           "draw the same samples from the same weights.")] = 0,
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8011,
    sync: Annotated[str, typer.Option(help="How each step's weights reach the service: checkpoint (saved under "
                                           "its --weights-root, POST /update_weights) or push (vLLM's weight "
                                           "transfer over gloo, no disk).")] = "checkpoint",
    overlap: Annotated[bool, typer.Option(help="Generate step t+1 while step t trains (one step off-policy; "
                                               "each sample carries its policy version).")] = False,
) -> None:
    """Train both arms, then compare them (report.py)."""
    names = [a.strip() for a in arms.split(",") if a.strip()]
    if not names or any(a not in ARMS for a in names):
        raise typer.BadParameter(f"arms must be among {', '.join(ARMS)}, got {arms!r}", param_hint="--arms")
    if sync not in SYNCS:
        raise typer.BadParameter(f"sync must be one of {', '.join(SYNCS)}, got {sync!r}", param_hint="--sync")
    for arm in names:
        train_arm(arm, out, steps=steps, prompts=prompts, samples=samples, problems=problems,
                  max_tokens=max_tokens, learning_rate=learning_rate, seed=seed, port=port, sync_mode=sync,
                  overlap=overlap)
    compare(out, names, console)


if __name__ == "__main__":
    app()
