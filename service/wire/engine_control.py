"""`EngineControl`: what the service asks of its engines, as one typed message defined once: vLLM's RL control verbs
(pause, resume, ...), the checkpoint reload, the history import and the steps of vLLM's weight transfer. A route
builds the message and the backend relays it as it is (`RolloutBackend.control`) through every engine actor
(service/cluster/node_engine.py) to service/engine/control.py, which applies it by the engine's method of the same
name (docs/design.md "vLLM's RL control plane"). Each verb says what arguments each engine gets and how the engines'
replies combine into the one the route answers. A combination runs over one actor's engines and again over the
actors' replies, so it gives the same answer however the engines are grouped.

What the service keeps or orders around a verb is not the message's but the coordinator's (service/cluster/
coordinator.py `RayBackend.control`): the weights a reload leaves for engines that load later, the history store an
import goes to, the trainer's group a transfer step goes to (service/cluster/weight_relay.py), the pause held until
the resume.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from das.service.wire.api import PauseMode


class EnginesDisagree(RuntimeError):
    """The engines' replies to one message do not agree where they must (every engine serving the version a reload
    or a push asked for): the service's engines no longer serve one policy."""


class _Verb(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def arguments(self, engine: int = 0) -> dict[str, Any] | None:
        """The engine method's keyword arguments for the `engine`-th engine the message reaches (None: that engine
        sits the verb out). By default every engine gets every field but the verb, as it is (not copied: a history
        import's rollouts are large)."""
        return {name: value for name, value in self if name != "verb"}

    def combine(self, replies: Sequence[Any]) -> Any:
        """The engines' replies as one (for a verb whose engines reply nothing: None)."""
        return None


class Pause(_Verb):
    """vLLM's pause_generation on every engine: `mode` abort (samples in flight end with finish_reason abort), wait
    (until they finish) or keep (frozen between two tokens until resume); `clear_cache` the prefix cache."""

    verb: Literal["pause"] = "pause"
    mode: PauseMode = "abort"
    clear_cache: bool = True


class Resume(_Verb):
    """Every engine generates again: held and frozen samples go on."""

    verb: Literal["resume"] = "resume"


class IsPaused(_Verb):
    """Whether any engine is paused."""

    verb: Literal["is_paused"] = "is_paused"

    def combine(self, replies: Sequence[Any]) -> bool:
        return any(bool(reply) for reply in replies)


class AbortSamples(_Verb):
    """Every sample in flight ends with finish_reason abort; the reply counts them over all engines."""

    verb: Literal["abort_samples"] = "abort_samples"

    def combine(self, replies: Sequence[Any]) -> int:
        return sum(int(reply) for reply in replies)


class ReloadWeights(_Verb):
    """Every engine loads the checkpoint directory `checkpoint` (a path its node reads) once its running samples have
    finished (at once while paused: held samples go on under the new weights) and serves it as policy `version`.
    The reply: `version`, which every engine must then serve (EnginesDisagree otherwise)."""

    verb: Literal["reload_weights"] = "reload_weights"
    checkpoint: str
    version: int

    def combine(self, replies: Sequence[Any]) -> int:
        return _serving(self.verb, self.version, replies)


class AddHistory(_Verb):
    """Finished rollouts (history-format dicts) imported for drafting, every engine given all of them. The reply:
    how many one engine kept (the most any kept). EngineInputError naming the rollout and field if any is invalid
    (then none is kept)."""

    verb: Literal["add_history"] = "add_history"
    rollouts: list[dict[str, Any]]

    def combine(self, replies: Sequence[Any]) -> int:
        return max((int(reply) for reply in replies), default=0)


class WeightTransferStep(_Verb):
    """A step of vLLM's weight transfer (docs/design.md "Weight transfer: weights without the disk"). The Ray
    service sends it to the engines of the trainer's group, not to every serving engine (service/cluster/
    weight_relay.py)."""


class InitWeightTransfer(WeightTransferStep):
    """The engines' workers join the trainer's group; the reply comes once they have. `init_info` is vLLM's, its
    `rank_offset` the rank of the first engine's first worker; each engine after it starts `workers_per_engine`
    ranks later (the relay that lays the group out sets both)."""

    verb: Literal["init_weight_transfer"] = "init_weight_transfer"
    init_info: dict[str, Any]
    workers_per_engine: int = Field(1, ge=1)

    def arguments(self, engine: int = 0) -> dict[str, Any] | None:
        if engine == 0:
            return {"init_info": self.init_info}
        first = self.init_info.get("rank_offset", 1)
        return {"init_info": {**self.init_info, "rank_offset": first + engine * self.workers_per_engine}}


class StartWeightUpdate(WeightTransferStep):
    """Opens a push: each engine waits for its running samples unless paused; new samples wait until it ends."""

    verb: Literal["start_weight_update"] = "start_weight_update"


class UpdateWeights(WeightTransferStep):
    """Every engine's workers receive the chunk the trainer broadcasts (staged, not loaded). `update_info`: vLLM's
    (names, dtype_names, shapes), or a list of them by worker rank."""

    verb: Literal["update_weights"] = "update_weights"
    update_info: dict[str, Any] | list[dict[str, Any]]


class FinishWeightUpdate(WeightTransferStep):
    """Every engine loads what it received and serves it as policy `version`; `keep`: the first engine the message
    reaches keeps the received tensors for `SaveWeightUpdate`. The reply: `version`, which every engine must then
    serve (EnginesDisagree otherwise)."""

    verb: Literal["finish_weight_update"] = "finish_weight_update"
    version: int
    keep: bool = False

    def arguments(self, engine: int = 0) -> dict[str, Any] | None:
        return {"version": self.version, "keep": self.keep and engine == 0}

    def combine(self, replies: Sequence[Any]) -> int:
        return _serving(self.verb, self.version, replies)


class SaveWeightUpdate(WeightTransferStep):
    """The first engine the message reaches (the one a `FinishWeightUpdate` told to keep) saves the tensors it kept
    as the checkpoint `<root>/v<version>`; the others sit it out. The reply: the checkpoint's path."""

    verb: Literal["save_weight_update"] = "save_weight_update"
    root: str
    version: int

    def arguments(self, engine: int = 0) -> dict[str, Any] | None:
        return {"root": self.root, "version": self.version} if engine == 0 else None

    def combine(self, replies: Sequence[Any]) -> str:
        paths = sorted({str(reply) for reply in replies})
        if len(paths) != 1:
            raise EnginesDisagree(f"{self.verb}: one engine saves the push, but {len(paths)} checkpoint paths came "
                                  f"back: {paths}")
        return paths[0]


class AbortWeightUpdate(WeightTransferStep):
    """Gives the open push up (the workers drop what they received, nothing is loaded); nothing where none is
    open."""

    verb: Literal["abort_weight_update"] = "abort_weight_update"


class ShutdownWeightTransfer(WeightTransferStep):
    """The engines leave the trainer's group (an open push is given up first)."""

    verb: Literal["shutdown_weight_transfer"] = "shutdown_weight_transfer"


def _serving(verb: str, version: int, replies: Sequence[Any]) -> int:
    """`version`, once every reply (the version an engine serves) is it; no reply: no engine answered (the Ray
    service's engines lost meanwhile catch up when they restart)."""
    others = sorted({int(reply) for reply in replies} - {version})
    if others:
        raise EnginesDisagree(f"{verb}: every engine must serve policy version {version}, but some serve {others}")
    return version


WeightTransferControl = (InitWeightTransfer | StartWeightUpdate | UpdateWeights | FinishWeightUpdate | SaveWeightUpdate
                         | AbortWeightUpdate | ShutdownWeightTransfer)
"""One step of vLLM's weight transfer."""

EngineControl = Annotated[Pause | Resume | IsPaused | AbortSamples | ReloadWeights | AddHistory | WeightTransferControl,
                          Field(discriminator="verb")]
"""One control verb with its arguments."""
