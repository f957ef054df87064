"""How a Ray node's GPUs are split into engines: one engine per `tensor_parallel_size` GPUs, each engine in a
NodeEngine actor of its own holding exactly its GPUs (Ray's `num_gpus`, so Ray sets the actor's CUDA_VISIBLE_DEVICES
and vLLM's workers see those GPUs only); on a node without a GPU, the tensor parallel size its CPUs can run
(`cpu_engine_error`). Kept free of Ray and vLLM so the rule is checked where a node is seen.
"""

from __future__ import annotations

import os


class LayoutError(ValueError):
    """A node whose GPUs cannot be split into engines of the configured size, or whose CPUs cannot run one."""


def gpu_engines(gpus: int, tensor_parallel_size: int, node: str = "a node") -> int:
    """The engines a node with `gpus` GPUs runs, `tensor_parallel_size` GPUs each. LayoutError unless that size
    divides the node's GPUs (a GPU left over would sit idle, and too few would leave no engine)."""
    if tensor_parallel_size < 1:
        raise LayoutError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if gpus < 1 or gpus % tensor_parallel_size:
        raise LayoutError(f"{node} has {gpus} GPU(s), which --tensor-parallel-size {tensor_parallel_size} does not "
                          f"divide: every engine takes {tensor_parallel_size} GPU(s) and the node's must split "
                          f"evenly (use a tensor parallel size that divides {gpus}, or nodes with a multiple of "
                          f"{tensor_parallel_size} GPUs)")
    return gpus // tensor_parallel_size


def cpu_engine_error(tensor_parallel_size: int, cpus: int, numa_nodes: int | None, node: str = "a node"
                     ) -> LayoutError | None:
    """Why a node without a GPU cannot run an engine of `tensor_parallel_size` model workers, or None. vLLM's CPU
    backend runs each worker in a process of its own, bound to CPUs of its own: on a NUMA node of its own when it
    binds them itself (`VLLM_CPU_OMP_THREADS_BIND` unset or auto; `numa_nodes` is then the NUMA nodes this process
    may use, None where the binding is given by hand). On a 2-CPU node --tensor-parallel-size 3 failed inside the
    engine core ("Not enough allowed NUMA nodes to bind threads of 3 local CPUWorkers") and the service stayed up,
    never ready."""
    if tensor_parallel_size <= 1:
        return None
    most = max(min(cpus, cpus if numa_nodes is None else numa_nodes), 1)
    use = f"use --tensor-parallel-size {most}" + (" or less" if most > 1 else "")
    if tensor_parallel_size > cpus:
        return LayoutError(f"{node} has no GPU and {cpus} CPU(s), too few for --tensor-parallel-size "
                           f"{tensor_parallel_size}: an engine without a GPU runs that many model workers, each on "
                           f"CPUs of its own ({use} there)")
    if numa_nodes is not None and tensor_parallel_size > numa_nodes:
        return LayoutError(f"{node} has no GPU and {numa_nodes} NUMA node(s), too few for --tensor-parallel-size "
                           f"{tensor_parallel_size}: vLLM's CPU backend binds each model worker to a NUMA node of its "
                           f"own ({use} there, or bind the workers by hand with VLLM_CPU_OMP_THREADS_BIND)")
    return None


def cpu_node() -> tuple[int, int | None]:
    """(the CPUs this process may run on, the NUMA nodes vLLM's CPU backend would bind workers to: None where
    `VLLM_CPU_OMP_THREADS_BIND` binds them by hand or the kernel does not say) for `cpu_engine_error`."""
    cpus = len(os.sched_getaffinity(0))
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return cpus, None
    visible = os.environ.get("CPU_VISIBLE_MEMORY_NODES", "")  # vLLM's own narrowing of the allowed nodes
    try:
        with open("/proc/self/status") as status:
            line = next((x for x in status if x.startswith("Mems_allowed_list:")), None)
    except OSError:
        return cpus, None
    if line is None:
        return cpus, None
    allowed = _id_list(line.split(":", 1)[1].strip())
    if visible:
        allowed &= {int(x) for x in visible.split(",") if x.strip()}
    return cpus, len(allowed)


def _id_list(text: str) -> set[int]:
    """'0-2,4' -> {0, 1, 2, 4}."""
    ids: set[int] = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        ids.update(range(int(first), int(last or first) + 1))
    return ids
