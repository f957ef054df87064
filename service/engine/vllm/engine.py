"""`VllmEngine`: one vLLM engine (`AsyncLLM`) with the DAS proposer, serving groups of samples over asyncio.

Standalone (`das bench e2e`, tests) or inside a Ray actor (the service). One engine = one vLLM engine core
process and its model worker (in that process or beside it: service/engine/cpu_layout.py); the proposer and its
history live with the worker and are reached with `collective_rpc` (service/engine/vllm/worker.py).

Lifecycle: `await VllmEngine.create(config)`; `generate(group)` streams each sample as it finishes; between batches
`reload_weights(path)` loads a new checkpoint and bumps the policy version (the drafter keeps its history,
tagged by version); `await close()`.

vLLM's RL control plane: `pause(mode)`, `resume()`, `is_paused()` wrap AsyncLLM's pause_generation,
resume_generation and is_paused; `abort_samples()` aborts every sample in flight. A reload while paused does not
wait for the samples in flight (under "keep" they are frozen and would never finish): their KV cache is recomputed
with the new weights when they resume, and each records from which token on it was drawn from which weights
(`SampleResult.policy_spans`).

Tracing, with `config.otlp_traces_endpoint` (das serve --otlp-traces-endpoint): vLLM's own OTLP tracing is on, its
processes exporting to that URL over OTLP/HTTP, and each sample's request carries its group's trace parent for it
(GroupRequest.trace_parents) as its W3C trace context, so vLLM's request span (`llm_request`: queue, prefill and
decode times, token counts) hangs under the sample's `rollout.sample` span (service/http/tracing.py). vLLM samples
by its parent only: a request with no parent or an unsampled one (a batch the gateway does not trace) makes no span.

Errors: a bad group (an empty prompt or one longer than the context, token ids outside the vocabulary, given or
from the tokenizer, n < 1, unknown sampling keys, sampling that vLLM's `SamplingParams` refuses:
service/engine/vllm/sampling.py) raises `EngineInputError` (a ValueError) before anything is scheduled. A failure inside
vLLM for one sample ends that sample with finish_reason "error" and the message; the other samples and groups go
on. Anything else that goes wrong in a sample's task ends its group's stream with that error (RuntimeError), never
a stream that waits forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from das.scheduler.length import LengthCurve
from das.service.engine.vllm import known_warnings
from das.service.engine.config import EngineConfig, budget_settings, transfer_backend
from das.service.engine.contract import (IDLE_GAP_S, EngineConfigError, EngineInputError, EngineTally, StepPartTotals,
                                         context_error,
                                         validate_rollouts)
from das.service.engine.vllm.cost_warmup import warm_up_cost_fit
from das.service.engine.cpu_allocator import cpu_allocator_env, model_vocab_size, resolve_allocator
from das.service.engine.cpu_layout import cpu_worker_layout, usable_cpus, worker_in_process
from das.service.engine.vllm.patches import platform_name
from das.service.engine.vllm.extra_args import POSITION_OFFSET, SAMPLE_KEY, RequestTags
from das.service.engine.vllm.proposer import CONFIG_KEY
from das.service.engine.vllm.resume_seam import ResumeSeam
from das.service.engine.runner_choice import KEYED_PLATFORMS, V2_SWITCH, RunnerChoice, forces_v1
from das.service.engine.vllm.sampling import sampling_params
from das.service.engine.spawn_env import restored_environ
from das.service.engine.vllm.step_profile import StepProfile
from das.service.engine.vllm.token_prompt import engine_prompt
from das.service.engine.vllm.tool_calls import ToolCallParsing, template_messages, template_tools
from das.service.engine.serving_dtype import serving_dtype
from das.service.engine.vllm_version import check_vllm_version
from das.service.engine.vllm.worker_rpc import worker_rpc
from das.service.wire.api import GroupRequest, PauseMode, SampleResult, seeded_groups
from das.service.wire.sample_keys import fresh_seed
from das.service.wire.sample_progress import SampleProgress

if TYPE_CHECKING:
    from vllm import SamplingParams

log = logging.getLogger(__name__)

WORKER_EXTENSION = "das.service.engine.vllm.worker.EngineWorkerExtension"  # the DAS proposer's methods, step profiling


def engine_dtype(requested: str) -> str:
    """The dtype an engine on this machine serves `requested` in (`serving_dtype` on vLLM's platform): what a
    known model should be prepared in (`prepare_model(..., dtype=)`)."""
    from vllm.platforms import current_platform

    return serving_dtype(requested, cpu=current_platform.is_cpu())


# vLLM's tracing reads these from the environment, in this process and in the engine core's (inherited at its
# spawn); it writes the endpoint there itself (vllm/tracing/otel.py init_otel_tracer)
_OTLP_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
_OTEL_SERVICE = "OTEL_SERVICE_NAME"
_OTEL_SAMPLER = "OTEL_TRACES_SAMPLER"
# set for an engine core's spawn only (service/engine/spawn_env.py): one engine's settings are not the next one's
_SPAWN_SETTINGS = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_USE_AOT_COMPILE", V2_SWITCH, _OTLP_PROTOCOL, _OTLP_ENDPOINT,
                   _OTEL_SERVICE, _OTEL_SAMPLER)
ENGINE_SERVICE_NAME = "das-rollout-engine"  # vLLM's spans' service.name, beside the gateway's das-rollout
CPU_BLOCK_SIZE = 32  # the smallest KV-cache block vLLM's CPU attention takes (it takes multiples of 32)


def kv_block_size(requested: int | None, *, cpu: bool) -> int | None:
    """Tokens per KV-cache block: `requested`, else CPU_BLOCK_SIZE on the CPU and vLLM's default (None) on a GPU.

    Why not vLLM's CPU default of 128: prefix caching shares only whole blocks, and the n samples of a group are
    scheduled together, so with prompts shorter than a block (most RL prompts on a small model) every sample
    recomputed the whole prompt. With 32-token blocks the first sample's full blocks serve its siblings in the same
    step (measured: docs/design.md#vllm-cpu-defects-we-work-around). On a GPU vLLM's 16 already shares them.
    Raises ValueError for a CPU block size vLLM's CPU attention refuses (its own error comes from deep inside the
    engine core's start)."""
    if requested is None:
        return CPU_BLOCK_SIZE if cpu else None
    if cpu and requested % CPU_BLOCK_SIZE:
        raise ValueError(f"block_size {requested}: vLLM's CPU attention takes multiples of {CPU_BLOCK_SIZE} tokens")
    return requested


def _tally_logger_factory(tally: EngineTally) -> Any:
    """A vLLM stat-logger factory that adds every step's scheduler stats into `tally`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class TallyLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self._last_report_s: float | None = None  # time.monotonic() of the latest step report

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is None:
                return
            now = time.monotonic()
            if self._last_report_s is not None and now - self._last_report_s <= IDLE_GAP_S:
                tally.busy_s += now - self._last_report_s
            self._last_report_s = now
            tally.steps += 1
            tally.running = scheduler_stats.num_running_reqs
            tally.waiting = scheduler_stats.num_waiting_reqs
            spec = getattr(scheduler_stats, "spec_decoding_stats", None)
            if spec is not None:
                tally.drafts += spec.num_drafts
                tally.draft_tokens += spec.num_draft_tokens
                tally.accepted_tokens += spec.num_accepted_tokens
            cache = getattr(scheduler_stats, "prefix_cache_stats", None)
            if cache is not None:  # new requests only: a preempted one's second lookup is not a prompt
                tally.prompt_tokens += cache.queries
                tally.cached_prompt_tokens += cache.hits

        def log_engine_initialized(self) -> None:
            pass

    return TallyLogger


class _ClosedLLM:
    """What a closed VllmEngine holds in place of its AsyncLLM: dead, and every other use a clear error."""

    errored = True

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"the engine is closed ({name})")


class VllmEngine:
    """One AsyncLLM with the DAS proposer. Use `await VllmEngine.create(config)`."""

    def __init__(self, config: EngineConfig, llm: Any, tokenizer: Any, vocab_size: int,
                 tally: EngineTally | None = None) -> None:
        self.config = config
        self.tally = tally or EngineTally()
        self.runner: RunnerChoice | None = None  # what vLLM runs, set by `create`
        self.step_parts = StepPartTotals()  # with config.profile_steps: the timed steps' parts (read_step_parts)
        self._timing_steps = False  # the worker's step timer runs (set by `create`)
        self.policy_version = 0
        self._llm = llm
        self._tokenizer = tokenizer
        self._tool_calls = ToolCallParsing(tokenizer)
        self._vocab_size = vocab_size
        self._inflight = 0
        self._death_reported = False
        self._drained = asyncio.Event()
        self._drained.set()
        self._reloading = asyncio.Lock()
        self._swap: _Swap | None = None  # the open weight transfer's first half (start_weight_update), if any
        self._live: dict[str, _Spans] = {}  # samples in flight by request key
        # Changes to what the worker's drafter stats say (samples started or ended, reloads, imports): an idle
        # engine answers stats polls from `_stats` instead of an RPC, because every RPC wakes the worker into
        # vLLM's message-queue busy loop (1 s of a spinning core): polled every 2 s, an idle worker used 15 CPU
        # seconds in 30 s, against 1 without the polls (docs/design.md, "Engine").
        self._changes = 0
        self._stats: tuple[int, dict[str, Any]] | None = None  # (self._changes when read, the stats)
        self._oracle: Mapping[int, Sequence[int]] = {}  # sample key -> recorded output (set_oracle); empty: none

    @classmethod
    async def create(cls, config: EngineConfig) -> VllmEngine:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        check_vllm_version()
        # vLLM loads our plugin, which drops the known warnings in its processes, only after configuring the engine.
        known_warnings.install(cpu=current_platform.is_cpu())

        das = config.speculation == "das"
        dtype = engine_dtype(config.dtype)
        cpu = current_platform.is_cpu()
        platform = platform_name(cpu, current_platform.device_type, current_platform.is_rocm())
        if config.keyed_sampling and platform not in KEYED_PLATFORMS:
            raise EngineConfigError(
                f"keyed sampling is implemented for vLLM's {' and '.join(KEYED_PLATFORMS)} samplers, not {platform}'s: "
                "its plain steps would sample unkeyed while verification is keyed. Start the engines with "
                "`--engine-options '{\"keyed_sampling\": false}'` (vLLM's own sampler; samples then differ across "
                "speculation methods)")
        v1 = forces_v1(config.model_runner, config.keyed_sampling, cpu)
        transfer = transfer_backend(config.weight_transfer, gpu=not cpu)
        if transfer == "nccl" and cpu:
            raise EngineConfigError("weight_transfer nccl: vLLM's NCCL transfer needs CUDA, and this engine runs on "
                                    "the CPU; start it with `das serve --weight-transfer gloo` (or auto)")
        args = AsyncEngineArgs(
            model=config.model, dtype=dtype, max_model_len=config.max_model_len, seed=config.seed,
            max_num_seqs=config.max_num_seqs, enable_prefix_caching=config.enable_prefix_caching,
            block_size=kv_block_size(config.block_size, cpu=current_platform.is_cpu()),
            enforce_eager=config.enforce_eager, logprobs_mode="processed_logprobs",
            async_scheduling=False if v1 else None,
            # No progress bar per checkpoint load: an RL run reloads every step, three log lines each time.
            use_tqdm_on_load=False,
            speculative_config=config.speculative_config(),
            # Multiprocessing workers under the engine's own Ray actor, which holds the engine's GPUs already
            # (num_gpus = tensor_parallel_size): vLLM's "ray" backend would ask Ray for the same GPUs again.
            tensor_parallel_size=config.tensor_parallel_size,
            distributed_executor_backend="mp" if config.tensor_parallel_size > 1 else None,
            worker_extension_cls=WORKER_EXTENSION,
            weight_transfer_config={"backend": transfer} if transfer is not None else None,
            otlp_traces_endpoint=config.otlp_traces_endpoint,
            additional_config=({CONFIG_KEY: {"drafter": config.drafter.given(), "budget": budget_settings(config)}}
                               if das else {}))
        tally = EngineTally()
        in_process = worker_in_process(config.cpu_worker, usable_cpus()) and config.tensor_parallel_size == 1
        layout = (cpu_worker_layout(in_process) if cpu
                  else contextlib.nullcontext())
        allocator = (cpu_allocator_env(resolve_allocator(config.cpu_allocator, model_vocab_size(config.model)))
                     if cpu else contextlib.nullcontext())
        with restored_environ(_SPAWN_SETTINGS), layout, allocator:
            if cpu:
                # vLLM's CPU backend reads its KV cache size from the environment only.
                os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(config.kv_cache_gib)
                # vLLM 0.32 cannot reload the AOT compile cache its CPU backend writes ("'function' object has no
                # attribute 'finalize_loading'"), so every start recompiled (~2 min). Without AOT, Inductor's own
                # cache makes a warm start ~40 s. A user's value wins.
                os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
            if v1:
                os.environ[V2_SWITCH] = "0"
            if config.otlp_traces_endpoint is not None:
                # The endpoint is OTLP/HTTP (the gateway's collector); vLLM's exporter speaks gRPC unless told.
                os.environ[_OTLP_PROTOCOL] = "http/protobuf"
                os.environ.setdefault(_OTEL_SERVICE, ENGINE_SERVICE_NAME)
                # vLLM makes a span for every request it finishes, a root one where no parent came: only those
                # under a sampled sample span are kept, so the gateway's sampling decides for the engines too
                os.environ[_OTEL_SAMPLER] = "parentbased_always_off"
            llm = AsyncLLM.from_engine_args(args, stat_loggers=[_tally_logger_factory(tally)])
            runner = RunnerChoice.of(llm.vllm_config, platform, config.keyed_sampling)
        if config.keyed_sampling and not runner.keyed:
            log.warning("this engine runs %s (model_runner %s): its samples are vLLM's own draws, not keyed, so a "
                        "seed does not give the same samples with and without speculation", runner.describe(),
                        config.model_runner)
        try:
            tokenizer = llm.tokenizer
            vocab_size = llm.model_config.get_vocab_size()
            if das:
                await worker_rpc(llm, "das_attach")
                if config.cost_warmup_requests and config.budget.policy == "das":
                    await warm_up_cost_fit(llm, min(config.cost_warmup_requests, config.max_num_seqs), vocab_size)
        except BaseException:
            llm.shutdown()
            raise
        engine = cls(config, llm, tokenizer, vocab_size, tally)
        engine.runner = runner
        if config.profile_steps:
            if runner.step_timer_applies:
                await engine.start_step_profile()  # after the warm-ups: only traffic is timed
                engine._timing_steps = True
            else:
                log.warning("profile_steps times model runner V1 without async scheduling; this engine runs %s: "
                            "its steps are not profiled", runner.describe())
        if config.oracle_file is not None:
            from das.drafter.oracle import load_continuations

            try:
                engine.set_oracle(load_continuations(config.oracle_file))
            except ValueError:
                await engine.close()
                raise
        # This frame outlives the call (an exception vLLM keeps from its imports above holds it through a
        # traceback): it must not hold the AsyncLLM, or `close` could not release it (see there).
        del llm
        return engine

    @property
    def dead(self) -> bool:
        """True once vLLM's engine core has died (its requests fail with EngineDeadError): this engine serves
        nothing more."""
        return bool(self._llm.errored)

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (Hugging Face): encode, decode, apply_chat_template."""
        return self._tokenizer

    # ---- generation ----

    def prompt_token_ids(self, group: GroupRequest) -> list[int]:
        """The group's prompt as token ids, once the whole group is checked as the engine will run it (what the
        service's admission calls): the prompt against the vocabulary and the context length, the sampling as
        vLLM's `SamplingParams`. EngineInputError names the field."""
        if group.prompt_token_ids is not None:
            field, ids = "prompt_token_ids", list(group.prompt_token_ids)
        elif group.prompt is not None:
            field, ids = "prompt", list(self._tokenizer.encode(group.prompt))
        else:
            assert group.messages is not None
            if group.tool_parser is not None:
                self._tool_calls.check(group.tool_parser)
            try:
                # tools as vLLM's renderer passes them: the template shows them to the model (or ignores them)
                text = self._tokenizer.apply_chat_template(template_messages(group.messages),
                                                           tools=template_tools(group), add_generation_prompt=True,
                                                           tokenize=False)
            except Exception as exc:  # jinja's errors, or a template's own raise_exception (e.g. role order)
                raise EngineInputError(f"messages: the model's chat template cannot render them: {exc}") from None
            field, ids = "messages", list(self._tokenizer.encode(text, add_special_tokens=False))
        # Tokenized text too: a tokenizer with more tokens than the model's embedding (added tokens, a mismatched
        # checkpoint) gives ids the engine core cannot embed, and that error kills the engine, not the request.
        bad = [t for t in ids if not 0 <= t < self._vocab_size]
        if bad:
            raise EngineInputError(f"{field}: {len(bad)} token id(s) outside the vocabulary [0, {self._vocab_size}), "
                                   f"first {bad[0]}")
        if not ids:
            raise EngineInputError("prompt: no tokens (vLLM refuses an empty prompt)")
        if len(ids) >= self.config.max_model_len:
            raise EngineInputError(f"prompt is {len(ids)} tokens; the context holds {self.config.max_model_len} "
                                   f"and at least one output token must fit")
        self._sampling_params(group, "check", 0)
        if len(ids) + group.sampling.max_tokens > self.config.max_model_len:
            raise EngineInputError(context_error(len(ids), group.sampling.max_tokens, self.config.max_model_len))
        return ids

    def _sampling_params(self, group: GroupRequest, key: str, index: int) -> SamplingParams:
        """Sample `index`'s SamplingParams; a resumed sample (group.prefix_token_ids) draws its remaining tokens
        at the positions after its prefix."""
        resumed = len(group.prefix_token_ids[index]) if group.prefix_token_ids is not None else 0
        curve = LengthCurve.from_dict(group.length_curve.model_dump()) if group.length_curve is not None else None
        sample_key = group.sample_key(index)
        oracle = self._oracle.get(sample_key) if self._oracle and sample_key is not None else None
        tags = RequestTags(group.problem_id, key, index, group.predicted_tokens, curve,
                           resumed_tokens=resumed, session_id=group.session_id,
                           oracle=None if oracle is None else tuple(oracle))
        extra_args = tags.to_extra_args()
        key = sample_key
        if self.config.keyed_sampling and key is not None:
            extra_args[SAMPLE_KEY] = key
            if resumed:
                extra_args[POSITION_OFFSET] = resumed
        spec = group.sampling
        if resumed:
            spec = spec.model_copy(update={"max_tokens": spec.max_tokens - resumed})
        params = sampling_params(spec, self._vocab_size, extra_args)
        if group.tool_parser is not None:
            # as vLLM's hermes parser adjusts a request with tools: some models mark their tool-call tags special,
            # and skipped they would never reach the parser
            params.skip_special_tokens = False
        return params

    async def generate(self, group: GroupRequest | dict[str, Any],
                       on_progress: Callable[[SampleProgress], None] | None = None) -> AsyncIterator[SampleResult]:
        """Schedules the group's n samples and yields each one as it finishes (in finishing order).
        `on_progress` is called with each sample's new tokens at every engine step that made some (not for the
        step that finished it: its tokens come with the result).

        Raises EngineInputError before scheduling anything if the group is invalid. Closing the iterator early
        aborts the samples still running.
        """
        if not isinstance(group, GroupRequest):
            try:
                group = GroupRequest.model_validate(group)
            except ValidationError as exc:
                raise EngineInputError(str(exc)) from None
        prompt = self.prompt_token_ids(group)
        if group.sampling.seed is None:  # the gateway seeds every group; a direct caller may not
            (group,) = seeded_groups([group], fresh_seed())
        async with self._reloading:  # a reload waits for nothing new to start, then for the running to drain
            self._inflight += 1
            self._changes += 1
            self._drained.clear()
        try:
            group_id = uuid.uuid4().hex[:12]
            results: asyncio.Queue[SampleResult | BaseException] = asyncio.Queue()

            def surface(task: asyncio.Task[None]) -> None:
                # A task that raised never puts its sample: without its error the reader below would wait forever.
                error = None if task.cancelled() else task.exception()
                if error is not None:
                    results.put_nowait(error)

            tasks = [asyncio.create_task(self._sample(group, prompt, f"{group_id}-{i}", i, results, on_progress))
                     for i in range(group.n)]
            for task in tasks:
                task.add_done_callback(surface)
            try:
                for _ in range(group.n):
                    result = await results.get()
                    if isinstance(result, SampleResult):
                        yield result
                        continue
                    raise RuntimeError(f"a sample of problem {group.problem_id} failed: "
                                       f"{_describe(result)}") from result
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self._inflight -= 1
            self._changes += 1
            if self._inflight == 0:
                self._drained.set()

    async def _sample(self, group: GroupRequest, prompt: list[int], key: str, index: int,
                      results: asyncio.Queue[SampleResult | BaseException],
                      on_progress: Callable[[SampleProgress], None] | None = None) -> None:
        prefix = list(group.prefix_token_ids[index]) if group.prefix_token_ids is not None else []
        params = self._sampling_params(group, key, index)
        live = self._live[key] = _Spans([(self.policy_version, len(prefix))], base=len(prefix))
        start = time.perf_counter()
        first: float | None = None
        tokens: list[int] = []  # new tokens (after the prefix)
        logprobs: list[float] = []
        text: list[str] = []
        finish: str | None = None
        error: str | None = None
        seam = ResumeSeam(self._tokenizer, prefix, group.sampling) if prefix else None
        # vLLM's request span goes under the sample's span (tracing.py); an engine that does not trace passes none,
        # which vLLM would drop with a warning
        trace_headers = group.trace_headers(index) if self.config.otlp_traces_endpoint is not None else None
        try:
            if seam is not None and seam.ended_in_prefix(self._eos_token_ids()):
                finish = "stop"  # its last delivered token ended it: the death came before its result
            else:
                async for out in self._llm.generate(engine_prompt(self._llm, prompt + prefix), params,
                                                    request_id=key, trace_headers=trace_headers):
                    completion = out.outputs[0]
                    if completion.token_ids and first is None:
                        first = time.perf_counter() - start
                    new_logprobs = [float(lp[tok].logprob)
                                    for tok, lp in zip(completion.token_ids, completion.logprobs or ())]
                    if seam is not None and (cut := seam.stop_in(tokens, completion.token_ids)) is not None:
                        tokens.extend(completion.token_ids[:cut])
                        logprobs.extend(new_logprobs[:cut])
                        finish = "stop"
                        break  # a stop string that began in the prefix: vLLM sees only the new text
                    if on_progress is not None and completion.token_ids and completion.finish_reason is None:
                        on_progress(SampleProgress(index, len(prefix) + len(tokens), list(completion.token_ids),
                                                   new_logprobs, completion.text, self.policy_version))
                    logprobs.extend(new_logprobs)
                    tokens.extend(completion.token_ids)
                    live.received = len(prefix) + len(tokens)
                    text.append(completion.text)
                    finish = completion.finish_reason
        except Exception as exc:  # one sample's failure must not take its siblings down (cancellation passes)
            if self._llm.errored:
                # A dead engine core fails every running sample with the same error: one report, not a traceback
                # for each of them.
                if not self._death_reported:
                    self._death_reported = True
                    log.error("the engine died (%s); its running samples end with finish_reason 'error'. A worker "
                              "process killed with exit code -9 (in vLLM's log above) is usually the kernel's "
                              "out-of-memory killer.", _describe(exc))
            else:
                log.warning("sample %s of problem %s failed", key, group.problem_id, exc_info=True)
            error, finish = _describe(exc), "error"
        finally:
            del self._live[key]
        spans = live.of(len(prefix) + len(tokens))
        counts = await self._draft_counts(key) if not self._llm.errored else {}
        out_text = seam.text(tokens) if seam is not None else "".join(text)
        content, calls = (self._tool_calls.parse(group, out_text, prefix + tokens)
                          if group.tool_parser is not None and error is None else (None, None))
        results.put_nowait(SampleResult(
            problem_id=group.problem_id, sample_index=index, token_ids=prefix + tokens, logprobs=logprobs,
            finish_reason=finish if finish in ("stop", "length", "abort", "error") else "stop",
            policy_version=spans[0][0], policy_spans=spans if len(spans) > 1 or prefix else None,
            draft_tokens=counts.get("proposed", 0),
            accepted_tokens=counts.get("accepted", 0), decode_steps=counts.get("steps", 0),
            first_token_s=first, total_s=time.perf_counter() - start, error=error,
            text=out_text, prompt_token_ids=prompt, tool_calls=calls, content=content))

    def _eos_token_ids(self) -> set[int]:
        eos = getattr(self._tokenizer, "eos_token_id", None)
        return {eos} if isinstance(eos, int) else set()

    async def _draft_counts(self, key: str) -> dict[str, int]:
        if self.config.speculation != "das":
            return {}
        try:
            counts = await worker_rpc(self._llm, "das_pop_counts", args=([key],))
        except Exception as exc:  # counts are statistics: losing them must not lose the sample
            log.warning("draft counts of %s unavailable: %s", key, exc)
            return {}
        return counts.get(key, {})

    # ---- weights, history, stats ----

    async def reload_weights(self, checkpoint: str | os.PathLike[str], version: int | None = None) -> int:
        """Loads safetensors weights from `checkpoint` (a directory) once the running samples have finished, and
        serves them as policy `version` (default: the current one + 1; it must be newer). New groups wait while
        it runs. Returns the version now served."""
        path = Path(checkpoint)
        if not path.is_dir() or not any(path.glob("*.safetensors")):
            raise EngineInputError(f"{path}: not a directory with *.safetensors weights")
        new = self._next_version(version)
        async with self._reloading:
            swap = await self._begin_swap()
            await worker_rpc(self._llm, "reload_weights", kwargs={"weights_path": str(path)})
            # vLLM's reload leaves a tied output layer on the old weights (weight_transfer.py refresh_tied_head)
            await worker_rpc(self._llm, "das_refresh_tied_head")
            await self._end_swap(swap, new)
        return self.policy_version

    def _next_version(self, version: int | None) -> int:
        new = self.policy_version + 1 if version is None else version
        if new <= self.policy_version:
            raise EngineInputError(f"version: must be newer than the served version {self.policy_version}, "
                                   f"got {new}")
        return new

    async def _begin_swap(self) -> _Swap:
        """The first half of every weight change (a checkpoint reload, a transfer), under `_reloading`: unless
        paused, wait for the running samples to finish; while paused, note how many tokens each held sample has."""
        self._changes += 1
        if await self._llm.is_paused():
            # The samples held by the pause (frozen under "keep", or queued) go on under the new weights from
            # the tokens they have now: the worker's count, since outputs may still be on their way here.
            return _Swap(await worker_rpc(self._llm, "das_output_counts"))
        await self._drained.wait()
        return _Swap(None)

    async def _end_swap(self, swap: _Swap, new: int) -> None:
        """The second half, once the new weights are loaded: the prefix cache reset, `new` served, held samples'
        spans split at their token counts, the drafter's policy window advanced."""
        paused = swap.produced is not None
        # Held samples' KV was computed by the old weights: preempted, it is recomputed on resume.
        await self._llm.reset_prefix_cache(reset_running_requests=paused)
        self.policy_version = new
        if swap.produced is not None:
            for key, live in self._live.items():
                live.update(new, swap.produced.get(key))
        if self.config.speculation == "das":
            await worker_rpc(self._llm, "das_set_policy_version", args=(new,))

    # ---- vLLM's weight transfer (the engines start with a weight_transfer_config: EngineConfig.weight_transfer) ----

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """vLLM's init_weight_transfer_engine on every worker: they join the trainer's group (returns once they
        have). EngineInputError for init info the backend refuses."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        try:
            await self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))
        except Exception as exc:
            raise _transfer_error(exc) from None

    async def start_weight_update(self) -> None:
        """Opens a transfer: what a checkpoint reload does first (unless paused, the running samples finish; new
        ones wait until the transfer ends), then vLLM's start_weight_update on every worker."""
        if self._swap is not None:
            raise EngineInputError("a weight update is already open on this engine: finish it first")
        await self._reloading.acquire()
        try:
            self._swap = await self._begin_swap()
            await self._llm.start_weight_update()
        except BaseException:
            self._swap = None
            self._reloading.release()
            raise

    async def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """vLLM's update_weights on every worker: they receive this chunk from the trainer (staged, not loaded).
        A failure gives the whole transfer up (nothing loaded) and raises: EngineInputError for a refused name,
        shape or dtype, RuntimeError for a broken group (a peer died, or hung past the timeout)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        if self._swap is None:
            raise EngineInputError("no weight update is open: call /start_weight_update first")
        try:
            await self._llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))
        except Exception as exc:
            await self.abort_weight_update()
            raise _transfer_error(exc) from None

    async def finish_weight_update(self, version: int | None = None, keep: bool = False) -> int:
        """Loads what the workers received and serves it as policy `version` (default: served + 1; it must be
        newer): the second half of a checkpoint reload (prefix cache, spans of held samples, drafter window).
        `keep`: the workers keep the received tensors until `save_weight_update` (gloo only). Returns the version
        served. On any failure the transfer is given up and the engine serves what it did."""
        swap = self._swap
        if swap is None:
            raise EngineInputError("no weight update is open: call /start_weight_update first")
        try:
            new = self._next_version(version)
            try:
                if keep:
                    await worker_rpc(self._llm, "das_keep_weight_update")
                await self._llm.collective_rpc("finish_weight_update")
            except Exception as exc:
                raise _transfer_error(exc) from None
        except BaseException:
            await self.abort_weight_update()
            raise
        try:
            await self._end_swap(swap, new)
        finally:
            self._swap = None
            self._reloading.release()
        return self.policy_version

    async def save_weight_update(self, root: str, version: int) -> str:
        """Saves the tensors the workers kept from the last finished transfer (`finish_weight_update(keep=True)`) as
        the checkpoint `<root>/v<version>` (service/engine/vllm/pushed_weights.py) and returns its path. The engine
        core writes it between steps, so this engine's sampling waits for the write (the model's bytes to disk)."""
        return str(await worker_rpc(self._llm, "das_save_weight_update", args=(root, version)))

    async def abort_weight_update(self) -> None:
        """Gives up the open transfer, if any: the workers drop what they received and nothing is loaded."""
        if self._swap is None:
            return
        try:
            await worker_rpc(self._llm, "das_abort_weight_update")
        finally:
            self._swap = None
            self._reloading.release()

    async def shutdown_weight_transfer(self) -> None:
        """vLLM's shutdown_weight_transfer_engine: the workers leave the trainer's group."""
        await self.abort_weight_update()
        await self._llm.shutdown_weight_transfer_engine()

    # ---- vLLM's RL control plane ----

    async def pause(self, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        """vLLM's `AsyncLLM.pause_generation`: "abort" ends the samples in flight with finish_reason "abort" (with
        the tokens they had), "wait" returns once they have finished, "keep" freezes them until `resume`; in
        every mode new samples are queued until `resume`. `clear_cache`: reset the prefix cache once drained.
        ValueError for a mode vLLM does not know."""
        await self._llm.pause_generation(mode=mode, clear_cache=clear_cache)

    async def resume(self) -> None:
        await self._llm.resume_generation()

    async def is_paused(self) -> bool:
        return bool(await self._llm.is_paused())

    async def abort_samples(self) -> int:
        """Aborts every sample in flight without pausing: each ends with finish_reason "abort" and the tokens it
        had. Returns how many."""
        keys = list(self._live)
        if keys:
            await self._llm.abort(keys)
        return len(keys)

    async def add_history(self, rollouts: list[dict[str, Any]]) -> int:
        """Imports finished rollouts (history-format dicts) into the drafter as sealed history. All are validated
        here first (EngineInputError naming the rollout and field), so a bad one changes nothing."""
        validate_rollouts(rollouts)
        if self.config.speculation != "das":
            return 0
        self._changes += 1
        count = await worker_rpc(self._llm, "das_add_rollouts", args=(rollouts,))
        return int(count)

    def set_oracle(self, continuations: Mapping[int, Sequence[int]]) -> None:
        """The oracle benchmark arm (drafter/oracle.py): from now on a sample whose keyed-sampling key is in
        `continuations` drafts the recorded output given for it (its whole output, token ids) instead of the
        history bank's drafts; an empty mapping turns the oracle off. Only a das engine with keyed sampling drafts,
        and only under keyed sampling is a key's output the same in every arm (ValueError otherwise)."""
        if continuations and (self.config.speculation != "das" or not self.config.keyed_sampling):
            raise ValueError("the oracle needs a das engine with keyed sampling")
        self._oracle = dict(continuations)

    async def drafter_stats(self) -> dict[str, Any]:
        """The proposer's stats (DasProposer.stats); read from the worker unless the engine has been idle and
        unchanged since the last read (see `_changes`)."""
        if self.config.speculation != "das":
            return {}
        changes = self._changes
        if self._inflight == 0 and self._stats is not None and self._stats[0] == changes:
            return dict(self._stats[1])
        stats = await worker_rpc(self._llm, "das_stats")
        self._stats = (changes, dict(stats))
        return dict(stats)

    async def start_step_profile(self) -> None:
        """Times every step from now on (service/engine/vllm/step_profile.py); `take_step_profile` reads and clears."""
        await worker_rpc(self._llm, "das_profile_start")

    async def take_step_profile(self) -> StepProfile:
        """The steps since `start_step_profile` or the last take, summarised; clears them."""
        columns = await worker_rpc(self._llm, "das_profile_take")
        return StepProfile.of(columns)

    async def read_step_parts(self) -> StepPartTotals:
        """With `profile_steps`: the parts of every step timed since the engine started (the steps since the last
        read are fetched from the worker); else the empty totals, without a call."""
        if self._timing_steps and not self.dead:
            self.step_parts = self.step_parts.add(await worker_rpc(self._llm, "das_profile_take"))
        return self.step_parts

    async def close(self) -> None:
        """Stops the engine processes; lets AsyncLLM's output task see its cancellation before returning, so the
        event loop can be closed cleanly afterwards. The AsyncLLM is released and collected now: left to the
        interpreter's exit, its `__del__` shut down again with vLLM's modules half torn down and printed a
        traceback ("'NoneType' object is not callable") under every command that ran an engine."""
        if isinstance(self._llm, _ClosedLLM):  # closed already
            return
        llm, self._llm = self._llm, _ClosedLLM()
        llm.shutdown()
        await asyncio.sleep(0)
        del llm
        gc.collect()


