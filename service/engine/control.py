"""An `EngineControl` message (service/wire/engine_control.py) applied to engines: the one place a verb meets an
engine's method, so every relay in between (backend, engine actor) passes the message on without knowing verbs."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from das.service.engine.protocol import Engine
from das.service.wire.engine_control import EngineControl


async def apply_control(engines: Sequence[Engine], message: EngineControl) -> Any:
    """`message` on every engine at once (the engine method named by its verb, with its arguments); their replies
    combined as the verb says. The first error an engine raises is raised."""
    method = message.verb
    replies = await asyncio.gather(*(getattr(engine, method)(**message.arguments()) for engine in engines))
    return message.combine(replies)
