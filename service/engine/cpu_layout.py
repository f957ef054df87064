"""Where vLLM's CPU worker runs: in the engine core process, or in a process of its own (vLLM's CPU default).

vLLM's CPU platform runs the model in a worker process beside the engine core and reserves one core for the engine
core (its scheduler loop), binding the worker's OpenMP threads to the rest. On a machine of a few cores that
reservation is a large share: on 2 cores the model computes on one, and every step crosses two message queues
(three with drafts: vLLM fetches the draft tokens by an RPC of their own). With the worker in the engine core
process (vLLM's single-process executor, its default on a GPU) the forward pass gets every core and the steps no
RPC: SmolLM2 on the 2-core machine decoded in half the time, plain and speculative alike
(docs/design.md#vllm-cpu-defects-we-work-around). On a large machine one reserved core is little, and vLLM's
NUMA-aware binding is worth more than it, so "auto" keeps vLLM's layout there.

vLLM has no engine argument for this on the CPU (its platform turns the single-process executor into the
multiprocess one unless `VLLM_ENABLE_V1_MULTIPROCESSING` is 0, a variable that otherwise only concerns the
synchronous `LLM`), so `cpu_worker_layout` sets that variable while the engine is configured and spawned.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from das.service.engine.spawn_env import restored_environ

CpuWorker = Literal["auto", "in_process", "separate"]

# Up to this many usable CPUs, "auto" runs the worker in the engine core process: vLLM's reserved core is then a
# quarter of the machine or more. Measured on 2 CPUs only; the bound is the reasoning above, not a measurement.
IN_PROCESS_MAX_CPUS = 4

_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def worker_in_process(setting: CpuWorker, usable_cpus: int) -> bool:
    """Whether a CPU engine runs its worker in the engine core process. `usable_cpus`: the CPUs this process
    may run on (its affinity mask)."""
    if setting == "auto":
        return usable_cpus <= IN_PROCESS_MAX_CPUS
    return setting == "in_process"


def usable_cpus() -> int:
    """The CPUs this process may run on (a container's cpuset, a `taskset`), not the machine's count."""
    return len(os.sched_getaffinity(0))


class _SeedWarningFilter(logging.Filter):
    """Drops vLLM's warning that the variable "may affect the random state of the Python process that launched
    vLLM": it is about the synchronous `LLM`, which runs the engine core in the caller's process; an `AsyncLLM`'s
    engine core is a process of its own either way."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _ENV not in record.getMessage()


@contextmanager
def cpu_worker_layout(in_process: bool) -> Iterator[None]:
    """Within: a CPU engine created here runs its worker in the engine core process (`in_process`) or in a
    process of its own. Restores the environment and vLLM's logging on exit.

    In process, OMP_NUM_THREADS is removed, so the engine core's OpenMP takes every CPU it may run on (OpenMP's
    default, from the affinity mask): the engine core process inherits the variable, and inside a Ray actor it is
    Ray's 1 (`num_cpus=0` actors get one OpenMP thread), which would leave the model one core. (Setting it to the
    CPU count instead makes vLLM warn on every start that an external thread count is kept.) vLLM's own layout
    sets its worker's threads itself."""
    arg_log = logging.getLogger("vllm.engine.arg_utils")
    quiet = _SeedWarningFilter()
    with restored_environ((_ENV, "OMP_NUM_THREADS")):
        os.environ[_ENV] = "0" if in_process else "1"
        if in_process:
            os.environ.pop("OMP_NUM_THREADS", None)
        arg_log.addFilter(quiet)
        try:
            yield
        finally:
            arg_log.removeFilter(quiet)