@dataclass
class _Swap:
    """A weight change under way: `produced` holds the held samples' token counts while paused (None: not paused,
    the running samples drained first)."""

    produced: dict[str, int] | None


@dataclass
class _Spans:
    """One sample in flight: [policy version, index of its first token] pairs (SampleResult.policy_spans), and the
    tokens received so far."""

    spans: list[tuple[int, int]]
    received: int = 0
    base: int = 0  # a resumed sample's delivered tokens: its request's output starts after them

    def update(self, version: int, produced: int | None) -> None:
        """New weights serve from the request's output token `produced` on (None: the engine no longer holds the
        sample: finished, its last tokens still on their way, or not started if none came)."""
        if produced is None and self.received > self.base:
            return  # finished under the old weights
        at = self.base + (produced or 0)
        if at == self.spans[-1][1]:
            self.spans[-1] = (version, at)  # no token of the old weights since its span began
        else:
            self.spans.append((version, at))

    def of(self, tokens: int) -> list[tuple[int, int]]:
        """The spans of a sample that ended with `tokens` tokens: a span that starts past them holds none."""
        return [span for span in self.spans if span[1] < tokens] or self.spans[:1]


_RPC_FAILED = "Call to collective_rpc method failed: "  # vLLM's wording of a worker RPC that raised


def _transfer_error(exc: Exception) -> Exception:
    """A weight-transfer RPC's failure as the service's error: vLLM hands a worker's exception back as a plain
    Exception with its message, so the message tells a refusal of the caller's init or update info (it names the
    field: EngineInputError) from a broken transfer (RuntimeError)."""
    message = str(exc).removeprefix(_RPC_FAILED)
    if "update_info" in message or "init_info" in message:
        return EngineInputError(message)
    return RuntimeError(message or _describe(exc))


def _describe(exc: BaseException) -> str:
    """`Type: message` of an exception, following vLLM's message-less wrappers (EngineGenerateError) to the
    cause."""
    while not str(exc) and exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}"
