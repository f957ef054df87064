"""`worker_rpc`: one of our worker RPCs on every model worker of an engine, its replies made one.

vLLM's `collective_rpc` answers with one reply per worker: one without tensor parallelism, `tensor_parallel_size`
with it (each worker runs the model's shard and its own copy of the DAS proposer on the same scheduler output). What
the replies mean decides how they become one, per RPC (`RULES`):

- "agree": state every worker holds alike (a reload, the history it imported, the tokens each request has); workers
  that answer differently are out of step, which no caller could act on: `WorkerRepliesDiffer` names the RPC and
  the replies.
- "output_rank": the proposer's draft statistics. vLLM schedules the drafts of its output rank (worker 0 without
  pipeline parallelism) and discards the others', so that worker's figures are the ones about the drafts served;
  the RPC still runs on every worker (each pops its counts, so none keeps them).
- "slowest": step profiles, column by column the per-worker maximum: a step ends when its slowest worker does.
  Workers that timed a different number of steps are out of step: `WorkerRepliesDiffer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

Rule = Literal["agree", "output_rank", "slowest"]

RULES: dict[str, Rule] = {
    "das_attach": "agree",
    "das_set_policy_version": "agree",
    "das_add_rollouts": "agree",
    "das_output_counts": "agree",
    "reload_weights": "agree",
    "das_abort_weight_update": "agree",
    "das_keep_weight_update": "agree",
    "das_save_weight_update": "agree",
    "das_refresh_tied_head": "agree",
    "das_profile_start": "agree",
    "das_pop_counts": "output_rank",
    "das_stats": "output_rank",
    "das_profile_take": "slowest",
}


class WorkerRepliesDiffer(RuntimeError):
    """The model workers of one engine answered an RPC whose replies must agree differently."""


def one_reply(method: str, replies: Sequence[Any]) -> Any:
    """The one reply of `method` (a key of RULES) from its per-worker `replies`, by the RPC's rule. ValueError for
    an RPC without a rule or no replies; WorkerRepliesDiffer for workers out of step."""
    rule = RULES.get(method)
    if rule is None:
        raise ValueError(f"{method}: no rule for its per-worker replies (service/engine/vllm/worker_rpc.py RULES)")
    if not replies:
        raise ValueError(f"{method}: no worker replied")
    if rule == "output_rank":
        return replies[0]
    if rule == "agree":
        if any(reply != replies[0] for reply in replies[1:]):
            raise WorkerRepliesDiffer(f"{method}: the engine's {len(replies)} model workers replied differently, "
                                      f"so they are out of step: {_shown(replies)}")
        return replies[0]
    return _slowest(method, replies)


def _slowest(method: str, replies: Sequence[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per column, per step, the maximum over the workers."""
    columns = replies[0].keys()
    for reply in replies[1:]:
        if reply.keys() != columns or any(len(reply[c]) != len(replies[0][c]) for c in columns):
            raise WorkerRepliesDiffer(f"{method}: the engine's model workers timed different steps: "
                                      f"{[{c: len(r[c]) for c in r} for r in replies]} per column")
    return {c: [max(values) for values in zip(*(reply[c] for reply in replies))] for c in columns}


def _shown(replies: Sequence[Any], limit: int = 200) -> str:
    text = "; ".join(f"worker {i}: {reply!r}" for i, reply in enumerate(replies))
    return text if len(text) <= limit else text[:limit] + " ..."


async def worker_rpc(llm: Any, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
                     ) -> Any:
    """`llm.collective_rpc(method, args=, kwargs=)` (vLLM's AsyncLLM) on every worker, its replies made one
    (`one_reply`)."""
    replies = await llm.collective_rpc(method, args=args, kwargs=kwargs)
    return one_reply(method, list(replies))
