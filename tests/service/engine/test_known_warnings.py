"""The filter that drops vLLM warnings our configuration triggers knowingly, and only those."""

from __future__ import annotations

import io
import logging
import warnings

import pytest

from das.service.engine import known_warnings


@pytest.fixture
def vllm_stream():
    """A handler on the "vllm" logger writing into a string, removed after the test."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("vllm")
    saved = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield stream
    logger.removeHandler(handler)
    logger.setLevel(saved)


def test_known_warnings_are_dropped_and_others_kept(vllm_stream):
    known_warnings.install()
    known_warnings.install()  # idempotent: one filter per handler
    handler = logging.getLogger("vllm").handlers[-1]
    assert sum(isinstance(f, known_warnings.KnownWarningsFilter) for f in handler.filters) == 1
    log = logging.getLogger("vllm.v1.worker.cpu_worker")
    log.warning("%s is not found in LD_PRELOAD. For best performance, ...", "libtcmalloc")
    log.warning("Async scheduling not supported with custom_class-based speculative decoding and will be disabled.")
    log.warning("KV cache is nearly full")
    log.info("Triton is not installed. triton-cpu is expected on x86 CPUs.")  # not a warning: kept
    text = vllm_stream.getvalue()
    assert "LD_PRELOAD" not in text and "Async scheduling" not in text
    assert "KV cache is nearly full" in text and "Triton is not installed" in text


def test_nothing_is_dropped_when_vllm_logs_at_debug(vllm_stream):
    logging.getLogger("vllm").setLevel(logging.DEBUG)
    handler = logging.getLogger("vllm").handlers[-1]
    known_warnings.install()
    assert not any(isinstance(f, known_warnings.KnownWarningsFilter) for f in handler.filters)
    logging.getLogger("vllm.config").warning("Triton is not installed. triton-cpu is expected on x86 CPUs.")
    assert "Triton is not installed" in vllm_stream.getvalue()


def test_known_python_warnings_are_ignored_and_others_shown():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        known_warnings.install()
        warnings.warn("`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead",
                      FutureWarning)
        warnings.warn("something else is deprecated", FutureWarning)
    assert [str(w.message) for w in caught] == ["something else is deprecated"]
