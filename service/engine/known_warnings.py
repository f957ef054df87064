"""vLLM warnings that every engine we start would print and that leave a user nothing to act on.

Each comes from a configuration we chose knowingly or from the CPU build we ship, and each entry says why it is
safe to drop. A filter on the handlers of vLLM's "vllm" logger (its own logging configuration, otherwise kept)
drops them in every process our plugin loads in (service/engine/plugin.py); any other vLLM warning still shows.
With VLLM_LOGGING_LEVEL=DEBUG nothing is dropped.
"""

from __future__ import annotations

import logging
import re
import warnings

KNOWN_WARNINGS: tuple[tuple[str, str], ...] = (
    ("Using a custom class-based proposer backend",
     "our proposer (service/engine/proposer.py) is one, by design"),
    ("Async scheduling not supported with custom_class-based speculative decoding",
     "known; on the CPU engine async scheduling made no measurable difference for `none` either "
     "(docs/results/2026-11-26-shadow-drafts.md)"),
    ("Triton is not installed",
     "the CPU build has no triton-cpu; vLLM runs its own CPU kernels"),
    ("Model Runner V2 requires Triton",
     "the V1 model runner is the one our CPU fixes build on (cpu_fixes/plugin.py)"),
    ("is not found in LD_PRELOAD",
     "tcmalloc and Intel OpenMP preloads measured no gain here (docs/results/2026-11-25-service-overhead.md, "
     "docs/results/2026-11-26-server-gap.md); cpu_allocator.py chooses the allocator"),
    ("Speculative decoding on CPU without Intel OpenMP",
     "Intel OpenMP preloaded into a das engine measured no gain (docs/results/2026-11-26-server-gap.md)"),
    ("CPU backend doesn't allow to use `torch.set_num_threads`",
     "vLLM's own thread binding refusing a later call; the binding stays as vLLM set it"),
    ("Inductor compilation was disabled by user settings",
     "vLLM's CPU platform itself picks DYNAMO_TRACE_ONCE with the Inductor backend, which this check misreads"),
    ("min_p and logit_bias parameters won't work with speculative decoding",
     "our sampling spec (service/api.py SamplingSpec) carries neither"),
)

# Python warnings vLLM's imports raise in every engine process, for the same reason.
KNOWN_PYTHON_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    ("`torch.distributed.reduce_op` is deprecated", FutureWarning,
     "raised by vLLM's own triton_utils/dispatcher.py scanning torch's attributes, not by a call of ours"),
)


class KnownWarningsFilter(logging.Filter):
    """Drops WARNING records whose message contains a KNOWN_WARNINGS text; passes every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        message = record.getMessage()
        return not any(text in message for text, _ in KNOWN_WARNINGS)


def install() -> None:
    """Adds the filter to each handler of the "vllm" logger in this process (idempotent); nothing where vLLM logs
    at DEBUG."""
    vllm_logger = logging.getLogger("vllm")
    if vllm_logger.isEnabledFor(logging.DEBUG):
        return
    for handler in vllm_logger.handlers:
        if not any(isinstance(f, KnownWarningsFilter) for f in handler.filters):
            handler.addFilter(KnownWarningsFilter())
    for text, category, _ in KNOWN_PYTHON_WARNINGS:
        warnings.filterwarnings("ignore", message=".*" + re.escape(text), category=category)
