"""An `EngineControl` message (service/wire/engine_control.py) applied to engines: the one place a verb meets an
engine's method, so every relay in between (backend, engine actor) passes the message on without knowing verbs."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from das.service.engine.protocol import Engine
from das.service.wire.engine_control import EngineControl


async def apply_control(engines: Sequence[Engine], message: EngineControl) -> Any:
    """`message` on every engine at once: the engine method named by its verb, with the arguments the message gives
    that engine (an engine given none sits it out). Once every engine has answered, their replies combined as the
    verb says, or the first error an engine raised (in the engines' order). Every engine is waited for, error or
    not, so that a caller that reacts to the error (a transfer given up everywhere) never races a step still running
    on another engine."""
    calls = [getattr(engine, message.verb)(**arguments)
             for index, engine in enumerate(engines) if (arguments := message.arguments(index)) is not None]
    replies = await asyncio.gather(*calls, return_exceptions=True)
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply
    return message.combine(replies)
