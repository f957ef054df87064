"""The hooks that put TRL's GRPOTrainer on the rollout service: the official `openai` client for rollouts, and for
the weight sync either vLLM's `/update_weights` route with a checkpoint (nothing of ours on the trainer's side but
HTTP) or vLLM's weight transfer through our `WeightSender` (no checkpoint).

- `ServiceRollout` is GRPOTrainer's `rollout_func`. TRL hands it the step's prompts, each repeated
  `num_generations` times in a row (its RepeatSampler); every run of one prompt becomes one chat completion with
  `n` = the run's length, all sent at once, so the service runs them as one batch and the samples of a prompt as
  siblings. The service names the problem by a hash of the prompt, so a prompt that comes back in a later step
  drafts from its earlier rollouts with no id from the trainer. With `ServiceConfig.seed` each request carries
  OpenAI's `seed` (a function of the seed, the step and the request), so under the service's keyed sampling two
  runs with one seed draw the same samples whatever the speculation (served in float32; in bfloat16 the same
  distribution, not the same tokens). With `ServiceConfig.coupled` the seed is a function of the seed and the
  prompt alone: sample i of a problem draws from the same noise every time the problem comes back, so it repeats
  its previous visit's sample up to the first token the policy's updates flip (each visit's samples are still exact
  draws from the current policy; only their correlation across steps changes). It returns TRL's `prompt_ids`,
  `completion_ids` and `logprobs` (of the distribution sampled from), records what the step's rollout cost
  (`RolloutStep`) and keeps every sample in the trace format (`records`: `das bench simulate` and `das bench
  coupled` read them).
- Overlapped (`ServiceRollout.prefetch`, fed by `trl_generation_batches`): when TRL asks for step t's prompts, the
  rollout answers with the request it started for them during step t-1's training, and at once starts the request
  for step t+1's prompts in a background thread, so step t+1 is generated while step t trains: one step
  off-policy (step t+1's samples come from the policy before step t's update; each sample carries its version). As
  a TrainerCallback placed before the weight sync, it waits for that request at the end of the step, before the
  push (`on_step_end`).
- `WeightSync` is a TrainerCallback: after each optimizer step it saves the policy as safetensors under the
  service's weights root and POSTs `/update_weights {path, version}` (version = the optimizer steps taken: the
  service starts at 0), so the next rollout
  samples from the new policy; the previous checkpoint is deleted once the service has loaded the new one.
- `WeightPush` is the same callback without the disk: it pushes the policy's parameters over vLLM's weight
  transfer with `das.service.client.weights.WeightSender` (the one piece of ours on the trainer's side, torch
  only), the service started with `--weight-transfer gloo` (CPU engines; nccl on GPU ones).
- `draft_counts_by_source` reads the service's Prometheus counters of draft tokens by source (`sealed-age-<a>`:
  the rollouts of a policy `a` versions older than the one sampling).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import math
import shutil
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families
from transformers import TrainerCallback

from das.service.wire.sample_keys import derive

log = logging.getLogger(__name__)
DRAFT_METRICS = {"das_source_draft_tokens_proposed": "proposed", "das_source_draft_tokens_accepted": "accepted"}


@dataclass(frozen=True)
class ServiceConfig:
    """Where the service is and how to sample. `url`: the gateway's base URL (no /v1); `token`: its bearer token,
    or None without auth; `max_tokens` and `temperature` must match the trainer's (its loss divides the logits
    by the same temperature); `seed`: the rollouts' seed (None: the service draws fresh ones); `coupled`: one seed
    per problem for the whole run instead of one per step and request (module docstring)."""

    url: str
    token: str | None
    max_tokens: int
    temperature: float
    model: str = "das"
    timeout_s: float = 600.0
    seed: int | None = None
    coupled: bool = False

    def request_seed(self, step: int, request: int, prompt: Any) -> int | None:
        """OpenAI's `seed` of the step's request (0-based both) for `prompt` (its chat messages), in int64:
        distinct per (seed, step, request), or with `coupled` per (seed, problem), the same every step."""
        if self.seed is None:
            return None
        if self.coupled:
            return (self.seed * 1_000_003 + int(problem_key(prompt), 16)) % 2**63
        return ((self.seed * 1_000_003 + step) * 1_000_033 + request) % 2**63


def problem_key(prompt: Any) -> str:
    """A problem's name in the traces: 16 hex digits of the SHA-256 of its prompt (chat messages as canonical
    JSON), the same every step, as the service's own name for it is."""
    return hashlib.sha256(json.dumps(prompt, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class RolloutStep:
    """One step's rollout as the trainer saw it. `seconds`: wall time of the whole step's requests, first sent
    to last answered (overlapped: while the previous step trained); `longest_tokens`: the longest completion, which
    bounds the step's makespan. `wait_s`: seconds of the step the trainer spent blocked on rollouts (in the
    rollout function, and overlapped also at the step's end waiting for the next step's request before the push);
    `prefetched`: the samples come from a request started during the previous step; `spanning_samples`: samples
    whose tokens span a weight update (`policy_spans`; 0 unless the service was paused under "keep" for a push)."""

    samples: int
    seconds: float
    completion_tokens: int
    longest_tokens: int
    draft_tokens: int
    accepted_tokens: int
    policy_versions: list[int]
    drafts_by_source: dict[str, dict[str, int]] = field(default_factory=dict)
    wait_s: float = 0.0
    prefetched: bool = False
    spanning_samples: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def prompt_runs(prompts: Sequence[Any]) -> list[tuple[Any, int]]:
    """Consecutive equal prompts as (prompt, count), in order: TRL's layout of a step's groups."""
    runs: list[tuple[Any, int]] = []
    for prompt in prompts:
        if runs and runs[-1][0] == prompt:
            runs[-1] = (prompt, runs[-1][1] + 1)
        else:
            runs.append((prompt, 1))
    return runs


def trl_generation_batches(trainer: Any) -> Iterator[list[Any]]:
    """The prompts TRL 1.16's GRPOTrainer (one process, a map-style dataset, `max_steps` set) will hand its
    `rollout_func`, one list per call, in order, as many as it will make. Its order is its RepeatSampler's, and a
    fresh one from the trainer's own `_get_train_sampler` replays it: the sampler's generator is seeded once, at
    construction, and draws one permutation per epoch, as the trainer's dataloader iterates it once per epoch. The
    sampler yields each generation batch `steps_per_generation * num_iterations` times in a row (one per micro-step);
    TRL generates on the first and slices its buffer for the rest, so each is taken once. `ServiceRollout` checks
    every batch against what TRL asks for, so a drift from this costs time, never a wrong sample."""
    args = trainer.args
    if args.max_steps <= 0:
        raise ValueError("trl_generation_batches needs GRPOConfig.max_steps")
    sampler = trainer._get_train_sampler()
    size = args.generation_batch_size
    generate_every = args.steps_per_generation * trainer.num_iterations
    generations = math.ceil(args.max_steps * args.gradient_accumulation_steps / generate_every)

    def indices() -> Iterator[int]:
        while True:  # one epoch per pass, as the trainer's dataloader
            yield from sampler

    stream = indices()
    batches = (list(itertools.islice(stream, size)) for _ in itertools.count())
    for batch in itertools.islice(batches, 0, generations * generate_every, generate_every):
        yield [trainer.train_dataset[index]["prompt"] for index in batch]


def draft_counts_by_source(metrics_text: str) -> dict[str, dict[str, int]]:
    """`{source: {"proposed", "accepted"}}` summed over engines, from the service's /metrics text."""
    counts: dict[str, dict[str, int]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            kind = DRAFT_METRICS.get(sample.name.removesuffix("_total"))
            if kind is not None:
                by_kind = counts.setdefault(sample.labels["source"], {"proposed": 0, "accepted": 0})
                by_kind[kind] += int(sample.value)
    return counts


def counts_delta(after: dict[str, dict[str, int]], before: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {source: {kind: n - before.get(source, {}).get(kind, 0) for kind, n in by_kind.items()}
            for source, by_kind in after.items()}


@dataclass
class Generated:
    """One step's answers before TRL's shape: the step's (prompt, n) runs, one chat completion each, the seconds
    from first sent to last answered, and the draft tokens by source the service counted meanwhile."""

    runs: list[tuple[Any, int]]
    responses: list[Any]
    seconds: float
    drafts_by_source: dict[str, dict[str, int]]
    seeds: list[int | None]  # each run's OpenAI seed: choice i drew with key derive(seed, i)


class ServiceRollout(TrainerCallback):
    """GRPOTrainer's `rollout_func` over the service (module docstring), and a TrainerCallback for the overlap.
    `steps` grows by one per call; `records` by one per sample the trainer got, each a dict of the trace format's
    fields (das.drafter.records.RolloutRecord). At most one request (one step's completions) is in flight at a
    time, so the /metrics difference around it is its own."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.steps: list[RolloutStep] = []
        self.records: list[dict[str, Any]] = []
        self._headers = {"Authorization": f"Bearer {config.token}"} if config.token else {}
        self._upcoming: Iterator[list[Any]] | None = None
        self._pending: tuple[list[Any], Future[Generated]] | None = None
        self._executor: ThreadPoolExecutor | None = None

    def prefetch(self, batches: Iterable[list[Any]]) -> None:
        """Overlap: `batches` are the prompts the trainer will ask for, one list per call from its first call on
        (`trl_generation_batches`). From then on each call starts the request for the next batch before it returns,
        and the next call answers with it if the trainer asks for exactly those prompts; if not, the prefetched
        samples are dropped (logged) and the asked prompts are generated on demand.

        Weights: the request for step t+1 runs under the policy before step t's update, and `on_step_end` waits
        for it before the push that follows. The service is not paused for the push, deliberately: unpaused, a
        push (`/update_weights` or the sender's `/start_weight_update`) waits for running batches anyway, so every
        sample comes from one policy version, exactly one step behind the trainer. Pausing with "keep" would have
        samples span the update (`policy_spans`) and TRL's loss, with no per-token behaviour policy on this path,
        could not tell; "abort" would cut them. Waiting here rather than inside the push only makes that wait
        visible in `RolloutStep.wait_s`."""
        self._upcoming = itertools.islice(iter(batches), len(self.steps) + 1, None)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-prefetch")

    def __call__(self, prompts: list[Any], trainer: Any = None) -> dict[str, Any]:
        start = time.perf_counter()
        step = len(self.steps)
        generated = self._take_prefetched(prompts, step)
        prefetched = generated is not None
        if generated is None:
            generated = self._generate(prompts, step)
        if self._upcoming is not None and self._executor is not None:
            upcoming = next(self._upcoming, None)
            if upcoming is not None:
                self._pending = (upcoming, self._executor.submit(self._generate, upcoming, step + 1))
        out = self._answer(generated, prefetched)
        self.steps[-1].wait_s = time.perf_counter() - start
        return out

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Overlapped: waits for the next step's request before the weight push (`prefetch` says why); the wait
        counts in this step's `wait_s`. Must come before the weight sync among the trainer's callbacks."""
        if self._pending is not None:
            start = time.perf_counter()
            wait([self._pending[1]])
            self.steps[-1].wait_s += time.perf_counter() - start

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def _take_prefetched(self, prompts: list[Any], step: int) -> Generated | None:
        """The prefetched answers if they are for `prompts`, else None (logged). A mismatched request is waited for
        all the same, to keep one request in flight; its samples reach neither the trainer nor `records`."""
        if self._pending is None:
            return None
        expected, future = self._pending
        self._pending = None
        generated = future.result()
        if expected == prompts:
            return generated
        log.warning("rollout step %d: the trainer asked for other prompts than the prefetched ones; generating them "
                    "now (the prefetched samples are dropped)", step)
        return None

    def _generate(self, prompts: list[Any], step: int) -> Generated:
        before = self._draft_counts()
        start = time.perf_counter()
        runs = prompt_runs(prompts)
        responses = asyncio.run(self._complete(runs, step))
        seconds = time.perf_counter() - start
        return Generated(runs, responses, seconds, counts_delta(self._draft_counts(), before),
                         [self.config.request_seed(step, i, prompt) for i, (prompt, _) in enumerate(runs)])

    def _answer(self, generated: Generated, prefetched: bool) -> dict[str, Any]:
        """TRL's dict of the step's samples; appends the step's `RolloutStep` and its samples' `records`."""
        out: dict[str, list[Any]] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "policy_version": []}
        draft = accepted = spanning = 0
        for (prompt, _), response, seed in zip(generated.runs, generated.responses, generated.seeds):
            das = response.model_extra.get("das") or {}
            draft += das.get("draft_tokens", 0)
            accepted += das.get("accepted_tokens", 0)
            prompt_ids = response.model_extra.get("prompt_token_ids")
            if prompt_ids is None:  # TRL's loss needs the exact ids the samples were conditioned on
                raise RuntimeError("the service answered without prompt_token_ids (return_token_ids ignored?)")
            for choice in sorted(response.choices, key=lambda c: c.index):
                spanning += bool(choice.model_extra.get("policy_spans"))
                out["prompt_ids"].append(list(prompt_ids))
                out["completion_ids"].append(list(choice.model_extra["token_ids"]))
                out["logprobs"].append([token.logprob for token in choice.logprobs.content])
                out["policy_version"].append(das.get("policy_version", 0))
                self.records.append({"problem_id": problem_key(prompt), "policy_version": das.get("policy_version", 0),
                                     "sample_index": choice.index, "prompt_token_ids": list(prompt_ids),
                                     "output_token_ids": list(choice.model_extra["token_ids"]),
                                     "finish_reason": choice.finish_reason,
                                     "sample_key": None if seed is None else derive(seed, choice.index)})
        lengths = [len(ids) for ids in out["completion_ids"]]
        self.steps.append(RolloutStep(
            samples=len(lengths), seconds=generated.seconds, completion_tokens=sum(lengths),
            longest_tokens=max(lengths), draft_tokens=draft, accepted_tokens=accepted,
            policy_versions=sorted(set(out["policy_version"])), drafts_by_source=generated.drafts_by_source,
            prefetched=prefetched, spanning_samples=spanning))
        return out

    async def _complete(self, runs: list[tuple[Any, int]], step: int) -> list[Any]:
        async with AsyncOpenAI(base_url=f"{self.config.url}/v1", api_key=self.config.token or "unused",
                               timeout=self.config.timeout_s, max_retries=2) as client:
            return await asyncio.gather(*(
                client.chat.completions.create(
                    model=self.config.model, messages=prompt, n=n, max_tokens=self.config.max_tokens,
                    temperature=self.config.temperature, logprobs=True, extra_body={"return_token_ids": True},
                    seed=self.config.request_seed(step, i, prompt))
                for i, (prompt, n) in enumerate(runs)))

    def _draft_counts(self) -> dict[str, dict[str, int]]:
        response = httpx.get(f"{self.config.url}/metrics", headers=self._headers, timeout=30)
        response.raise_for_status()
        return draft_counts_by_source(response.text)


class WeightSync(TrainerCallback):
    """Pushes the policy to the service after every optimizer step (module docstring). `reloads`: the service's
    answer to each push, `{"step", "policy_version", "reload_s", "save_s"}`."""

    def __init__(self, config: ServiceConfig, weights_root: Path) -> None:
        self.config = config
        self.weights_root = weights_root
        self.reloads: list[dict[str, Any]] = []
        self._headers = {"Authorization": f"Bearer {config.token}"} if config.token else {}
        self._previous: Path | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        step = int(state.global_step)
        path = self.weights_root / f"step-{step:05d}"
        start = time.perf_counter()
        model.save_pretrained(path, safe_serialization=True)
        saved = time.perf_counter() - start
        self.reloads.append({"step": step, "save_s": saved, **self.push(path, step)})
        if self._previous is not None:
            shutil.rmtree(self._previous, ignore_errors=True)
        self._previous = path

    def push(self, path: Path, version: int) -> dict[str, Any]:
        """POST /update_weights; the service's answer (`policy_version`, `reload_s`). Raises on a refusal."""
        response = httpx.post(f"{self.config.url}/update_weights", json={"path": str(path), "version": version},
                              headers=self._headers, timeout=self.config.timeout_s)
        if response.status_code != 200:
            raise RuntimeError(f"/update_weights {path}: {response.status_code} {response.text}")
        answer = response.json()
        return {"policy_version": answer["policy_version"], "reload_s": answer["reload_s"]}


class WeightPush(TrainerCallback):
    """Pushes the policy to the service after every optimizer step over vLLM's weight transfer, no checkpoint on
    disk: `das.service.client.weights.WeightSender` sends the model's parameters to every engine (the service runs
    `das serve --weight-transfer gloo` on CPU engines, nccl on GPU ones) with version = the optimizer steps taken.
    `reloads`: one `{"step", "policy_version", "reload_s", "save_s"}` per push, as `WeightSync` keeps them
    (`reload_s` the push's seconds, `save_s` 0: nothing is written)."""

    def __init__(self, config: ServiceConfig) -> None:
        from das.service.client.weights import WeightSender

        self.reloads: list[dict[str, Any]] = []
        self._sender = WeightSender(config.url, config.token)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        step = int(state.global_step)
        start = time.perf_counter()
        version = self._sender.push(model, version=step)
        self.reloads.append({"step": step, "policy_version": version, "reload_s": time.perf_counter() - start,
                             "save_s": 0.0})

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._sender.close()
