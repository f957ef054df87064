"""`EngineControl`: vLLM's RL control verbs as one typed message, defined once and relayed as it is from the route
(service/http/rl_control.py) through the backend and every engine actor to every engine, where
service/engine/control.py applies it by the engine's method of the same name (docs/design.md "vLLM's RL control
plane"). Each verb says how the engines' replies combine into the one the route answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from das.service.wire.api import PauseMode


class _Verb(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def arguments(self) -> dict[str, Any]:
        """The engine method's keyword arguments: every field but the verb."""
        return self.model_dump(exclude={"verb"})

    @staticmethod
    def combine(replies: Sequence[Any]) -> Any:
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

    @staticmethod
    def combine(replies: Sequence[Any]) -> bool:
        return any(bool(reply) for reply in replies)


class AbortSamples(_Verb):
    """Every sample in flight ends with finish_reason abort; the reply counts them over all engines."""

    verb: Literal["abort_samples"] = "abort_samples"

    @staticmethod
    def combine(replies: Sequence[Any]) -> int:
        return sum(int(reply) for reply in replies)


EngineControl = Annotated[Pause | Resume | IsPaused | AbortSamples, Field(discriminator="verb")]
"""One control verb with its arguments."""
