"""How a Ray node's GPUs are split into engines: one engine per `tensor_parallel_size` GPUs, each engine in a
NodeEngine actor of its own holding exactly its GPUs (Ray's `num_gpus`, so Ray sets the actor's CUDA_VISIBLE_DEVICES
and vLLM's workers see those GPUs only). Kept free of Ray and vLLM so the rule is checked where a node is seen.
"""

from __future__ import annotations


class LayoutError(ValueError):
    """A node whose GPUs cannot be split into engines of the configured size."""


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
