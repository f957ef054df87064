"""The filter that drops vLLM warnings our configuration triggers knowingly, and only those."""

from __future__ import annotations

import io
import logging
import warnings
from logging.config import dictConfig

import pytest

from das.service.engine.vllm import known_warnings


@pytest.fixture(autouse=True)
def no_filters_installed():
    """Each test installs the filters afresh (install is idempotent per logger), and leaves none behind."""

    def remove() -> None:
        for known in known_warnings.KNOWN_WARNINGS:
            logger = logging.getLogger(known.logger)
            for f in [f for f in logger.filters if isinstance(f, known_warnings.KnownWarningsFilter)]:
                logger.removeFilter(f)

    remove()
    yield
    remove()


@pytest.fixture
def vllm_stream():
    """The "vllm" logger writing into a string (as vLLM configures it: its own handler, no propagation), and
    restored after the test."""
    stream = io.StringIO()
    logger = logging.getLogger("vllm")
    saved = (logger.level, logger.handlers[:], logger.propagate)
    logger.handlers[:] = [logging.StreamHandler(stream)]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield stream
    logger.setLevel(saved[0])
    logger.handlers[:] = saved[1]
    logger.propagate = saved[2]


def test_known_warnings_are_dropped_and_others_kept(vllm_stream):
    known_warnings.install(cpu=True)
    known_warnings.install(cpu=True)  # idempotent: one filter per logger
    worker = logging.getLogger("vllm.v1.worker.cpu_worker")
    assert sum(isinstance(f, known_warnings.KnownWarningsFilter) for f in worker.filters) == 1
    worker.warning("%s is not found in LD_PRELOAD. For best performance, ...", "libtcmalloc")
    logging.getLogger("vllm.config.vllm").warning(
        "Async scheduling not supported with custom_class-based speculative decoding and will be disabled.")
    worker.warning("KV cache is nearly full")
    logging.getLogger("vllm.platforms.cpu").info("Triton is not installed. triton-cpu is expected on x86 CPUs.")
    # a known text from another module is not ours to drop
    logging.getLogger("vllm.v1.core.sched").warning("Async scheduling not supported with custom_class-based ...")
    text = vllm_stream.getvalue()
    assert "LD_PRELOAD" not in text and text.count("Async scheduling") == 1
    assert "KV cache is nearly full" in text and "Triton is not installed" in text


def test_the_filter_survives_vllm_configuring_its_logging_again(vllm_stream):
    known_warnings.install(cpu=True)
    # what vLLM's configure_logging does in a process after our plugin loaded: new handlers on "vllm"
    dictConfig({"version": 1, "disable_existing_loggers": False,
                "handlers": {"vllm": {"class": "logging.StreamHandler", "stream": vllm_stream}},
                "loggers": {"vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False}}})
    logging.getLogger("vllm.config.speculative").warning("Using a custom class-based proposer backend. ...")
    logging.getLogger("vllm.config.speculative").warning("Draft model is smaller than expected")
    assert vllm_stream.getvalue() == "Draft model is smaller than expected\n"


def test_on_a_gpu_only_the_warnings_known_everywhere_are_dropped(vllm_stream):
    known_warnings.install(cpu=False)
    logging.getLogger("vllm.config.speculative").warning("Using a custom class-based proposer backend. ...")
    # async scheduling overlaps the host's work with the GPU's: that it is off stays visible there
    logging.getLogger("vllm.config.vllm").warning("Async scheduling not supported with custom_class-based ...")
    assert vllm_stream.getvalue() == "Async scheduling not supported with custom_class-based ...\n"


def test_nothing_is_dropped_when_vllm_logs_at_debug(vllm_stream):
    known_warnings.install(cpu=True)
    logging.getLogger("vllm").setLevel(logging.DEBUG)
    logging.getLogger("vllm.platforms.cpu").warning("Triton is not installed. triton-cpu is expected on x86 CPUs.")
    assert "Triton is not installed" in vllm_stream.getvalue()


def test_known_python_warnings_are_ignored_and_others_shown():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        known_warnings.install(cpu=True)
        warnings.warn("`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead",
                      FutureWarning)
        warnings.warn("something else is deprecated", FutureWarning)
    assert [str(w.message) for w in caught] == ["something else is deprecated"]


def test_torch_noting_the_missing_triton_is_dropped_on_the_cpu_only():
    """setup.sh removes the CUDA triton on the CPU; torch notes its absence at every engine start."""
    torch_triton = logging.getLogger("torch._library.triton")
    record = torch_triton.makeRecord(torch_triton.name, logging.WARNING, __file__, 1,
                                     "Triton not available, find_triton_kernels = []", (), None)
    other = torch_triton.makeRecord(torch_triton.name, logging.WARNING, __file__, 1, "something else", (), None)
    known_warnings.install(cpu=False)
    assert torch_triton.filter(record)
    known_warnings.install(cpu=True)
    assert not torch_triton.filter(record) and torch_triton.filter(other)
